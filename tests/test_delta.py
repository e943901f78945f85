"""The offline delta tool: extract, `role: delta` grafts, stats, and its bad inputs.

The central promise: a delta extracted in float32 with weight 1 grafts bit for
bit like the donor + donor_ft it came from, through the stock mergekit-yaml,
with and without masks.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from graftmerge.adapter import import_hook
from graftmerge.cli import main
from graftmerge.demo.tiny_models import make_graft_inputs
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.delta_folder import MANIFEST_NAME, sampled_digest
from graftmerge.formats.fisher_cache import open_fisher_cache
from tests.helpers.fisher_caches import write_diagonal_cache, write_mixed_cache
from tests.helpers.models import assert_identical, copy_model, read_model, tree_digest
from tests.helpers.runners import mergekit_yaml_model, run_cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def invoke(*args: str):
    """``graftmerge ARGS`` in this process."""
    import_hook.install()
    return CliRunner().invoke(main, [str(a) for a in args])


def extract(donor: Path, ft: Path, out: Path, *extra: str) -> Path:
    result = invoke("delta", "extract", donor, ft, "-o", out, "-q", *extra)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def deltas(tied_models, tmp_path_factory) -> dict[str, Path]:
    """base→base-ft and base→base-ft2, float32, weight 1, in several small shards."""
    root = tmp_path_factory.mktemp("deltas")
    m = tied_models
    return {
        "ft": extract(m["donor"], m["donor_ft"], root / "delta-ft", "--shard-size", "20KB"),
        "ft2": extract(m["donor"], m["donor_ft2"], root / "delta-ft2"),
    }


@pytest.fixture(scope="module")
def mixed_cache(tied_models, tmp_path_factory) -> Path:
    return write_mixed_cache(tmp_path_factory.mktemp("fisher-mixed") / "post-kfac", tied_models["post"])


# -- extract ----------------------------------------------------------------------------


def test_extract_streams_shards_and_records_both_sources(tmp_path, tied_models, monkeypatch):
    import graftmerge.pipeline.delta_extract as extract_module

    m = tied_models
    watched = [m["donor"], m["donor_ft"]]
    before = [tree_digest(p) for p in watched]
    saved: list[dict[str, int]] = []
    original = extract_module.save_file

    def recording_save(tensors, path, metadata=None):
        saved.append({name: t.numel() * t.element_size() for name, t in tensors.items()})
        return original(tensors, path, metadata=metadata)

    monkeypatch.setattr(extract_module, "save_file", recording_save)
    monkeypatch.setattr(extract_module, "DEFAULT_SHARD_BYTES", 30_000)
    out = tmp_path / "delta"
    path = extract_module.extract_delta(m["donor"], m["donor_ft"], out, progress=False)
    assert path == out

    # Streamed: several shards, each written once and holding at most the shard size
    # (or one tensor bigger than it), together every tensor exactly once.
    donor = Checkpoint(m["donor"])
    assert len(saved) > 3
    assert all(sum(shard.values()) <= 30_000 or len(shard) == 1 for shard in saved)
    assert sorted(n for shard in saved for n in shard) == sorted(donor.tensors)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(out.glob("*.safetensors"))
    assert len(files) == len(saved) and set(index["weight_map"].values()) == {f.name for f in files}
    assert index["metadata"]["total_size"] == sum(sum(shard.values()) for shard in saved)

    # Δ = ft − donor in float32, bit for bit.
    donor_w, ft_w, delta_w = read_model(m["donor"]), read_model(m["donor_ft"]), read_model(out)
    assert delta_w.keys() == donor_w.keys()
    for name, tensor in delta_w.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, ft_w[name].float() - donor_w[name].float()), name

    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["format"] == "graftmerge.delta" and manifest["format_version"] == 1
    assert manifest["weight"] == 1.0 and manifest["dtype"] == "float32"
    assert manifest["graftmerge_version"]
    for role, folder in (("donor", m["donor"]), ("donor_ft", m["donor_ft"])):
        record = manifest[role]
        assert record["path"] == str(Path(folder).resolve())
        assert record["tensors"] == Checkpoint(folder).fingerprint()
        assert record["sampled_sha256"] == sampled_digest(Checkpoint(folder))
    assert manifest["donor"]["sampled_sha256"] != manifest["donor_ft"]["sampled_sha256"]
    assert (out / "config.json").read_text() == (m["donor"] / "config.json").read_text()
    assert [tree_digest(p) for p in watched] == before
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_extract_weight_and_bfloat16(tmp_path, tied_models):
    m = tied_models
    out = extract(m["donor"], m["donor_ft"], tmp_path / "half", "--weight", "0.5", "--dtype", "bfloat16")
    donor_w, ft_w = read_model(m["donor"]), read_model(m["donor_ft"])
    for name, tensor in read_model(out).items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, ((ft_w[name] - donor_w[name]) * 0.5).to(torch.bfloat16)), name
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["weight"] == 0.5 and manifest["dtype"] == "bfloat16"


def test_sampled_digest_ignores_sharding_but_sees_content(tmp_path, tied_models):
    m = tied_models
    weights = read_model(m["donor"])
    resharded = tmp_path / "one-file"
    resharded.mkdir()
    save_file(weights, str(resharded / "model.safetensors"))
    assert sampled_digest(Checkpoint(resharded)) == sampled_digest(Checkpoint(m["donor"]))
    name = "model.layers.1.mlp.up_proj.weight"
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] += 1.0  # the first sampled window of one tensor
    changed = tmp_path / "changed"
    changed.mkdir()
    save_file(weights, str(changed / "model.safetensors"))
    assert sampled_digest(Checkpoint(changed)) != sampled_digest(Checkpoint(m["donor"]))


# -- role: delta through the stock mergekit-yaml -----------------------------------------


def config_yaml(post, entries, *, lam=1.5, rho=0.0, fisher=None, scope="global") -> str:
    models = "".join(
        f"  - model: {path}\n    parameters: {{role: {role}" + (f", weight: {w}" if w is not None else "") + "}\n"
        for path, role, w in entries
    )
    params = f"  lambda: {lam}\n  rho: {rho}\n  rho_scope: {scope}\n" + (f"  fisher: {fisher}\n" if fisher else "")
    return (
        f"merge_method: graft\nbase_model: {post}\nmodels:\n{models}parameters:\n{params}"
        "dtype: float32\nout_dtype: float32\n"
    )



MASKS = {
    "rho 0": {},
    "diagonal global": {"rho": 0.02, "fisher": "diag", "scope": "global"},
    "diagonal tensor": {"rho": 0.05, "fisher": "diag", "scope": "tensor"},
    "kfac/mixed global": {"rho": 0.02, "fisher": "mixed", "scope": "global"},
    "kfac/mixed tensor": {"rho": 0.05, "fisher": "mixed", "scope": "tensor"},
}


@pytest.mark.parametrize("case", list(MASKS))
def test_delta_graft_is_bit_identical_to_donor_graft(tmp_path, tied_models, deltas, tied_diag_cache, mixed_cache, case):
    """Two deltas alone (no donor, no donor_ft) = donor + two donor_ft, for every mask kind."""
    m = tied_models
    options = dict(MASKS[case])
    if "fisher" in options:
        options["fisher"] = {"diag": tied_diag_cache, "mixed": mixed_cache}[options["fisher"]]
    reference = mergekit_yaml_model(tmp_path, config_yaml(m["post"], [
        (m["donor"], "donor", None), (m["donor_ft"], "donor_ft", 0.7), (m["donor_ft2"], "donor_ft", -0.3),
    ], **options), "reference")
    grafted = mergekit_yaml_model(tmp_path, config_yaml(m["post"], [
        (deltas["ft"], "delta", 0.7), (deltas["ft2"], "delta", -0.3),
    ], **options), "deltas")
    assert_identical(grafted, reference)
    post = read_model(m["post"])
    assert any(not torch.equal(grafted[n], post[n]) for n in post)  # something was grafted


@pytest.mark.parametrize("case", ["rho 0", "kfac/mixed global"])
def test_delta_mixed_with_donor_ft_and_donor_is_bit_identical(tmp_path, tied_models, deltas, mixed_cache, case):
    """donor + donor_ft + delta, and donor + deltas (fingerprint checked), equal the all-donor_ft graft."""
    m = tied_models
    options = {k: (mixed_cache if k == "fisher" else v) for k, v in MASKS[case].items()}
    reference = mergekit_yaml_model(tmp_path, config_yaml(m["post"], [
        (m["donor"], "donor", None), (m["donor_ft"], "donor_ft", 0.7), (m["donor_ft2"], "donor_ft", -0.3),
    ], **options), "reference")
    mixed = mergekit_yaml_model(tmp_path, config_yaml(m["post"], [
        (m["donor"], "donor", None), (m["donor_ft"], "donor_ft", 0.7), (deltas["ft2"], "delta", -0.3),
    ], **options), "mixed")
    assert_identical(mixed, reference)
    with_donor = mergekit_yaml_model(tmp_path, config_yaml(m["post"], [
        (m["donor"], "donor", None), (deltas["ft"], "delta", 0.7), (deltas["ft2"], "delta", -0.3),
    ], **options), "with-donor")
    assert_identical(with_donor, reference)


def test_single_delta_graft_is_theta_post_plus_lambda_delta(tmp_path, tied_models, deltas):
    m = tied_models
    out = mergekit_yaml_model(tmp_path, config_yaml(m["post"], [(deltas["ft"], "delta", None)], lam=0.5), "one")
    post, delta = read_model(m["post"]), read_model(deltas["ft"])
    for name, tensor in out.items():
        assert torch.equal(tensor, post[name] + delta[name] * 0.5), name


def test_threshold_cache_key_follows_the_delta_files(tmp_path, tied_models, deltas, tied_diag_cache):
    from graftmerge.pipeline.graft_plan import FineTune, GraftInputs, GraftPlan
    from graftmerge.pipeline.threshold_pass import threshold_key

    copied = copy_model(deltas["ft"], tmp_path / "delta-copy")
    plan = GraftPlan(post=str(tied_models["post"]), donor=None, fine_tunes=(), deltas=(FineTune(str(copied), 1.0),),
                     rho=0.01, fisher=str(tied_diag_cache))
    first = threshold_key(GraftInputs.open(plan), "cpu")
    assert threshold_key(GraftInputs.open(plan), "cpu") == first
    shard = sorted(copied.glob("*.safetensors"))[0]
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert threshold_key(GraftInputs.open(plan), "cpu") != first


# -- stats ------------------------------------------------------------------------------


def brute_force_fisher(cache, name: str) -> torch.Tensor:
    """Per-coordinate Fisher, from the dense factors for KFAC-only entries: diag(Q ⊗ P) = diag(P) diag(Q)ᵀ."""
    if cache.has(name, "diagonal"):
        return cache.diagonal(name)
    f = cache.kfac(name)
    dense = lambda vectors, values: torch.diag(values.double()) if vectors is None else (  # noqa: E731
        vectors.double() @ torch.diag(values.double()) @ vectors.double().T)
    return torch.outer(torch.diagonal(dense(f.U, f.S)), torch.diagonal(dense(f.V, f.D))).float()


def top_by_fisher(flat_fisher: torch.Tensor, top: float) -> torch.Tensor:
    """The ⌈top·n⌉ largest Fisher values, ties to earlier positions: one stable sort."""
    k = math.ceil(Fraction(repr(top)) * flat_fisher.numel())
    chosen = torch.zeros_like(flat_fisher, dtype=torch.bool)
    chosen[torch.sort(flat_fisher, descending=True, stable=True).indices[:k]] = True
    return chosen


@pytest.mark.parametrize("cache_kind", ["diagonal", "mixed"])
@pytest.mark.parametrize("top", [0.01, 0.2])
def test_stats_match_brute_force(tied_models, deltas, tied_diag_cache, mixed_cache, cache_kind, top):
    from graftmerge.math.delta_stats import block_of
    from graftmerge.pipeline.delta_report import compute_stats

    fisher_path = tied_diag_cache if cache_kind == "diagonal" else mixed_cache
    stats = compute_stats(deltas["ft"], fisher_path, top=top, progress=False)
    cache = open_fisher_cache(fisher_path)
    delta = read_model(deltas["ft"])
    names = sorted(delta)
    fisher = {n: brute_force_fisher(cache, n) for n in names}
    weighted = {n: fisher[n].double() * delta[n].double().square() for n in names}
    global_top = torch.split(top_by_fisher(torch.cat([fisher[n].reshape(-1) for n in names]), top),
                             [delta[n].numel() for n in names])
    rows = {r.name: r for r in stats.tensors}
    assert sorted(rows) == names
    close = lambda a, b: math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)  # noqa: E731
    for n, in_global in zip(names, global_top):
        row, w = rows[n], weighted[n].reshape(-1)
        assert close(row.l2, float(delta[n].double().norm())), n
        assert close(row.weighted, float(w.sum())), n
        assert close(row.in_tensor_top, float(w[top_by_fisher(fisher[n].reshape(-1), top)].sum())), n
        assert close(row.in_global_top, float(w[in_global].sum())), n
        assert row.fisher == ("diagonal" if cache.has(n, "diagonal") else "kfac-diagonal")
    total = stats.total()
    whole_top = torch.cat([weighted[n].reshape(-1)[g] for n, g in zip(names, global_top)]).sum()
    assert close(total.global_top_share, float(whole_top / sum(w.sum() for w in weighted.values())))
    assert close(total.l2, float(torch.cat([delta[n].double().reshape(-1) for n in names]).norm()))
    block = [n for n in names if block_of(n) == "model.layers.1"]
    assert len(block) > 5
    row = {r.name: r for r in stats.blocks()}["model.layers.1"]
    assert close(row.l2, float(torch.cat([delta[n].double().reshape(-1) for n in block]).norm()))
    assert close(row.tensor_top_share, sum(rows[n].in_tensor_top for n in block) / sum(rows[n].weighted for n in block))
    if cache_kind == "mixed":
        assert {r.fisher for r in stats.tensors} == {"diagonal", "kfac-diagonal"}


def png_size(file: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking signature and CRC."""
    data = file.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(data[12:29])
    assert data.endswith(b"IEND\xaeB`\x82")
    return struct.unpack(">II", data[16:24])


