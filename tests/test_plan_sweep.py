"""`graftmerge plan` against a whole-model brute force, `graftmerge sweep` against separate
mergekit-yaml runs (bit for bit), and both commands' refusals of bad input."""

from __future__ import annotations

import json
import subprocess
from fractions import Fraction
from math import ceil
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from mergekit.io.tensor_writer import TensorWriter
from mergekit.options import MergeOptions

from graftmerge import GridPoint, open_grid
from graftmerge.cli import main
from graftmerge.formats.fisher_cache import open_fisher_cache
from graftmerge.math import mask_stats
from graftmerge.pipeline import graft_plan
from graftmerge.pipeline.graft_plan import FineTune, GraftInputs, GraftPlan
from graftmerge.pipeline.mask_preview import plan_report
from graftmerge.pipeline.sweep import SpillingWriter
from tests.helpers.configs import graft_yaml
from tests.helpers.fisher_caches import write_diagonal_cache, write_mixed_cache
from tests.helpers.models import read_model, tree_digest
from tests.helpers.runners import one_line_error, run_cli

TINY = torch.finfo(torch.float32).tiny


@pytest.fixture(scope="module")
def caches(tied_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plan-sweep-fisher")
    return {
        "mixed": write_mixed_cache(root / "mixed", tied_models["post"], seed=4),
        # a few exact ties and zeros: integer-valued Fisher on a coarse grid
        "diag": write_diagonal_cache(root / "diag", tied_models["post"], seed=5,
                                     transform=lambda name, v: (v * 4).floor()),
    }


def brute_scores(models, fine_tunes, cache_path, lam) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Every ranked direction's score, the whole model at once (docs/math.md#the-masks), float32."""
    donor = read_model(models["donor"])
    fts = [(read_model(path), weight) for path, weight in fine_tunes]
    cache = open_fisher_cache(cache_path)
    names = sorted(n for n in donor if cache.representation(n))
    scores = {}
    for n in names:
        delta = sum(lam * w * (ft[n].float() - donor[n].float()) for ft, w in fts)
        if cache.representation(n) == "kfac":
            f = cache.kfac(n)
            rotated = (delta if f.U is None else f.U.T @ delta) @ f.V
            scores[n] = rotated.square() * f.S[:, None] * f.D[None, :]
        else:
            scores[n] = cache.diagonal(n) * delta.square()
    return names, scores


@pytest.mark.parametrize("cache_kind", ["diag", "mixed"])
def test_plan_equals_brute_force_for_every_rho(tied_models, caches, cache_kind):
    m = tied_models
    fine_tunes = [(m["donor_ft"], 1.0)]
    rhos = [0.0, 0.0005, 0.01, 0.2, 0.9]
    plan = GraftPlan(post=str(m["post"]), donor=str(m["donor"]), fine_tunes=(FineTune(str(m["donor_ft"]), 1.0),),
                     lam=1.0, rho=0.5, fisher=str(caches[cache_kind]), dtype="float32")
    report = plan_report(GraftInputs.open(plan), rhos, progress=False)
    names, scores = brute_scores(m, fine_tunes, caches[cache_kind], 1.0)
    flat = torch.cat([scores[n].reshape(-1) for n in names])
    sizes = [scores[n].numel() for n in names]
    total_mass = float(flat.double().sum())
    assert report.directions == flat.numel() and [t.name for t in report.tensors] == names
    assert report.mass == pytest.approx(total_mass, rel=1e-9)
    order = torch.sort(flat, descending=True, stable=True)
    for summary in report.rhos:
        k = ceil(Fraction(repr(summary.rho)) * flat.numel())
        chosen = torch.zeros_like(flat, dtype=torch.bool)
        chosen[order.indices[:k]] = True
        chosen &= flat >= TINY
        assert summary.k == k and summary.masked == int(chosen.sum()), summary.rho
        if k:
            assert summary.threshold == float(order.values[k - 1]), summary.rho
        assert summary.removed_share == pytest.approx(
            float(flat[chosen].double().sum()) / total_mass, rel=1e-9, abs=1e-15
        )
        for tensor, part, mask in zip(report.tensors, torch.split(flat, sizes), torch.split(chosen, sizes)):
            tally = tensor.tallies[summary.rho]
            assert tally.masked == int(mask.sum()), (summary.rho, tensor.name)
            assert tally.masked_score == pytest.approx(float(part[mask].double().sum()), rel=1e-9, abs=1e-15)
    assert 0 < report.rhos[2].removed_share < report.rhos[3].removed_share <= report.rhos[4].removed_share <= 1


def test_plan_tensor_scope_is_per_tensor_top_k(tied_models, caches):
    m = tied_models
    plan = GraftPlan(post=str(m["post"]), donor=str(m["donor"]), fine_tunes=(FineTune(str(m["donor_ft"]), 1.0),),
                     rho=0.5, fisher=str(caches["diag"]), rho_scope="tensor")
    report = plan_report(GraftInputs.open(plan), [0.05, 0.3], progress=False)
    names, scores = brute_scores(m, [(m["donor_ft"], 1.0)], caches["diag"], 1.0)
    for tensor in report.tensors:
        flat = scores[tensor.name].reshape(-1)
        for rho, tally in tensor.tallies.items():
            k = ceil(Fraction(repr(rho)) * flat.numel())
            expected = int((torch.sort(flat, descending=True, stable=True).values[:k] >= TINY).sum())
            assert tally.masked == expected, (tensor.name, rho)
    assert all(s.threshold is None for s in report.rhos)


def test_plan_cli_prints_every_rho_and_writes_json(tmp_path, tied_models, caches):
    m = tied_models
    config = tmp_path / "g.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 0.5)], rho=0.01, fisher=caches["mixed"]))
    result = CliRunner().invoke(main, ["plan", str(config), "--rho", "0.001,0.01,0.1", "--no-progress",
                                       "--json", str(tmp_path / "p.json")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("rho ")] == ["0.001", "0.01", "0.1"]
    assert any(line.startswith("model.layers.0.mlp.down_proj.weight") and " kfac " in line for line in lines)
    data = json.loads((tmp_path / "p.json").read_text())
    assert [r["rho"] for r in data["rhos"]] == [0.001, 0.01, 0.1]
    assert data["rhos"][0]["masked"] == ceil(0.001 * data["directions"])


def run_graftmerge(*args: str, cache_dir: Path) -> subprocess.CompletedProcess:
    """A console script (in this process) with its own threshold cache folder."""
    return run_cli(*args, env={"GRAFTMERGE_CACHE_DIR": str(cache_dir)})


def assert_bitwise_equal(got: Path, expected: Path) -> None:
    a, b = read_model(got), read_model(expected)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert a[name].contiguous().view(torch.uint8).equal(b[name].contiguous().view(torch.uint8)), name
    assert (got / "config.json").read_text() == (expected / "config.json").read_text()
    for file in ("tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"):
        assert (got / file).exists() == (expected / file).exists(), file


@pytest.mark.parametrize(
    "cache_kind, scope, fine_tune_keys, lambdas, rhos",
    [
        ("mixed", "global", ("donor_ft",), [0.3, 1.0], [0.0, 0.01]),
        ("diag", "tensor", ("donor_ft", "donor_ft2"), [0.7], [0.0, 0.05]),
    ],
    ids=["kfac-mixed-global", "diagonal-tensor-scope-two-deltas"],
)
def test_sweep_outputs_equal_separate_mergekit_yaml_runs(tmp_path, tied_models, caches, cache_kind, scope,
                                                         fine_tune_keys, lambdas, rhos):
    m = tied_models
    fine_tunes = [(m[key], 0.5 + index) for index, key in enumerate(fine_tune_keys)]
    config = tmp_path / "g.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], fine_tunes, rho=0.3, fisher=caches[cache_kind], scope=scope,
                                 out_dtype="bfloat16"))
    before = tree_digest(m["post"].parent)
    sweep = run_graftmerge("graftmerge", "sweep", str(config), "--lambda", ",".join(map(str, lambdas)),
                           "--rho", ",".join(map(str, rhos)), "-o", str(tmp_path / "sweep"),
                           "--out-shard-size", "20K", cache_dir=tmp_path / "cache-sweep")
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == sorted(
        f"lambda-{lam!r}_rho-{rho!r}" for lam in lambdas for rho in rhos)
    assert not list(tmp_path.glob(".sweep.*"))  # no staging folder or lock file left
    for lam in lambdas:
        for rho in rhos:
            folder = tmp_path / "sweep" / f"lambda-{lam!r}_rho-{rho!r}"
            single = tmp_path / f"single-{lam}-{rho}.yml"
            single.write_text(graft_yaml(m["post"], m["donor"], fine_tunes, rho=rho, lam=lam, fisher=caches[cache_kind],
                                         scope=scope, out_dtype="bfloat16"))
            reference = run_graftmerge("mergekit-yaml", str(single), str(tmp_path / f"ref-{lam}-{rho}"),
                                       "--out-shard-size", "20K", cache_dir=tmp_path / f"cache-{lam}-{rho}")
            assert reference.returncode == 0, reference.stderr[-3000:]
            assert_bitwise_equal(folder, tmp_path / f"ref-{lam}-{rho}")
            written = yaml.safe_load((folder / "mergekit_config.yml").read_text())["parameters"]
            assert (written["lambda"], written["rho"]) == (lam, rho)
    # the public grid yields each point's tensors as mergekit-yaml writes them, from one opening of the inputs
    with open_grid(str(config), lambdas, rhos, options=MergeOptions(out_shard_size=20_000)) as opened:
        assert opened.points == [GridPoint(lam, rho) for lam in lambdas for rho in rhos]
        for point in opened.points:
            got, expected = dict(opened.tensors(point)), read_model(tmp_path / f"ref-{point.lam}-{point.rho}")
            assert got.keys() == expected.keys()
            for name, tensor in got.items():
                assert tensor.dtype == expected[name].dtype and torch.equal(tensor.view(torch.uint8),
                                                                            expected[name].view(torch.uint8)), name
    # the grid really differs across λ and ρ (else equality would prove little)
    outputs = {
        (lam, rho): read_model(tmp_path / "sweep" / f"lambda-{lam!r}_rho-{rho!r}") for lam in lambdas for rho in rhos
    }
    name = "model.layers.0.mlp.down_proj.weight"
    assert len({outputs[key][name].float().sum().item() for key in outputs}) == len(outputs)
    assert tree_digest(m["post"].parent) == before


