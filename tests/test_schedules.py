"""Per-layer schedules in graft: mergekit's gradient lists and ``filter:`` conditionals, against brute force.

The brute force reads a schedule as mergekit documents it, written out here on its own: a layer i of
N sits at t = i / (N − 1), every tensor outside the layers at t = 0; a gradient [v_0 … v_m] at t is
the linear interpolation between v_⌊t·m⌋ and the next; a list of conditionals takes the first whose
filter is a substring of the tensor's name. Each tensor's Δ is scaled by λ(t)·weight(t) before it is
scored, and a global mask still ranks the whole model against one exact threshold.
"""

from __future__ import annotations

import json
import math
import re
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import yaml
from mergekit.merge_methods import PerGroupValues, merge_state_dicts

from graftmerge.demo.tiny_models import make_graft_inputs, save_tiny_model
from graftmerge.errors import GraftError
from graftmerge.formats.fisher_cache import open_fisher_cache
from tests.helpers.fisher_caches import write_diagonal_cache, write_mixed_cache
from tests.helpers.models import assert_identical, read_model
from tests.helpers.references import brute_force_graft
from tests.helpers.runners import error_line, run_cli, run_process

LAYERS = 4
TINY = {"num_hidden_layers": LAYERS, "hidden_size": 32, "intermediate_size": 48, "vocab_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2}
LAMBDA = [0.2, 0.6, 1.0]  # LiNeS-style: the update grows with depth
FT_WEIGHT = [{"filter": "mlp", "value": [1.0, 0.5]}, {"value": 0.8}]
FT2_WEIGHT = 0.5
RHO_GLOBAL = 0.05
RHO_TENSOR = [{"filter": "embed", "value": 0.0}, {"value": [0.3, 0.02]}]
CASES = [("diagonal", "global"), ("diagonal", "tensor"), ("kfac", "global"), ("kfac", "tensor")]


def position(name: str) -> float:
    """mergekit's t of a tensor: layer i of N at i / (N − 1); embeddings, final norm and head at 0."""
    found = re.match(r"model\.layers\.(\d+)\.", name)
    return int(found.group(1)) / (LAYERS - 1) if found else 0.0


def interpolate(values: list[float], t: float) -> float:
    """A gradient at t: linear between the two endpoints around t·(len − 1)."""
    scaled = t * (len(values) - 1)
    low = int(scaled)
    high = min(len(values) - 1, low + 1)
    fraction = scaled - low
    return (1 - fraction) * values[low] + fraction * values[high]


def evaluate(setting, name: str) -> float:
    """A setting for one tensor: a number, a gradient, or the first conditional whose filter is in the name."""
    if isinstance(setting, list) and setting and isinstance(setting[0], dict):
        setting = next(c["value"] for c in setting if c.get("filter") is None or c["filter"] in name)
    return interpolate([float(v) for v in setting], position(name)) if isinstance(setting, list) else float(setting)


def config_text(models, fisher: Path, scope: str, lam=LAMBDA, rho=None, mask: str = "auto") -> str:
    rho = (RHO_TENSOR if scope == "tensor" else RHO_GLOBAL) if rho is None else rho
    return json.dumps({  # JSON is YAML
        "merge_method": "graft", "base_model": str(models["post"]), "dtype": "float32", "out_dtype": "float32",
        "models": [{"model": str(models["donor"]), "parameters": {"role": "donor"}},
                   {"model": str(models["donor_ft"]), "parameters": {"role": "donor_ft", "weight": FT_WEIGHT}},
                   {"model": str(models["donor_ft2"]), "parameters": {"role": "donor_ft", "weight": FT2_WEIGHT}}],
        "parameters": {"lambda": lam, "rho": rho, "rho_scope": scope, "fisher": str(fisher), "mask": mask},
    }, indent=1)


def brute_force(models, fisher: Path, scope: str, lam=LAMBDA, rho=None):
    """The dense whole-model graft with every tensor's own λ(t)·weight(t) (and ρ(t) under tensor scope)."""
    rho = (RHO_TENSOR if scope == "tensor" else RHO_GLOBAL) if rho is None else rho
    fine_tunes = [(models["donor_ft"], lambda n: evaluate(lam, n) * evaluate(FT_WEIGHT, n)),
                  (models["donor_ft2"], lambda n: evaluate(lam, n) * evaluate(FT2_WEIGHT, n))]
    per_tensor_rho = (lambda n: evaluate(rho, n)) if isinstance(rho, list) else rho
    return brute_force_graft(models["post"], models["donor"], fine_tunes, fisher, per_tensor_rho, scope)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("schedules")
    paths = make_graft_inputs(root, seed=11, **TINY)
    donor = read_model(paths["donor"])
    save_tiny_model(root / "base-ft2", seed=17, base=donor, noise=0.03, **TINY)
    return {**paths, "donor_ft2": root / "base-ft2"}


@pytest.fixture(scope="module")
def caches(models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("schedule-fisher")
    return {"diagonal": write_diagonal_cache(root / "diag", models["post"], seed=5),
            "kfac": write_mixed_cache(root / "mixed", models["post"], seed=6)}


@pytest.fixture(scope="module")
def merged(models, caches, tmp_path_factory):
    """Each case merged once through the in-process mergekit-yaml: (config file, output folder)."""
    root = tmp_path_factory.mktemp("schedule-merges")
    done: dict[tuple[str, str], tuple[Path, Path]] = {}

    def merge(cache: str, scope: str) -> tuple[Path, Path]:
        if (cache, scope) not in done:
            config, out = root / f"{cache}-{scope}.yml", root / f"{cache}-{scope}"
            config.write_text(config_text(models, caches[cache], scope))
            result = run_cli("mergekit-yaml", str(config), str(out))
            assert result.returncode == 0, result.stderr[-3000:]
            done[cache, scope] = config, out
        return done[cache, scope]

    return merge


@pytest.mark.parametrize("cache,scope", CASES)
def test_schedule_equals_brute_force(models, caches, merged, cache, scope):
    expected = brute_force(models, caches[cache], scope)
    got = read_model(merged(cache, scope)[1])
    assert set(expected.kinds.values()) == ({"diagonal"} if cache == "diagonal" else {"diagonal", "kfac"})
    for name in expected.expected:
        if expected.kinds.get(name) == "kfac":  # the same masked set: equal up to the rotations' matmul rounding
            assert torch.allclose(got[name], expected.expected[name], atol=1e-6, rtol=0), name
        else:
            assert torch.equal(got[name], expected.expected[name]), name
    masked = {name: int(mask.sum()) for name, mask in expected.masks.items()}
    assert sum(masked.values()) > 0
    if scope == "tensor":  # the filter's ρ = 0 for the embedding, the gradient's elsewhere
        assert masked["model.embed_tokens.weight"] == 0 and masked["model.layers.0.mlp.up_proj.weight"] > 0


@pytest.mark.parametrize("scope", ["global", "tensor"])
def test_float64_reference_masks_the_same_coordinates(models, caches, merged, scope):
    """Dense float64, the whole model at once: every coordinate's Δ = Σ λ(t)·w(t)(θft − θdonor), score F·Δ², one
    stable top-⌈ρ·n⌉ (ρ read as the decimal it prints as; global, or per tensor with ρ(t)); the merge zeroes
    exactly those Δ and keeps the others."""
    cache = open_fisher_cache(caches["diagonal"])
    post, donor = read_model(models["post"]), read_model(models["donor"])
    fine_tunes = [(read_model(models["donor_ft"]), FT_WEIGHT), (read_model(models["donor_ft2"]), FT2_WEIGHT)]
    names = sorted(post)
    deltas = {n: sum(evaluate(LAMBDA, n) * evaluate(w, n) * (ft[n].double() - donor[n].double())
                     for ft, w in fine_tunes) for n in names}
    scores = {n: cache.diagonal(n).double() * deltas[n].square() for n in names}

    def top(flat: torch.Tensor, rho: float) -> torch.Tensor:
        k = math.ceil(Fraction(repr(rho)) * flat.numel())
        chosen = torch.zeros_like(flat, dtype=torch.bool)
        chosen[torch.sort(flat, descending=True, stable=True).indices[:k]] = True
        return chosen & (flat > 0)

    if scope == "global":
        flat = top(torch.cat([scores[n].reshape(-1) for n in names]), RHO_GLOBAL)
        masks = dict(zip(names, torch.split(flat, [scores[n].numel() for n in names])))
    else:
        masks = {n: top(scores[n].reshape(-1), evaluate(RHO_TENSOR, n)) for n in names}
    got = read_model(merged("diagonal", scope)[1])
    for n in names:
        mask = masks[n].reshape(post[n].shape)
        assert torch.equal(got[n] == post[n], mask), n  # masked: θpost exactly; kept: Δ ≠ 0 moved it
        expected = post[n].double() + deltas[n]
        assert torch.allclose(got[n].double()[~mask], expected[~mask], rtol=0, atol=1e-6), n


def test_global_threshold_sees_the_scheduled_scales(models, caches, merged):
    """With the schedule, the global mask differs from the one of a single λ: it ranks the scaled Δ."""
    scheduled = brute_force(models, caches["diagonal"], "global")
    flat = brute_force(models, caches["diagonal"], "global", lam=1.0)
    assert any(not torch.equal(scheduled.masks[n], flat.masks[n]) for n in scheduled.masks)
    got = read_model(merged("diagonal", "global")[1])
    assert all(torch.equal(got[n], scheduled.expected[n]) for n in got)


def test_subprocess_mergekit_yaml_equals_in_process(models, merged, tmp_path):
    config, in_process = merged("kfac", "global")
    result = run_process("mergekit-yaml", str(config), str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_identical(read_model(tmp_path / "out"), read_model(in_process))


def per_group(models, lam=LAMBDA, rho=None) -> tuple[list[dict], dict]:
    """(state dicts post, donor, ft, ft2; PerGroupValues of λ, weights, ρ per tensor, as the brute force reads them)."""
    dicts = [read_model(models[key]) for key in ("post", "donor", "donor_ft", "donor_ft2")]
    names = list(dicts[0])
    parameters = {
        "lambda": PerGroupValues([evaluate(lam, n) for n in names]),
        "weight": PerGroupValues([[1.0, evaluate(FT_WEIGHT, n), evaluate(FT2_WEIGHT, n)] for n in names]),
    }
    if rho is not None:
        parameters["rho"] = PerGroupValues([evaluate(rho, n) for n in names])
    return dicts, parameters


@pytest.mark.parametrize("cache,scope", CASES)
def test_merge_state_dicts_with_per_group_values_equals_the_cli(models, caches, merged, cache, scope):
    dicts, parameters = per_group(models, rho=RHO_TENSOR if scope == "tensor" else None)
    parameters.update({"rho_scope": scope, "fisher": str(caches[cache])})
    if scope == "global":
        parameters["rho"] = RHO_GLOBAL
    got = merge_state_dicts(dicts, "graft", base=0, parameters=parameters, dtype=torch.float32)
    assert_identical(got, read_model(merged(cache, scope)[1]))


def test_per_group_rho_under_a_global_mask_is_refused(models, caches):
    dicts, parameters = per_group(models, rho=RHO_TENSOR)
    parameters["fisher"] = str(caches["diagonal"])
    with pytest.raises(GraftError, match="graft parameter rho: a per-layer or per-tensor rho"):
        merge_state_dicts(dicts, "graft", base=0, parameters=parameters, dtype=torch.float32)


def test_per_group_mask_is_refused(models, caches):
    dicts, parameters = per_group(models)
    names = list(dicts[0])
    parameters.update({"fisher": str(caches["kfac"]), "rho": 0.1,
                       "mask": PerGroupValues(["kfac" if "mlp" in n else "diagonal" for n in names])})
    with pytest.raises(GraftError, match="graft parameter mask must be one value for all tensors"):
        merge_state_dicts(dicts, "graft", base=0, parameters=parameters, dtype=torch.float32)


def test_plan_reports_the_scheduled_mask(models, caches, merged, tmp_path):
    config, _ = merged("diagonal", "global")
    result = run_cli("graftmerge", "plan", str(config), "--rho", f"{RHO_GLOBAL},0.2", "--json",
                     str(tmp_path / "plan.json"), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "per-layer schedules: weight of" in result.stdout and "lambda scheduled" in result.stdout
    report = json.loads((tmp_path / "plan.json").read_text())
    for rho in (RHO_GLOBAL, 0.2):
        expected = brute_force(models, caches["diagonal"], "global", rho=rho).masks
        found = {t["name"]: t["masked"][repr(rho)] for t in report["tensors"]}
        assert found == {name: int(mask.sum()) for name, mask in expected.items()}, rho


def test_sweep_multiplies_a_scheduled_lambda(models, caches, merged, tmp_path):
    """The swept λ multiplies every number of a scheduled lambda; each folder is its own config's merge."""
    config, _ = merged("kfac", "tensor")
    result = run_cli("graftmerge", "sweep", str(config), "--lambda", "0.5,2", "--rho", "0.1", "-o",
                     str(tmp_path / "sweep"))
    assert result.returncode == 0, result.stderr[-3000:]
    for lam in (0.5, 2.0):
        folder = tmp_path / "sweep" / f"lambda-{lam!r}_rho-0.1"
        written = yaml.safe_load((folder / "mergekit_config.yml").read_text())["parameters"]
        scaled = [lam * v for v in LAMBDA]
        assert written["lambda"] == scaled and written["rho"] == 0.1
        expected = brute_force(models, caches["kfac"], "tensor", lam=scaled, rho=0.1).expected
        got = read_model(folder)
        assert all(torch.allclose(got[n], expected[n], atol=1e-6, rtol=0) for n in expected), lam
    alone = tmp_path / "alone"  # and bit for bit mergekit-yaml's merge of the folder's own config
    assert run_cli("mergekit-yaml", str(folder / "mergekit_config.yml"), str(alone)).returncode == 0
    assert_identical(read_model(alone), got)


BAD = {
    "rho as a gradient under a global mask": (
        {"rho": [0.01, 0.1]}, "graft parameter rho: a per-layer or per-tensor rho"),
    "rho as a filter under a global mask": (
        {"rho": [{"filter": "mlp", "value": 0.1}, {"value": 0.01}]}, "graft parameter rho: a per-layer"),
    "an empty gradient": ({"lambda": []}, "graft parameter lambda: an empty gradient list"),
    "an empty gradient in a filter": (
        {"lambda": [{"filter": "mlp", "value": []}, {"value": 1.0}]}, "graft parameter lambda: an empty gradient"),
    "a word in a gradient": ({"lambda": [0.5, "half"]}, "graft parameter lambda: 'half' in a schedule is not a"),
    "rho beyond 1 in a schedule": (
        {"rho_scope": "tensor", "rho": [0.1, 1.5]}, "graft parameter rho: 1.5 in a schedule is outside [0, 1)"),
    "mask as a schedule": ({"mask": [{"filter": "mlp", "value": "kfac"}]}, "graft parameter mask must be a single"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_schedules_are_refused_before_any_work(models, caches, tmp_path, case):
    change, expected = BAD[case]
    data = json.loads(config_text(models, caches["kfac"], "global"))
    data["parameters"].update(change)
    (tmp_path / "bad.yml").write_text(json.dumps(data))
    line = error_line(run_cli("mergekit-yaml", str(tmp_path / "bad.yml"), str(tmp_path / "out")))
    assert expected in line, line
    assert not (tmp_path / "out").exists()


def test_bad_schedule_is_refused_by_plan_and_sweep(models, caches, tmp_path):
    data = json.loads(config_text(models, caches["diagonal"], "global"))
    data["parameters"]["rho"] = [0.01, 0.1]
    (tmp_path / "bad.yml").write_text(json.dumps(data))
    for command in (("plan", "--rho", "0.1"), ("sweep", "--lambda", "1", "--rho", "0.1", "-o", str(tmp_path / "s"))):
        line = error_line(run_cli("graftmerge", command[0], str(tmp_path / "bad.yml"), *command[1:]))
        assert "graft parameter rho: a per-layer" in line, (command, line)
    assert not (tmp_path / "s").exists()


def test_filter_matching_no_tensor_is_warned_about(models, caches, tmp_path):
    data = json.loads(config_text(models, caches["diagonal"], "global"))
    data["parameters"]["lambda"] = [{"filter": "no_such_module", "value": 0.5}, {"value": [0.2, 1.0]}]
    (tmp_path / "warn.yml").write_text(json.dumps(data))
    result = run_cli("mergekit-yaml", str(tmp_path / "warn.yml"), str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == ["warning: graft parameter lambda: filter 'no_such_module' matches no tensor of the model; "
                        "that condition is never used"]


def test_card_names_the_schedules_not_a_placeholder(merged):
    """A scheduled λ or weight has no single number: the card says it is per layer, and ρ keeps its value."""
    from huggingface_hub import ModelCard

    _, out = merged("kfac", "global")
    card = ModelCard.load(out / "README.md")
    assert "λ per layer (the schedule in the config below)" in card.text
    assert "weights per layer" in card.text and f"ρ = {RHO_GLOBAL!r}" in card.text
    assert "λ = 1.0" not in card.text
