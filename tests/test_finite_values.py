"""Finite in, finite out: a NaN or Inf never reaches a written model, a mask, or a pulled adapter.

Each non-finite value is planted at one stage (an input as stored, a value beyond the
working dtype, a Δ term that overflows, a LoRA product, a KFAC rotation, θpost + Δ' in the
output dtype) and refused in one line naming the tensor and the input, exit 2, OUT
untouched and the inputs unchanged: through ``mergekit-yaml``, ``graftmerge merge``,
``graftmerge sweep``, the threshold pass itself, ``merge_state_dicts`` and ``delta pull``.
Large but finite values still merge, bit for bit as the formula gives them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from graftmerge.demo.tiny_models import make_graft_inputs, save_tiny_model
from graftmerge.errors import GraftError
from graftmerge.formats.fisher_cache import open_fisher_cache
from graftmerge.math.finite import FLOAT32_MAX, fits, product_bound
from graftmerge.pipeline.config_files import read_merge_config
from graftmerge.pipeline.graft_plan import GraftInputs, plan_from_merge_config
from graftmerge.pipeline.threshold_pass import compute_global_threshold
from tests.helpers.configs import graft_yaml
from tests.helpers.fake_hub import place_in_hf_cache
from tests.helpers.fisher_caches import write_diagonal_cache, write_mixed_cache
from tests.helpers.models import copy_model, read_model, tree_digest
from tests.helpers.runners import run_cli

UP = "model.layers.0.mlp.up_proj.weight"  # ranked by both caches (KFAC in the mixed one)
Q = "model.layers.1.self_attn.q_proj.weight"  # the adapters' one target (64 × 64)
NORM = "model.norm.weight"
PREFIX = "base_model.model."


# -- fixtures: the models, poisoned copies, caches and adapters, made once --------------------------------------------


def edit_tensor(folder: Path, name: str, edit) -> Path:
    """``edit(tensor)`` (in place) on tensor ``name`` of a sharded model or delta folder, in its own shard."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"][name]
    tensors = load_file(str(shard))
    edit(tensors[name])
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return folder


def poke(value: float, index: int = 5):
    """An edit setting one value of a tensor (flat ``index``)."""
    return lambda tensor: tensor.view(-1).__setitem__(index, value)


def write_adapter(folder: Path, post: Path, *, alpha: float = 8.0, r: int = 4, scale: float = 0.1,
                  a_dtype: torch.dtype = torch.float32, edit=None, seed: int = 0) -> Path:
    """A PEFT LoRA folder on ``Q`` (r × in A, out × r B), written as PEFT's save_pretrained lays it out."""
    folder.mkdir(parents=True)
    model_config = json.loads((post / "config.json").read_text())
    hidden = model_config["hidden_size"]
    generator = torch.Generator().manual_seed(seed)
    module = Q.removesuffix(".weight")
    tensors = {
        f"{PREFIX}{module}.lora_A.weight": (scale * torch.randn(r, hidden, generator=generator)).to(a_dtype),
        f"{PREFIX}{module}.lora_B.weight": scale * torch.randn(hidden, r, generator=generator),
    }
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["q_proj"], "bias": "none",
              "task_type": "CAUSAL_LM", "base_model_name_or_path": "acme/tiny-base",
              "auto_mapping": {"base_model_class": "Qwen3ForCausalLM"}}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def _float64_beyond_float32(tensors: dict) -> None:
    key = next(k for k in tensors if k.endswith("lora_A.weight"))
    tensors[key][0, 0] = 1e300  # finite as stored (float64), inf in the graft's float32


def along_top_eigenvectors(kfac: Path):
    """An edit making B·A = r · u₁v₁ᵀ (u₁, v₁: the KFAC cache's leading eigenvectors of ``Q``).

    Every entry of Δ = s·r·u₁v₁ᵀ is a fraction of s·r, but Δ̃ = UᵀΔV puts all of s·r into one
    entry: with s·r beyond float32's range and s within it, Δ is finite and Δ̃ is not.
    """
    factors = open_fisher_cache(kfac).kfac(Q)

    def edit(tensors: dict) -> None:
        for key in tensors:
            if key.endswith("lora_A.weight"):
                tensors[key] = factors.V[:, 0].float().expand(tensors[key].shape).contiguous()
            else:
                tensors[key] = factors.U[:, 0].float()[:, None].expand(tensors[key].shape).contiguous()
    return edit


