"""`graftmerge fisher compress`: truncated KFAC sides in the cache format, merges with them
(K = full rank: bit for bit like the original; K < full: only kept-block pairs masked),
the --report-delta figures, and refusals of bad input."""

from __future__ import annotations

import json
import subprocess
from fractions import Fraction
from math import ceil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from graftmerge.cli import main
from graftmerge.errors import GraftError
from graftmerge.formats.fisher_cache import FisherCacheWriter, open_fisher_cache
from graftmerge.pipeline.fisher_compress import compress_cache, delta_report, truncate_side
from graftmerge.pipeline.graft_plan import FineTune, GraftInputs, GraftPlan
from tests.helpers.configs import graft_yaml
from tests.helpers.fisher_caches import write_diagonal_cache, write_mixed_cache
from tests.helpers.models import read_model, tree_digest
from tests.helpers.runners import run_cli

TINY = torch.finfo(torch.float32).tiny


@pytest.fixture(scope="module")
def mixed(tied_models, tmp_path_factory) -> Path:
    return write_mixed_cache(tmp_path_factory.mktemp("compress") / "mixed", tied_models["post"], seed=2)


def run(*args: str, cache_dir: Path) -> subprocess.CompletedProcess:
    """A console script (in this process) with its own threshold cache folder."""
    return run_cli(*args, env={"GRAFTMERGE_CACHE_DIR": str(cache_dir)})


def top_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(values, descending=True, stable=True).indices[:k]


def test_truncate_side_keeps_leading_vectors_and_every_eigenvalue():
    values = torch.tensor([0.1, 3.0, 0.5, 2.0, 0.0])
    vectors = torch.linalg.qr(torch.randn(5, 5, generator=torch.Generator().manual_seed(0))).Q
    kept_vectors, kept_values, kept = truncate_side(vectors, values, 2)
    assert kept.tolist() == [1, 3]
    assert torch.equal(kept_vectors, vectors[:, [1, 3]])
    assert kept_values.tolist() == pytest.approx([3.0, 2.0, 0.5, 0.1, 0.0])
    same = truncate_side(vectors, values, 5)
    assert same[0] is vectors and same[1] is values and same[2] is None
    assert truncate_side(None, values, 2)[2] is None


def test_truncated_cache_reads_back_leading_block(tmp_path, tied_models, mixed):
    full = open_fisher_cache(mixed)
    result = compress_cache(mixed, tmp_path / "r8", rank=8, progress=False)
    compact = open_fisher_cache(result.path)
    manifest = json.loads((result.path / "fisher_manifest.json").read_text())
    assert manifest["estimator"]["compressed"]["rank"] == 8
    assert compact.names("diagonal") == full.names("diagonal") and compact.names("kfac") == full.names("kfac")
    for name in full.names("kfac"):
        f, c = full.kfac(name), compact.kfac(name)
        for vectors, values, small_vectors, small_values, side in (
            (f.U, f.S, c.U, c.S, "rows"),
            (f.V, f.D, c.V, c.D, "columns"),
        ):
            record = compact.kfac_side(name, side)
            if vectors is None:  # the embedding's vocabulary side stays diagonal
                assert small_vectors is None and torch.equal(small_values, values)
                continue
            keep = top_indices(values, 8)
            assert record["rank"] == 8 and record["size"] == vectors.shape[0]
            assert torch.equal(small_vectors, vectors[:, keep]) and torch.equal(small_values, values[keep])
            _, stored = compact.side_spectrum(compact.entries[name]["kfac"][side])
            assert stored.shape == values.shape
            assert torch.allclose(stored.sort().values, values.sort().values)
    m = tied_models
    plan = GraftPlan(post=str(m["post"]), donor=str(m["donor"]), fine_tunes=(FineTune(str(m["donor_ft"]), 1.0),),
                     rho=0.1, fisher=str(result.path))
    inputs = GraftInputs.open(plan)
    name = "model.layers.0.mlp.down_proj.weight"
    assert inputs.direction_count(name) == 8 * 8
    assert inputs.direction_count("model.embed_tokens.weight") == full.kfac("model.embed_tokens.weight").S.numel() * 8
    # shared factors stay shared (q/k/v read the same input side)
    assert compact.entries["model.layers.0.self_attn.q_proj.weight"]["kfac"]["columns"] == \
        compact.entries["model.layers.0.self_attn.k_proj.weight"]["kfac"]["columns"]