def test_sweep_with_role_delta_inputs_equals_mergekit_yaml(tmp_path, tied_models, caches):
    """A precomputed delta (`graftmerge delta extract`) next to a donor/donor_ft pair."""
    m = tied_models
    extracted = CliRunner().invoke(main, ["delta", "extract", str(m["donor"]), str(m["donor_ft2"]), "-o",
                                          str(tmp_path / "delta-ft2"), "-q"])
    assert extracted.exit_code == 0, extracted.output

    def config(lam: float, rho: float) -> str:
        return (f"merge_method: graft\nbase_model: {m['post']}\nmodels:\n"
                f"  - model: {m['donor']}\n    parameters: {{role: donor}}\n"
                f"  - model: {m['donor_ft']}\n    parameters: {{role: donor_ft, weight: 0.6}}\n"
                f"  - model: {tmp_path / 'delta-ft2'}\n    parameters: {{role: delta, weight: -0.4}}\n"
                f"parameters:\n  lambda: {lam}\n  rho: {rho}\n  fisher: {caches['mixed']}\n"
                "dtype: float32\nout_dtype: float32\n")

    (tmp_path / "g.yml").write_text(config(1.0, 0.5))
    sweep = run_graftmerge("graftmerge", "sweep", str(tmp_path / "g.yml"), "--lambda", "0.5,1", "--rho", "0.02",
                           "-o", str(tmp_path / "sweep"), cache_dir=tmp_path / "cache-sweep")
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    for lam in (0.5, 1.0):
        (tmp_path / f"{lam}.yml").write_text(config(lam, 0.02))
        reference = run_graftmerge("mergekit-yaml", str(tmp_path / f"{lam}.yml"), str(tmp_path / f"ref-{lam}"),
                                   cache_dir=tmp_path / f"cache-{lam}")
        assert reference.returncode == 0, reference.stderr[-3000:]
        assert_bitwise_equal(tmp_path / "sweep" / f"lambda-{lam!r}_rho-0.02", tmp_path / f"ref-{lam}")