def test_stats_cli_prints_table_and_writes_png_and_json(tmp_path, deltas, mixed_cache):
    from graftmerge.pipeline.delta_report import compute_stats

    plot, numbers = tmp_path / "plots" / "delta.png", tmp_path / "delta.json"
    result = invoke("delta", "stats", deltas["ft"], "--fisher", mixed_cache, "--plot", plot, "--json", numbers, "-q")
    assert result.exit_code == 0, result.output
    assert "per tensor" in result.output and "per block" in result.output
    assert "model.layers.0.mlp.up_proj.weight" in result.output and "paper Fig. 8" in result.output
    width, height = png_size(plot)
    assert width > 200 and height > 200
    from PIL import Image

    with Image.open(plot) as image:
        image.verify()
    saved = json.loads(numbers.read_text())
    expected = compute_stats(deltas["ft"], mixed_cache, progress=False)
    assert saved["total"]["global_top_share"] == pytest.approx(expected.total().global_top_share, rel=1e-12)
    assert [b["name"] for b in saved["blocks"]] == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.norm",
    ]

    plain = invoke("delta", "stats", deltas["ft"], "--plot", tmp_path / "plain.png", "--blocks-only", "-q")
    assert plain.exit_code == 0, plain.output
    assert "per tensor" not in plain.output and "--fisher" in plain.output
    png_size(tmp_path / "plain.png")