@pytest.fixture(scope="module")
def m(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("finite")
    paths = make_graft_inputs(root, seed=11)
    post, donor, ft = paths["post"], paths["donor"], paths["donor_ft"]
    copy = lambda source, name: copy_model(source, root / name)  # noqa: E731
    paths["diag"] = write_diagonal_cache(root / "diag", post)
    paths["kfac"] = write_mixed_cache(root / "kfac", post)
    paths["donor NaN"] = edit_tensor(copy(donor, "donor-nan"), UP, poke(math.nan))
    paths["post NaN"] = edit_tensor(copy(post, "post-nan"), NORM, poke(math.nan, 3))
    paths["ft Inf"] = edit_tensor(copy(ft, "ft-inf"), UP, poke(math.inf))
    paths["ft NaN"] = edit_tensor(copy(ft, "ft-nan"), UP, poke(math.nan))
    paths["ft huge"] = edit_tensor(copy(ft, "ft-huge"), UP, poke(3e38))
    paths["donor huge"] = edit_tensor(copy(donor, "donor-huge"), UP, poke(-3e38))
    paths["ft 1e5"] = edit_tensor(copy(ft, "ft-1e5"), UP, poke(1e5))
    from graftmerge.pipeline.delta_extract import extract_delta

    paths["delta NaN"] = extract_delta(donor, ft, root / "delta-nan", progress=False)
    edit_tensor(paths["delta NaN"], UP, poke(math.nan))
    paths["lora huge alpha"] = write_adapter(root / "lora-alpha", post, alpha=1e38, scale=3.0)
    paths["lora float64"] = write_adapter(root / "lora-f64", post, a_dtype=torch.float64,
                                          edit=_float64_beyond_float32)
    paths["lora rotation"] = write_adapter(root / "lora-rotation", post, alpha=1e39,
                                           edit=along_top_eigenvectors(paths["kfac"]))
    paths["lora fine"] = write_adapter(root / "lora-fine", post)
    return paths


def config_for(m: dict[str, Path], case: str) -> str:
    """The graft config of one case (see CASES)."""
    post, donor, ft, diag, kfac = m["post"], m["donor"], m["donor_ft"], m["diag"], m["kfac"]
    alone = lambda name, **kw: (f"merge_method: graft\nbase_model: {post}\nmodels:\n"  # noqa: E731
                               f"  - model: {m[name]}\n    parameters: {{role: delta}}\n"
                               f"parameters:\n  rho: {kw.get('rho', 0.0)}\n"
                               + (f"  fisher: {kfac}\n  mask: kfac\n" if kw.get("rho") else "")
                               + "dtype: float32\nout_dtype: float32\n")
    configs = {
        "NaN in donor, ρ = 0": graft_yaml(post, m["donor NaN"], [(ft, 1)]),
        "NaN in the post model, ρ = 0": graft_yaml(m["post NaN"], donor, [(ft, 1)]),
        "Inf in donor_ft, ρ = 0": graft_yaml(post, donor, [(m["ft Inf"], 1)]),
        "Inf in donor_ft, diagonal global": graft_yaml(post, donor, [(m["ft Inf"], 1)], rho=0.1, fisher=diag),
        "NaN in donor_ft, diagonal global": graft_yaml(post, donor, [(m["ft NaN"], 1)], rho=0.1, fisher=diag),
        "Inf in donor_ft, KFAC global": graft_yaml(post, donor, [(m["ft Inf"], 1)], rho=0.1, fisher=kfac, mask="kfac"),
        "Inf in donor_ft, rho_scope tensor": graft_yaml(post, donor, [(m["ft Inf"], 1)], rho=0.1, fisher=diag,
                                                        scope="tensor"),
        "NaN in donor_ft, KFAC rho_scope tensor": graft_yaml(post, donor, [(m["ft NaN"], 1)], rho=0.1, fisher=kfac,
                                                             scope="tensor", mask="kfac"),
        "NaN in a delta folder, ρ = 0": alone("delta NaN"),
        "NaN in a delta folder, KFAC global": alone("delta NaN", rho=0.1),
        "θft − θdonor overflows float32": graft_yaml(post, m["donor huge"], [(m["ft huge"], 1)]),
        "λ·(θft − θdonor) overflows float32": graft_yaml(post, donor, [(ft, 1)], lam=1e40),
        "donor_ft beyond float16, dtype: float16": graft_yaml(post, donor, [(m["ft 1e5"], 1)], dtype="float16",
                                                             out_dtype="float16"),
        "θpost + Δ beyond float16, out_dtype: float16": graft_yaml(post, donor, [(m["ft 1e5"], 1)],
                                                                   out_dtype="float16"),
        "BASE+ADAPTER, huge alpha": graft_yaml(post, donor, [(f"{donor}+{m['lora huge alpha']}", 1)]),
        "BASE+ADAPTER, float64 factor beyond float32": graft_yaml(post, donor, [(f"{donor}+{m['lora float64']}", 1)]),
        "adapter delta, huge alpha, ρ = 0": alone("lora huge alpha"),
        "adapter delta, KFAC rotation overflows": alone("lora rotation", rho=0.1),
    }
    return configs[case]


# case -> what the one line must say (the tensor, and the input it came from)
CASES = {
    "NaN in donor, ρ = 0": [f"donor {{donor NaN}}: tensor '{UP}' contains NaN or Inf"],
    "NaN in the post model, ρ = 0": [f"post model {{post NaN}}: tensor '{NORM}' contains NaN or Inf"],
    "Inf in donor_ft, ρ = 0": [f"donor_ft {{ft Inf}}: tensor '{UP}' contains NaN or Inf"],
    "Inf in donor_ft, diagonal global": [f"donor_ft {{ft Inf}}: tensor '{UP}' contains NaN or Inf"],
    "NaN in donor_ft, diagonal global": [f"donor_ft {{ft NaN}}: tensor '{UP}' contains NaN or Inf"],
    "Inf in donor_ft, KFAC global": [f"donor_ft {{ft Inf}}: tensor '{UP}' contains NaN or Inf"],
    "Inf in donor_ft, rho_scope tensor": [f"donor_ft {{ft Inf}}: tensor '{UP}' contains NaN or Inf"],
    "NaN in donor_ft, KFAC rho_scope tensor": [f"donor_ft {{ft NaN}}: tensor '{UP}' contains NaN or Inf"],
    "NaN in a delta folder, ρ = 0": [f"delta tensor '{UP}' contains NaN or Inf", "{delta NaN}/model-"],
    "NaN in a delta folder, KFAC global": [f"delta tensor '{UP}' contains NaN or Inf", "{delta NaN}/model-"],
    "θft − θdonor overflows float32": [f"tensor '{UP}': λ·weight · (θft − θdonor) of donor_ft {{ft huge}} "
                                       "against donor {donor huge} overflows float32"],
    "λ·(θft − θdonor) overflows float32": ["λ·weight · (θft − θdonor) of donor_ft {donor_ft} against donor {donor} "
                                           "overflows float32",
                                           "(λ·weight = 1e+40)"],
    "donor_ft beyond float16, dtype: float16": [f"donor_ft {{ft 1e5}}: tensor '{UP}' has values beyond float16's "
                                                "range (largest |x| 1e+05)"],
    "θpost + Δ beyond float16, out_dtype: float16": [f"tensor '{UP}': θpost + Δ has values beyond float16's range",
                                                     "Δ from donor_ft {ft 1e5}"],
    "BASE+ADAPTER, huge alpha": [f"tensor '{Q}': the LoRA product scaling·B·A of module "
                                 f"{Q.removesuffix('.weight')} overflows float32 (scaling = 2.5e+37)",
                                 "donor_ft {donor}+{lora huge alpha}"],
    "BASE+ADAPTER, float64 factor beyond float32": ["{lora float64}/adapter_model.safetensors: adapter tensor "
                                                    f"'{PREFIX}{Q.removesuffix('.weight')}.lora_A.weight' has values "
                                                    "beyond float32's range (largest |x| 1e+300, stored as float64)"],
    "adapter delta, huge alpha, ρ = 0": [f"tensor '{Q}': the LoRA product scaling·B·A", "{lora huge alpha}"],
    "adapter delta, KFAC rotation overflows": [f"tensor '{Q}': its KFAC rotation Δ̃ = UᵀΔV overflows float32",
                                               "{lora rotation} (a LoRA adapter)"],
}


def expected_parts(m: dict[str, Path], case: str) -> list[str]:
    """CASES[case] with each ``{fixture key}`` replaced by its path."""
    parts = []
    for text in CASES[case]:
        for key, value in m.items():
            text = text.replace("{" + key + "}", str(value))
        parts.append(text)
    return parts


def refused_line(result) -> str:
    """Exit 2 and exactly one line on stderr, ``error: ...``; no traceback."""
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-3000:])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return lines[0]