def folder_bytes(folder: Path, skip=("README.md", "mergekit_config.yml")) -> dict[str, bytes]:
    """Every file of a model folder, by name, except those that name the folder or the config's text."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name not in skip}


def test_sweep_bounded_memory_paths_write_mergekit_yaml_folders_file_for_file(tmp_path, tied_models, caches,
                                                                                monkeypatch):
    """Row blocks (each grid point reads its Fisher block by block, as a merge does), threshold spills
    that overflow and are re-scored, and shards spilled to disk until written: every shard file, the
    shard index and config.json byte for byte those of mergekit-yaml with the same --out-shard-size."""
    m = tied_models
    monkeypatch.setattr(graft_plan, "BLOCK_ELEMENTS", 1000)  # in-process: reaches the sweep and the merges
    monkeypatch.setattr(mask_stats, "_TOTAL_SPILL", 64)  # the sweep's searches keep almost nothing
    fine_tunes = [(m["donor_ft"], 0.8)]
    lambdas, rho = [0.5, 1.0], 0.05
    config = tmp_path / "g.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], fine_tunes, rho=0.3, fisher=caches["mixed"],
                                 out_dtype="bfloat16"))
    sweep = run_graftmerge("graftmerge", "sweep", str(config), "--lambda", ",".join(map(str, lambdas)), "--rho",
                           str(rho), "-o", str(tmp_path / "sweep"), "--out-shard-size", "8K",
                           cache_dir=tmp_path / "cache-sweep")
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    for lam in lambdas:
        single = tmp_path / f"single-{lam}.yml"
        single.write_text(graft_yaml(m["post"], m["donor"], fine_tunes, rho=rho, lam=lam, fisher=caches["mixed"],
                                     out_dtype="bfloat16"))
        reference = run_graftmerge("mergekit-yaml", str(single), str(tmp_path / f"ref-{lam}"), "--out-shard-size", "8K",
                                   cache_dir=tmp_path / f"cache-{lam}")
        assert reference.returncode == 0, reference.stderr[-3000:]
        got, expected = (
            folder_bytes(tmp_path / "sweep" / f"lambda-{lam!r}_rho-{rho!r}"),
            folder_bytes(tmp_path / f"ref-{lam}"),
        )
        assert sum(name.endswith(".safetensors") for name in expected) > 3  # really several shards
        assert got.keys() == expected.keys()
        for name in expected:
            assert got[name] == expected[name], (lam, name)


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pickle"])
def test_spilling_writer_writes_byte_for_byte_what_mergekit_writer_writes(tmp_path, safe):
    """Same shard files, names, index and bytes as mergekit's TensorWriter at every shard size, while the
    shard being filled holds no tensor data (meta tensors); no spill file left once finalized."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w.bf16": torch.randn(100, 30, generator=g).bfloat16(),
        "b.f32": torch.randn(7, generator=g),
        "scalar": torch.tensor(3.0),
        "ids.i64": torch.arange(50),
        "empty": torch.zeros(0, 4),
        "flags": torch.rand(20, generator=g) > 0.5,
        "h.f16": torch.randn(64, 64, generator=g).half(),
        "t.bf16": torch.randn(30, 100, generator=g).bfloat16().T,  # not contiguous
    }
    spill = tmp_path / "spill"
    spill.mkdir()
    shard_counts = []
    for size in (0, 1, 1000, 8000, 10**9):
        options = MergeOptions(out_shard_size=size, safe_serialization=safe)
        reference = TensorWriter(str(tmp_path / f"ref-{size}"), max_shard_size=size, safe_serialization=safe)
        writer = SpillingWriter(tmp_path / f"got-{size}", spill, options)
        for name, tensor in tensors.items():
            reference.save_tensor(name, tensor)
            writer.save_tensor(name, tensor)
            assert writer.current_shard and all(t.is_meta for t in writer.current_shard.values())
        reference.finalize()
        writer.finalize()
        expected = folder_bytes(tmp_path / f"ref-{size}")
        assert folder_bytes(tmp_path / f"got-{size}") == expected, size
        assert not list(spill.iterdir())
        shard_counts.append(len(expected))
    assert shard_counts[0] == 1 and shard_counts[1] == len(tensors) + 1 and 2 < shard_counts[2] < shard_counts[1]