# -- bad inputs -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def others(tmp_path_factory, tied_models, untied_models) -> dict[str, Path]:
    """Deltas that do not fit: another architecture's names, other shapes, another donor."""
    root = tmp_path_factory.mktemp("other-deltas")
    narrow = make_graft_inputs(root / "narrow", seed=5, tie_word_embeddings=True, hidden_size=32)
    return {
        "untied": extract(untied_models["donor"], untied_models["donor_ft"], root / "untied-delta"),
        "narrow": extract(narrow["donor"], narrow["donor_ft"], root / "narrow-delta"),
        "from_post": extract(tied_models["post"], tied_models["donor_ft"], root / "post-delta"),
    }


def assert_one_line_error(result, expected: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip() and "it/s]" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0], lines[0]
    assert "Traceback" not in result.output


BAD_GRAFTS = {
    "delta folder without manifest": ("no_manifest", "has no delta_manifest.json"),
    "delta from another donor": ("from_post", "was extracted from another donor"),
    "delta of another architecture": ("untied", "tensors differ between post model"),
    "delta of other shapes": ("narrow", "shape mismatch for model."),
    "deltas from different donors": ("two_donors", "extracted from different donors"),
    "no donor_ft and no delta": ("donor_only", "role donor_ft (the fine-tuned donor) or role delta"),
}