def watched(m: dict[str, Path]) -> dict[str, str]:
    return {key: tree_digest(path) for key, path in m.items() if path.is_dir()}


# -- through the CLIs -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_a_nonfinite_value_is_one_line_and_out_is_untouched(m, tmp_path, case):
    """mergekit-yaml (and graftmerge merge for some): exit 2, one line naming tensor and input, OUT as it was."""
    config = tmp_path / "graft.yml"
    config.write_text(config_for(m, case))
    before = watched(m)
    line = refused_line(run_cli("mergekit-yaml", str(config), str(tmp_path / "out"), "--quiet"))
    for part in expected_parts(m, case):
        assert part in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graft.yml"]  # no OUT, staging, lock or old copy
    assert watched(m) == before


def test_a_refused_merge_leaves_the_previous_out_as_it_was(m, tmp_path):
    good, bad = tmp_path / "good.yml", tmp_path / "bad.yml"
    good.write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1)]))
    bad.write_text(config_for(m, "Inf in donor_ft, ρ = 0"))
    out = tmp_path / "out"
    assert run_cli("mergekit-yaml", str(good), str(out), "--quiet").returncode == 0
    before = tree_digest(out)
    line = refused_line(run_cli("mergekit-yaml", str(bad), str(out), "--quiet"))
    assert f"tensor '{UP}' contains NaN or Inf" in line
    assert tree_digest(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["bad.yml", "good.yml", "out"]


@pytest.mark.parametrize("case", ["Inf in donor_ft, ρ = 0", "Inf in donor_ft, KFAC global",
                                  "BASE+ADAPTER, huge alpha", "adapter delta, KFAC rotation overflows"])
def test_graftmerge_merge_refuses_the_same(m, tmp_path, case):
    config = tmp_path / "graft.yml"
    config.write_text(config_for(m, case))
    line = refused_line(run_cli("graftmerge", "merge", str(config), str(tmp_path / "out"), "--quiet"))
    assert all(part in line for part in expected_parts(m, case)), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case, rho", [("Inf in donor_ft, ρ = 0", "0"), ("NaN in donor_ft, diagonal global", "0.1"),
                                       ("adapter delta, huge alpha, ρ = 0", "0")])