def test_writer_refuses_bad_truncated_shapes(tmp_path, tied_models):
    name = "model.layers.0.mlp.down_proj.weight"
    rows, columns = 64, 96
    with (
        pytest.raises(GraftError, match="need"),
        FisherCacheWriter(tmp_path / "bad", model=tied_models["post"]) as writer,
    ):
        writer.add_kfac_eigen(name, U=torch.eye(rows)[:, :4].T, S=torch.ones(rows), V=None, D=torch.ones(columns))
    assert not (tmp_path / "bad").exists()


def brute_force_kept_block(models, fine_tunes, cache_path: Path, rank: int, rho: float) -> dict[str, torch.Tensor]:
    """Whole model, full cache: KFAC weights score only pairs of their top-`rank` eigenvectors per side."""
    post, donor = read_model(models["post"]), read_model(models["donor"])
    fts = [(read_model(p), w) for p, w in fine_tunes]
    cache = open_fisher_cache(cache_path)
    names = sorted(post)
    delta = {n: sum(w * (ft[n].float() - donor[n].float()) for ft, w in fts) for n in names}
    bases, rotated, scores = {}, {}, {}
    for n in names:
        if cache.representation(n) == "kfac":
            f = cache.kfac(n)
            U = None if f.U is None else f.U[:, top_indices(f.S, rank)]
            S = f.S if f.U is None else f.S[top_indices(f.S, rank)]
            V, D = f.V[:, top_indices(f.D, rank)], f.D[top_indices(f.D, rank)]
            bases[n] = (U, V)
            rotated[n] = (delta[n] if U is None else U.T @ delta[n]) @ V
            scores[n] = rotated[n].square() * S[:, None] * D[None, :]
        else:
            scores[n] = cache.diagonal(n) * delta[n].square()
    flat = torch.cat([scores[n].reshape(-1) for n in names])
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    chosen[torch.sort(flat, descending=True, stable=True).indices[: ceil(Fraction(repr(rho)) * flat.numel())]] = True
    masks = dict(zip(names, torch.split(chosen & (flat >= TINY), [scores[n].numel() for n in names])))
    out = {}
    for n in names:
        mask = masks[n].reshape(scores[n].shape)
        if n in bases:
            U, V = bases[n]
            part = torch.where(mask, rotated[n], 0.0) @ V.T
            out[n] = post[n].float() + delta[n] - (part if U is None else U @ part)
        else:
            out[n] = post[n].float() + delta[n].masked_fill(mask, 0)
    return out


def test_full_rank_merges_bit_identical_and_truncated_masks_only_the_kept_block(tmp_path, tied_models, mixed):
    m = tied_models
    fine_tunes = [(m["donor_ft"], 0.5)]
    largest = 96  # intermediate size: the largest eigenbasis of the tiny model
    outputs = {}
    for label, rank in (("full", None), ("same", largest), ("r6", 6)):
        cache = mixed
        if rank is not None:
            result = run("graftmerge", "fisher", "compress", str(mixed), "--rank", str(rank), "-o",
                         str(tmp_path / f"cache-{label}"), "--no-progress", cache_dir=tmp_path / "tc")
            assert result.returncode == 0, result.stderr[-3000:]
            cache = tmp_path / f"cache-{label}"
        config = tmp_path / f"{label}.yml"
        config.write_text(graft_yaml(m["post"], m["donor"], fine_tunes, rho=0.02, fisher=cache))
        merged = run("mergekit-yaml", str(config), str(tmp_path / f"out-{label}"), cache_dir=tmp_path / f"tc-{label}")
        assert merged.returncode == 0, merged.stderr[-3000:]
        outputs[label] = read_model(tmp_path / f"out-{label}")
    manifest = json.loads((tmp_path / "cache-same" / "fisher_manifest.json").read_text())
    assert not any("rank" in record for record in manifest["factors"].values())
    for name in outputs["full"]:
        assert torch.equal(outputs["same"][name], outputs["full"][name]), name
    expected = brute_force_kept_block(m, fine_tunes, mixed, 6, 0.02)
    post = read_model(m["post"])
    for name, tensor in expected.items():
        assert torch.allclose(outputs["r6"][name], tensor, atol=1e-6, rtol=0), name
    differs = [n for n in expected if not torch.allclose(outputs["r6"][n], outputs["full"][n], atol=1e-6)]
    assert differs and all(not torch.equal(outputs["r6"][n], post[n]) for n in expected)