@pytest.mark.parametrize("case", sorted(BAD_GRAFTS))
def test_bad_delta_graft_is_one_line_and_touches_nothing(tmp_path, tied_models, deltas, others, case):
    m = tied_models
    key, expected = BAD_GRAFTS[case]
    entries = {
        "no_manifest": [(m["donor_ft"], "delta", 1.0)],
        "from_post": [(m["donor"], "donor", None), (others["from_post"], "delta", 1.0)],
        "untied": [(others["untied"], "delta", 1.0)],
        "narrow": [(others["narrow"], "delta", 1.0)],
        "two_donors": [(deltas["ft"], "delta", 1.0), (others["from_post"], "delta", 1.0)],
        "donor_only": [(m["donor"], "donor", None)],
    }[key]
    config = tmp_path / "graft.yml"
    config.write_text(config_yaml(m["post"], entries))
    watched = [m["post"], m["donor"], m["donor_ft"], deltas["ft"], *others.values()]
    before = [tree_digest(p) for p in watched]
    out = tmp_path / "out"
    assert_one_line_error(invoke("merge", config, out), expected)
    assert not out.exists()
    assert not list(tmp_path.glob(".out.*"))  # no staging folder, old copy or lock file left
    assert [tree_digest(p) for p in watched] == before


def test_bad_delta_graft_through_stock_mergekit_yaml(tmp_path, tied_models):
    m = tied_models
    config = tmp_path / "graft.yml"
    config.write_text(config_yaml(m["post"], [(m["donor_ft"], "delta", 1.0)]))
    result = run_cli("mergekit-yaml", str(config), str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: model ")
    assert "delta_manifest.json" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_bad_extract_and_stats_inputs(tmp_path, tied_models, untied_models, deltas):
    m = tied_models
    watched = [m["donor"], m["donor_ft"], untied_models["donor_ft"], deltas["ft"]]
    before = [tree_digest(p) for p in watched]
    out = tmp_path / "delta"

    assert_one_line_error(invoke("delta", "extract", tmp_path / "nowhere", m["donor_ft"], "-o", out),
                          "does not exist")
    assert_one_line_error(invoke("delta", "extract", m["donor"], untied_models["donor_ft"], "-o", out),
                          "tensors differ between donor")
    weights = read_model(m["donor_ft"])
    weights["model.norm.weight"] = torch.zeros(3)
    wrong_shape = tmp_path / "wrong-shape"
    wrong_shape.mkdir()
    save_file(weights, str(wrong_shape / "model.safetensors"))
    assert_one_line_error(invoke("delta", "extract", m["donor"], wrong_shape, "-o", out),
                          "shape mismatch for model.norm.weight")
    assert_one_line_error(invoke("delta", "extract", m["donor"], m["donor"], "-o", out), "same folder")
    assert_one_line_error(invoke("delta", "extract", m["donor"], m["donor_ft"], "-o", out, "--shard-size", "lots"),
                          "not a size")
    assert not out.exists()

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_one_line_error(invoke("delta", "extract", m["donor"], m["donor_ft"], "-o", out), "already exists")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

    assert_one_line_error(invoke("delta", "stats", m["donor_ft"]), "is not a graftmerge delta")
    other_cache = tmp_path / "other-fisher"

    write_diagonal_cache(other_cache, untied_models["post"])
    assert_one_line_error(invoke("delta", "stats", deltas["ft"], "--fisher", other_cache, "--plot", tmp_path / "p.png"),
                          "was made for another model")
    assert_one_line_error(invoke("delta", "stats", deltas["ft"], "--top", "0"), "--top must be a fraction")
    assert not (tmp_path / "p.png").exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    assert [tree_digest(p) for p in watched] == before


def test_delta_help_teaches():
    result = invoke("delta", "--help")
    assert result.exit_code == 0 and "role: delta" in result.output
    assert "extract" in result.output and "stats" in result.output
    top = invoke("--help")
    assert "delta" in top.output
    stats_help = invoke("delta", "stats", "--help")
    assert "Fig. 8" in stats_help.output and "KFAC" in stats_help.output