def test_a_sweep_point_refuses_the_same(m, tmp_path, case, rho):
    config = tmp_path / "graft.yml"
    config.write_text(config_for(m, case))
    line = refused_line(run_cli("graftmerge", "sweep", str(config), "--lambda", "1", "--rho", rho,
                                "-o", str(tmp_path / "sweep"), "--quiet"))
    assert all(part in line for part in expected_parts(m, case)), line
    assert not (tmp_path / "sweep").exists()


# -- the threshold pass: nothing non-finite reaches the search (no mask budget spent on it) ----------------------------


@pytest.mark.parametrize("case", ["Inf in donor_ft, diagonal global", "NaN in donor_ft, diagonal global",
                                  "Inf in donor_ft, KFAC global", "NaN in a delta folder, KFAC global",
                                  "adapter delta, KFAC rotation overflows"])
def test_the_threshold_pass_refuses_before_the_search(m, tmp_path, case, monkeypatch):
    from graftmerge.math import global_threshold

    config = tmp_path / "graft.yml"
    config.write_text(config_for(m, case))
    inputs = GraftInputs.open(plan_from_merge_config(read_merge_config(str(config))[0]))
    searched = []
    original = global_threshold.ThresholdSearch.add_coarse
    monkeypatch.setattr(global_threshold.ThresholdSearch, "add_coarse",
                        lambda self, name, scores: (searched.append(name), original(self, name, scores)))
    with pytest.raises(GraftError) as error:
        compute_global_threshold(inputs, progress=False)
    assert all(part in str(error.value) for part in expected_parts(m, case)), error.value
    poisoned = Q if "adapter" in case else UP
    assert poisoned not in searched  # its scores never reached the search