@pytest.mark.parametrize(
    "command, fragment",
    [
        (["plan", "{config}", "--rho", ""], "comma-separated"),
        (["plan", "{config}", "--rho", "0.1,,0.2"], "comma-separated"),
        (["plan", "{config}", "--rho", "0.1,abc"], "not a number"),
        (["plan", "{config}", "--rho", "1"], "[0, 1)"),
        (["plan", "{config}", "--rho", "-0.1"], "[0, 1)"),
        (["plan", "{config}", "--rho", "0.1,0.1"], "twice"),
        (["plan", "{linear}", "--rho", "0.1"], "graft config"),
        (["plan", "{nofisher}", "--rho", "0.1"], "fisher"),
        (["sweep", "{config}", "--lambda", "", "--rho", "0", "-o", "{out}"], "comma-separated"),
        (["sweep", "{config}", "--lambda", "1,nan", "--rho", "0", "-o", "{out}"], "finite"),
        (["sweep", "{config}", "--lambda", "1", "--rho", "0.5,1.5", "-o", "{out}"], "[0, 1)"),
        (["sweep", "{linear}", "--lambda", "1", "--rho", "0", "-o", "{out}"], "graft config"),
        (["sweep", "{nofisher}", "--lambda", "1", "--rho", "0,0.1", "-o", "{out}"], "fisher"),
        (["sweep", "{config}", "--lambda", "1", "--rho", "0", "-o", "{existing}"], "already exists"),
    ],
)
def test_bad_inputs_one_line_exit_2_nothing_written(tmp_path, tied_models, caches, command, fragment):
    m = tied_models
    (tmp_path / "g.yml").write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)], rho=0.01,
                                               fisher=caches["diag"]))
    (tmp_path / "nofisher.yml").write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)]))
    (tmp_path / "linear.yml").write_text(
        f"merge_method: linear\nmodels:\n  - model: {m['post']}\n    parameters: {{weight: 1.0}}\n"
        f"  - model: {m['donor']}\n    parameters: {{weight: 1.0}}\ndtype: float32\n")
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "keep.txt").write_text("mine")
    paths = {"config": tmp_path / "g.yml", "linear": tmp_path / "linear.yml", "nofisher": tmp_path / "nofisher.yml",
             "out": tmp_path / "out", "existing": tmp_path / "existing"}
    before = tree_digest(m["post"].parent), tree_digest(caches["diag"])
    args = [part.format(**paths) for part in command]
    line = one_line_error(CliRunner().invoke(main, args))
    assert fragment in line
    assert not (tmp_path / "out").exists()
    assert [p.name for p in (tmp_path / "existing").iterdir()] == ["keep.txt"]
    assert not list(tmp_path.glob(".out.*")) and not list(tmp_path.glob(".existing.*"))
    assert (tree_digest(m["post"].parent), tree_digest(caches["diag"])) == before