def test_delta_report_kept_share_and_overlap(tmp_path, tied_models, mixed):
    m = tied_models
    plan = GraftPlan(post=str(m["post"]), donor=str(m["donor"]), fine_tunes=(FineTune(str(m["donor_ft"]), 1.0),),
                     rho=0.05, fisher=str(mixed))
    same = delta_report(compress_cache(mixed, tmp_path / "same", rank=96, progress=False), mixed, plan, progress=False)
    assert all(r.kept_share == 1.0 for r in same if r.kind == "kfac")
    assert sum(r.both_masked for r in same) == sum(r.full_masked for r in same) > 0
    small = compress_cache(mixed, tmp_path / "r4", rank=4, progress=False)
    reports = {r.name: r for r in delta_report(small, mixed, plan, progress=False)}
    name = "model.layers.1.mlp.up_proj.weight"
    f = open_fisher_cache(mixed).kfac(name)
    delta = read_model(m["donor_ft"])[name] - read_model(m["donor"])[name]
    scores = (f.U.T @ delta @ f.V).square() * f.S[:, None] * f.D[None, :]
    block = scores[top_indices(f.S, 4)][:, top_indices(f.D, 4)]
    assert reports[name].kept_share == pytest.approx(float(block.double().sum() / scores.double().sum()), rel=1e-5)
    assert all(r.both_masked <= r.full_masked for r in reports.values())
    diagonal = [r for r in reports.values() if r.kind == "diagonal"]
    assert diagonal and all(r.kept_share is None for r in diagonal)


def test_compress_cli_reports(tmp_path, tied_models, mixed):
    m = tied_models
    config = tmp_path / "g.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)], rho=0.05, fisher=mixed))
    result = CliRunner().invoke(main, ["fisher", "compress", str(mixed), "-k", "96", "-o", str(tmp_path / "c"),
                                       "--report-delta", str(config), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "model.layers.0.mlp.down_proj.weight" in result.output
    assert "|M_compact ∩ M_full| / |M_full| = 100.00%" in result.output


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["{mixed}", "--rank", "0", "-o", "{out}"], "between 1 and 96"),
        (["{mixed}", "--rank", "97", "-o", "{out}"], "between 1 and 96"),
        (["{diag}", "--rank", "4", "-o", "{out}"], "no KFAC entries"),
        (["{mixed}", "--rank", "4", "-o", "{existing}"], "already exists"),
        (["{missing}", "--rank", "4", "-o", "{out}"], "does not exist"),
        (["{mixed}", "--rank", "4", "-o", "{out}", "--report-delta", "{linear}"], "graft config"),
    ],
)
def test_compress_bad_inputs(tmp_path, tied_models, mixed, args, fragment):
    m = tied_models
    diag = write_diagonal_cache(tmp_path / "diag", m["post"])
    (tmp_path / "existing").mkdir()
    (tmp_path / "linear.yml").write_text(
        f"merge_method: linear\nmodels:\n  - model: {m['post']}\n    parameters: {{weight: 1.0}}\ndtype: float32\n")
    paths = {"mixed": mixed, "diag": diag, "out": tmp_path / "out", "existing": tmp_path / "existing",
             "missing": tmp_path / "nope", "linear": tmp_path / "linear.yml"}
    before = tree_digest(mixed), tree_digest(diag)
    result = CliRunner().invoke(main, ["fisher", "compress", *[a.format(**paths) for a in args]])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.output
    assert not (tmp_path / "out").exists() and not list((tmp_path / "existing").iterdir())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    assert (tree_digest(mixed), tree_digest(diag)) == before