# -- the Python API: merge_state_dicts ---------------------------------------------------------------------------------


def test_merge_state_dicts_refuses_nonfinite_inputs_and_products(m):
    from mergekit.merge_methods import merge_state_dicts

    from graftmerge.pipeline.lora_inputs import lora_delta_state_dict

    post, donor, ft = read_model(m["post"]), read_model(m["donor"]), read_model(m["donor_ft"])
    bad = dict(ft)
    bad[UP] = ft[UP].clone()
    bad[UP].view(-1)[5] = math.inf
    roles = {"role": {"donor": "donor", "ft": "donor_ft"}}
    for rho, extra in ((0.0, {}), (0.1, {"fisher": str(m["diag"])}), (0.1, {"fisher": str(m["kfac"]),
                                                                            "mask": "kfac"})):
        with pytest.raises(GraftError, match=rf"donor_ft \(input 'ft'\): tensor '{UP}' contains NaN or Inf"):
            merge_state_dicts({"post": post, "donor": donor, "ft": bad}, "graft", base="post",
                              parameters={**roles, "rho": rho, **extra}, dtype=torch.float32)
    with pytest.raises(GraftError, match=rf"tensor '{UP}': θpost \+ Δ has values beyond float16's range"):
        big = dict(ft)
        big[UP] = ft[UP].clone()
        big[UP].view(-1)[5] = 1e5
        merge_state_dicts({"post": post, "donor": donor, "ft": big}, "graft", base="post", parameters=roles,
                          dtype=torch.float32, out_dtype=torch.float16)
    model_config = json.loads((m["post"] / "config.json").read_text())
    in_memory = lambda adapter: lora_delta_state_dict(  # noqa: E731
        load_file(adapter / "adapter_model.safetensors"), json.loads((adapter / "adapter_config.json").read_text()),
        post, model_config=model_config)
    with pytest.raises(GraftError, match=rf"tensor '{Q}': the LoRA product scaling·B·A of module"):
        in_memory(m["lora huge alpha"])
    with pytest.raises(GraftError, match=rf"tensor '{Q}': its KFAC rotation Δ̃ = UᵀΔV overflows float32"):
        merge_state_dicts({"post": post, "lora": in_memory(m["lora rotation"])}, "graft", base="post",
                          parameters={"role": {"lora": "delta"}, "rho": 0.1, "fisher": str(m["kfac"]), "mask": "kfac"},
                          dtype=torch.float32)


def test_run_merge_raises_the_graft_error(m, tmp_path):
    """mergekit's own Python entry point: the GraftError itself, and no OUT."""
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    from graftmerge.adapter import import_hook

    import_hook.install()
    config = read_merge_config_text(config_for(m, "NaN in donor_ft, diagonal global"), tmp_path)
    with pytest.raises(GraftError, match=rf"donor_ft {m['ft NaN']}: tensor '{UP}' contains NaN or Inf"):
        run_merge(config, str(tmp_path / "out"), options=MergeOptions(quiet=True))
    assert not (tmp_path / "out").exists()


def read_merge_config_text(text: str, folder: Path):
    (folder / "graft.yml").write_text(text)
    return read_merge_config(str(folder / "graft.yml"))[0]


# -- large but finite values still merge, bit for bit ------------------------------------------------------------------


@pytest.mark.parametrize("dtype, value", [(torch.float16, 60000.0), (torch.float32, 3e38)])
def test_large_finite_values_merge_bit_identically(tmp_path, dtype, value):
    """Values near the dtype's largest, whose sum over a tensor overflows it: nothing refused, the formula's bits."""
    donor = save_tiny_model(tmp_path / "base", seed=5, dtype=dtype)
    big = {name: torch.full_like(t, value) if name == NORM or name.endswith("up_proj.weight") else t
           for name, t in donor.items()}
    save_tiny_model(tmp_path / "post", seed=6, base=big, noise=0.0, dtype=dtype)
    save_tiny_model(tmp_path / "ft", seed=7, base=donor, noise=0.01, dtype=dtype)
    name = {torch.float16: "float16", torch.float32: "float32"}[dtype]
    config = tmp_path / "graft.yml"
    config.write_text(graft_yaml(tmp_path / "post", tmp_path / "base", [(tmp_path / "ft", 0.5)], dtype=name,
                                 out_dtype=name))
    result = run_cli("mergekit-yaml", str(config), str(tmp_path / "out"), "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    post, base, ft = (read_model(tmp_path / n) for n in ("post", "base", "ft"))
    got = read_model(tmp_path / "out")
    assert bool(torch.isinf(post[NORM].sum(dtype=dtype)))  # a sum-based fast check would have to fall back
    for tensor_name, out in got.items():
        expected = torch.sub(ft[tensor_name].float(), base[tensor_name].float()).mul_(0.5)
        expected = expected.add_(post[tensor_name].float()).to(dtype)
        assert out.dtype == dtype and torch.equal(out, expected), tensor_name


# -- delta pull: an adapter a graft would refuse is never published ----------------------------------------------------


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """A temporary, offline Hugging Face cache."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


PULL_REFUSALS = {
    "lora huge alpha": "exceeds",
    "lora float64": "= inf",
    "lora rotation": "exceeds",
}


@pytest.mark.parametrize("adapter", list(PULL_REFUSALS))
def test_delta_pull_refuses_an_adapter_a_graft_would_refuse(m, hf_cache, tmp_path, adapter):
    repo = "acme/" + adapter.replace(" ", "-")
    place_in_hf_cache(hf_cache, repo, m[adapter])
    out = tmp_path / "pulled"
    line = refused_line(run_cli("graftmerge", "delta", "pull", repo, "-o", str(out), "-q"))
    module = Q.removesuffix(".weight")
    assert line.startswith(f"error: pull refused: {repo}@") and f"module {module}: max(1, |scaling|)" in line, line
    assert PULL_REFUSALS[adapter] in line and "could overflow float32" in line, line
    assert not out.exists()


def test_delta_pull_keeps_an_ordinary_adapter(m, hf_cache, tmp_path):
    place_in_hf_cache(hf_cache, "acme/fine", m["lora fine"])
    result = run_cli("graftmerge", "delta", "pull", "acme/fine", "-o", str(tmp_path / "pulled"), "-q")
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "pulled" / "adapter_model.safetensors").read_bytes() == (
        m["lora fine"] / "adapter_model.safetensors").read_bytes()


# -- the checks themselves ------------------------------------------------------------------------------------------


def test_fits_is_exact_for_nan_inf_and_narrowing_casts():
    values = torch.randn(1000) * 100
    assert fits(values) and fits(values.to(torch.bfloat16)) and fits(torch.empty(0)) and fits(torch.arange(5))
    for bad in (math.nan, math.inf, -math.inf):
        poisoned = values.clone()
        poisoned[517] = bad
        assert not fits(poisoned) and not fits(poisoned.to(torch.float16))
    near = torch.tensor([65504.0, -65519.0, 1.0])  # both round to ±65504 in float16
    assert fits(near, torch.float16) and torch.isfinite(near.to(torch.float16)).all()
    assert not fits(torch.tensor([65520.0, 1.0]), torch.float16)  # rounds to inf
    assert fits(torch.full((4096,), 3e38))  # a sum would overflow; the check does not sum


def test_product_bound_bounds_products_and_rotations():
    generator = torch.Generator().manual_seed(0)
    for scale in (1e-3, 1.0, 250.0):
        left, right = torch.randn(48, 4, generator=generator), torch.randn(4, 40, generator=generator)
        bound = product_bound(left, right, scale)
        U = torch.linalg.qr(torch.randn(48, 48, generator=generator, dtype=torch.float64))[0]
        V = torch.linalg.qr(torch.randn(40, 40, generator=generator, dtype=torch.float64))[0]
        delta = scale * left.double() @ right.double()
        for value in (delta, U.T @ delta @ V, (U.T @ left.double()) @ (right.double() @ V), left @ right):
            assert float(value.abs().max()) <= bound * (1 + 1e-6)
    assert product_bound(torch.tensor([[1e300]], dtype=torch.float64), torch.ones(1, 1), 1.0) == math.inf
    assert product_bound(torch.tensor([[math.nan]]), torch.ones(1, 1), 1.0) == math.inf
    assert product_bound(torch.full((2, 2), 1e38), torch.full((2, 2), 1e38), 1.0) > FLOAT32_MAX


def test_the_fixture_adapters_are_what_their_names_say(m):
    """The rotation case: Δ itself finite in float32, only its rotation overflows."""
    from graftmerge.formats.lora_adapter import open_lora_adapter

    adapter = open_lora_adapter(m["lora rotation"])
    product = adapter.product(Q.removesuffix(".weight"), transposed=False)
    assert bool(torch.isfinite(product).all()) and float(product.abs().max()) > 1e37


def test_a_diagonal_mask_never_zeroes_away_a_nonfinite_value(m, tmp_path):
    """The merge applies the mask the threshold pass kept; an Inf arriving at a masked coordinate
    (the input changed after the pass) is refused, not zeroed into a finite-looking model."""
    from graftmerge.formats.checkpoint import Checkpoint
    from graftmerge.pipeline.graft import graft_tensor, prepare
    from graftmerge.pipeline.merge_run import MergeRun

    config = tmp_path / "graft.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1)], rho=0.1, fisher=m["diag"]))
    run = MergeRun(GraftInputs.open(plan_from_merge_config(read_merge_config(str(config))[0])))
    prepare(run, progress=False, scratch=tmp_path / "scratch")
    positions = run.kept_masks.masked_positions(UP)
    assert positions is not None and positions.numel() > 0
    post, donor, ft = (Checkpoint(m[key]).read(UP) for key in ("post", "donor", "donor_ft"))
    assert fits(graft_tensor(run, UP, post, donor, [ft.clone()]))
    arrived = ft.clone()
    arrived.view(-1)[positions[0]] = math.inf  # exactly where the mask zeroes Δ
    with pytest.raises(GraftError, match=rf"tensor '{UP}': Δ from donor_ft .* was not finite, but its inputs read "
                                         "again are: did an input change during the merge"):
        graft_tensor(run, UP, post, donor, [arrived])


def test_delta_pull_refuses_a_delta_whose_values_could_overflow(m, hf_cache, tmp_path):
    from graftmerge.pipeline.delta_extract import extract_delta

    folder = extract_delta(m["donor"], m["donor_ft"], tmp_path / "delta", progress=False)
    edit_tensor(folder, UP, poke(1e37))
    place_in_hf_cache(hf_cache, "acme/huge-delta", folder)
    line = refused_line(run_cli("graftmerge", "delta", "pull", "acme/huge-delta", "-o", str(tmp_path / "pulled"),
                                "-q"))
    assert line.startswith("error: pull refused: acme/huge-delta@") and f"delta tensor '{UP}' holds |x| = 1e+37" in line
    assert not (tmp_path / "pulled").exists()
