"""Every bad input: one clear line, non-zero exit, nothing in OUT, inputs untouched.

Run through mergekit-yaml's own click command and ``graftmerge merge``
in-process (the import hook is installed in this process), plus a few through
the real console scripts in a subprocess.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from graftmerge.adapter import import_hook
from tests.helpers.configs import graft_yaml
from tests.helpers.fisher_caches import write_diagonal_cache, write_mixed_cache
from tests.helpers.models import copy_model, tree_digest
from tests.helpers.runners import run_process


@pytest.fixture(scope="module")
def bad(tied_models, untied_models, tied_diag_cache, tmp_path_factory) -> dict[str, Path]:
    """Broken copies of the inputs, made once."""
    root = tmp_path_factory.mktemp("bad")
    m = tied_models
    first_shard = sorted(m["donor_ft"].glob("*.safetensors"))[0]
    paths = {}

    paths["truncated"] = copy_model(m["donor_ft"], root / "truncated")
    shard = paths["truncated"] / first_shard.name
    shard.write_bytes(shard.read_bytes()[:-10])

    paths["corrupt"] = copy_model(m["donor_ft"], root / "corrupt")
    shard = paths["corrupt"] / first_shard.name
    data = bytearray(shard.read_bytes())
    data[8:16] = b"\x00garbage"
    shard.write_bytes(bytes(data))

    paths["huge_header"] = copy_model(m["donor_ft"], root / "huge_header")
    shard = paths["huge_header"] / first_shard.name
    shard.write_bytes(struct.pack("<Q", 10**12) + shard.read_bytes()[8:])

    paths["missing_tensor"] = copy_model(m["donor_ft"], root / "missing_tensor")
    _rewrite_tensor(paths["missing_tensor"], "model.norm.weight", None)

    paths["wrong_shape"] = copy_model(m["donor_ft"], root / "wrong_shape")
    _rewrite_tensor(paths["wrong_shape"], "model.norm.weight", torch.zeros(3))

    cache = lambda name, transform: write_diagonal_cache(root / name, m["post"], transform=transform)  # noqa: E731
    paths["fisher_nan"] = cache("fisher_nan", None)
    _poison_cache(paths["fisher_nan"], float("nan"))
    paths["fisher_inf"] = cache("fisher_inf", None)
    _poison_cache(paths["fisher_inf"], float("inf"))
    paths["fisher_negative"] = cache("fisher_negative", None)
    _poison_cache(paths["fisher_negative"], -1.0)
    paths["fisher_other_model"] = write_diagonal_cache(root / "fisher_other", untied_models["post"])
    kfac = lambda name: write_mixed_cache(root / name, m["post"])  # noqa: E731
    paths["kfac_not_orthonormal"] = kfac("kfac_not_orthonormal")
    _edit_cache_tensor(paths["kfac_not_orthonormal"], "rows/eigenvectors", lambda t: t * 1.5)
    paths["kfac_nan_eigenvector"] = kfac("kfac_nan_eigenvector")
    _edit_cache_tensor(
        paths["kfac_nan_eigenvector"],
        "columns/eigenvectors",
        lambda t: t.index_fill(0, torch.tensor([2]), float("nan")),
    )
    paths["kfac_negative_eigenvalue"] = kfac("kfac_negative_eigenvalue")
    _edit_cache_tensor(
        paths["kfac_negative_eigenvalue"], "columns/eigenvalues", lambda t: t.index_fill(0, torch.tensor([0]), -1.0)
    )
    paths["kfac_nan_eigenvalue"] = kfac("kfac_nan_eigenvalue")
    _edit_cache_tensor(
        paths["kfac_nan_eigenvalue"], "rows/eigenvalues", lambda t: t.index_fill(0, torch.tensor([1]), float("nan"))
    )
    paths["kfac_wrong_factor"] = kfac("kfac_wrong_factor")
    _edit_manifest(paths["kfac_wrong_factor"], lambda e: e["model.layers.0.self_attn.k_proj.weight"]["kfac"].update(
        rows=e["model.layers.0.self_attn.q_proj.weight"]["kfac"]["rows"]))
    paths["kfac_on_vector"] = kfac("kfac_on_vector")
    _edit_manifest(paths["kfac_on_vector"], lambda e: e["model.norm.weight"].update(
        representation="kfac", kfac=e["model.layers.0.self_attn.q_proj.weight"]["kfac"]))
    paths["not_a_cache"] = root / "not_a_cache"
    paths["not_a_cache"].mkdir()
    (paths["not_a_cache"] / "model.safetensors").write_bytes(b"")
    return paths


def _rewrite_tensor(folder: Path, name: str, value: torch.Tensor | None) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"][name]
    tensors = load_file(str(shard))
    if value is None:
        del tensors[name]
        del index["weight_map"][name]
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        tensors[name] = value
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _edit_cache_tensor(folder: Path, key_suffix: str, edit) -> None:
    """Apply ``edit`` to the first stored tensor whose key ends with ``key_suffix``."""
    for shard in sorted(folder.glob("fisher-*.safetensors")):
        tensors = load_file(str(shard))
        keys = sorted(k for k in tensors if k.endswith(key_suffix))
        if keys:
            tensors[keys[0]] = edit(tensors[keys[0]]).contiguous()
            save_file(tensors, str(shard))
            return
    raise AssertionError(f"no {key_suffix} in {folder}")


def _edit_manifest(folder: Path, edit) -> None:
    manifest = json.loads((folder / "fisher_manifest.json").read_text())
    edit(manifest["entries"])
    (folder / "fisher_manifest.json").write_text(json.dumps(manifest))


def _poison_cache(folder: Path, value: float) -> None:
    shard = sorted(folder.glob("fisher-*.safetensors"))[0]
    tensors = load_file(str(shard))
    name = sorted(tensors)[0]
    tensors[name].view(-1)[3] = value
    save_file(tensors, str(shard))


def _config(m, bad, case: str) -> str:
    post, donor, ft, cache = m["post"], m["donor"], m["donor_ft"], m["cache"]
    configs = {
        "missing role": f"merge_method: graft\nbase_model: {post}\nmodels:\n  - model: {donor}\n"
                        f"  - model: {ft}\n    parameters: {{role: donor_ft}}\n",
        "unknown role": graft_yaml(post, donor, [(ft, 1)]).replace("role: donor}", "role: donr}"),
        "duplicate donor": f"merge_method: graft\nbase_model: {post}\nmodels:\n"
                           f"  - model: {donor}\n    parameters: {{role: donor}}\n"
                           f"  - model: {m['donor_ft2']}\n    parameters: {{role: donor}}\n"
                           f"  - model: {ft}\n    parameters: {{role: donor_ft}}\n",
        "donor_ft without donor": f"merge_method: graft\nbase_model: {post}\nmodels:\n"
                                  f"  - model: {ft}\n    parameters: {{role: donor_ft}}\n"
                                  f"  - model: {m['donor_ft2']}\n    parameters: {{role: donor_ft}}\n",
        "no donor_ft": f"merge_method: graft\nbase_model: {post}\nmodels:\n"
                       f"  - model: {donor}\n    parameters: {{role: donor}}\n",
        "no base_model": graft_yaml(post, donor, [(ft, 1)]).replace(f"base_model: {post}\n", ""),
        "same model twice": graft_yaml(post, donor, [(ft, 1), (ft, 2)]),
        "misspelt base_model": graft_yaml(post, donor, [(ft, 1)]).replace("base_model:", "base_modle:"),
        "misspelt key of a model": graft_yaml(post, donor, [(ft, 1)]).replace("    parameters: {role: donor_ft",
                                                                              "    params: {role: donor_ft"),
        "parameter at the top level": graft_yaml(post, donor, [(ft, 1)]) + "rho: 0.1\n",
        "unknown top-level key": graft_yaml(post, donor, [(ft, 1)]) + "notes: first try\n",
        "weight on donor": graft_yaml(post, donor, [(ft, 1)]).replace("{role: donor}", "{role: donor, weight: 2}"),
        "unknown parameter": graft_yaml(post, donor, [(ft, 1)], extra_global="  rhoo: 0.1\n"),
        "rho is 1": graft_yaml(post, donor, [(ft, 1)], rho=1.0, fisher=cache),
        "negative rho": graft_yaml(post, donor, [(ft, 1)], rho=-0.1, fisher=cache),
        "rho without fisher": graft_yaml(post, donor, [(ft, 1)], rho=0.1),
        "rho as a gradient": graft_yaml(post, donor, [(ft, 1)], fisher=cache).replace("rho: 0.0", "rho: [0.1, 0.2]"),
        "bad rho_scope": graft_yaml(post, donor, [(ft, 1)], rho=0.1, fisher=cache, scope="layer"),
        "bad mask": graft_yaml(post, donor, [(ft, 1)], rho=0.1, fisher=cache, mask="full"),
        "mask kfac on a diagonal cache": graft_yaml(post, donor, [(ft, 1)], rho=0.1, fisher=cache, mask="kfac"),
        "fisher does not exist": graft_yaml(post, donor, [(ft, 1)], rho=0.1, fisher=bad["not_a_cache"] / "nope"),
        "fisher is not a cache": graft_yaml(post, donor, [(ft, 1)], rho=0.1, fisher=bad["not_a_cache"]),
        "cache for another model": graft_yaml(post, donor, [(ft, 1)], rho=0.1, fisher=bad["fisher_other_model"]),
        "cache with NaN": graft_yaml(post, donor, [(ft, 1)], rho=0.1, fisher=bad["fisher_nan"]),
        "cache with Inf (tensor scope)": graft_yaml(
            post, donor, [(ft, 1)], rho=0.1, fisher=bad["fisher_inf"], scope="tensor"
        ),
        "cache with negative entries": graft_yaml(post, donor, [(ft, 1)], rho=0.1, fisher=bad["fisher_negative"]),
        "shape mismatch": graft_yaml(post, donor, [(bad["wrong_shape"], 1)]),
        "tensor missing from donor_ft": graft_yaml(post, donor, [(bad["missing_tensor"], 1)]),
        "truncated safetensors": graft_yaml(post, donor, [(bad["truncated"], 1)]),
        "corrupt safetensors header": graft_yaml(post, donor, [(bad["corrupt"], 1)]),
        "absurd header length": graft_yaml(post, donor, [(bad["huge_header"], 1)]),
        "model folder does not exist": graft_yaml(post, donor, [(m["post"].parent / "nowhere", 1)]),
        "KFAC eigenvectors not orthonormal": graft_yaml(
            post, donor, [(ft, 1)], rho=0.1, fisher=bad["kfac_not_orthonormal"]
        ),
        "KFAC eigenvector NaN": graft_yaml(post, donor, [(ft, 1)], rho=0.1, fisher=bad["kfac_nan_eigenvector"]),
        "KFAC eigenvalue below zero": graft_yaml(
            post, donor, [(ft, 1)], rho=0.1, fisher=bad["kfac_negative_eigenvalue"], scope="tensor"
        ),
        "KFAC eigenvalue NaN": graft_yaml(post, donor, [(ft, 1)], rho=0.1, fisher=bad["kfac_nan_eigenvalue"]),
        "KFAC factor of the wrong size": graft_yaml(post, donor, [(ft, 1)], rho=0.1, fisher=bad["kfac_wrong_factor"]),
        "KFAC entry for a vector": graft_yaml(post, donor, [(ft, 1)], rho=0.1, fisher=bad["kfac_on_vector"]),
    }
    return configs[case]


EXPECTED = {
    "missing role": "has no role",
    "unknown role": "unknown role 'donr'",
    "duplicate donor": "duplicate role donor",
    "donor_ft without donor": "without a donor",
    "no donor_ft": "at least one model with role donor_ft",
    "no base_model": "needs `base_model:`",
    "same model twice": "listed twice",
    "misspelt base_model": "graft.yml: unknown key base_modle (did you mean base_model?)",
    "misspelt key of a model": "unknown key params in model 2 of `models:` (did you mean parameters?)",
    "parameter at the top level": "unknown key rho (rho is a parameter of the method: put it under `parameters:`)",
    "unknown top-level key": "unknown key notes (the keys mergekit reads here: modules, slices, models, merge_method,",
    "weight on donor": "`weight` belongs on donor_ft",
    "unknown parameter": "unknown graft parameter(s) rhoo",
    "rho is 1": "rho must be in [0, 1)",
    "negative rho": "rho must be in [0, 1)",
    "rho without fisher": "needs `fisher:",
    "rho as a gradient": "graft parameter rho: a per-layer or per-tensor rho",
    "bad rho_scope": "rho_scope must be one of",
    "bad mask": "mask must be one of",
    "mask kfac on a diagonal cache": "has no KFAC entries",
    "fisher does not exist": "does not exist",
    "fisher is not a cache": "is not a Fisher cache",
    "cache for another model": "made for another model",
    "cache with NaN": "contains NaN or Inf",
    "cache with Inf (tensor scope)": "contains NaN or Inf",
    "cache with negative entries": "contains negative entries",
    "shape mismatch": "shape mismatch for model.norm.weight",
    "tensor missing from donor_ft": "missing from donor_ft",
    "truncated safetensors": "truncated or corrupt",
    "corrupt safetensors header": "corrupt safetensors header",
    "absurd header length": "corrupt or truncated safetensors header",
    "model folder does not exist": "does not exist",
    "KFAC eigenvectors not orthonormal": "are not orthonormal",
    "KFAC eigenvector NaN": "contain NaN or Inf",
    "KFAC eigenvalue below zero": "contains negative entries",
    "KFAC eigenvalue NaN": "contains NaN or Inf",
    "KFAC factor of the wrong size": "KFAC rows factor of 'model.layers.0.self_attn.k_proj.weight' has size 64",
    "KFAC entry for a vector": "which is not 2-D",
}


def _invoke(tool: str, config: Path, out: Path):
    import_hook.install()
    if tool == "mergekit-yaml":
        from mergekit.scripts.run_yaml import main
    else:
        from graftmerge.cli import main
    args = [str(config), str(out)] if tool == "mergekit-yaml" else ["merge", str(config), str(out)]
    return CliRunner().invoke(main, args)


@pytest.mark.parametrize("tool", ["mergekit-yaml", "graftmerge merge"])
@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_input_is_one_clean_line(tmp_path, tied_models, tied_diag_cache, bad, case, tool):
    models = {**tied_models, "cache": tied_diag_cache}
    config = tmp_path / "graft.yml"
    config.write_text(_config(models, bad, case))
    watched = [tied_models["post"], tied_models["donor"], tied_models["donor_ft"], tied_diag_cache]
    before = [tree_digest(p) for p in watched]
    out = tmp_path / "out"
    result = _invoke(tool, config, out)
    assert result.exit_code != 0
    lines = [line for line in result.stderr.splitlines() if line.strip() and "it/s]" not in line]
    assert lines and lines[-1].startswith("error: "), result.stderr
    assert EXPECTED[case] in lines[-1], lines[-1]
    assert "Traceback" not in result.output
    assert not out.exists()
    assert not list(tmp_path.glob(".out.*"))  # no staging folder, old copy or lock file left
    assert [tree_digest(p) for p in watched] == before


def test_stock_console_script_error_is_one_line_and_verbose_shows_traceback(tmp_path, tied_models):
    m = tied_models
    config = tmp_path / "graft.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1)], rho=0.1))
    quiet = run_process("mergekit-yaml", str(config), str(tmp_path / "out"))
    assert quiet.returncode == 2
    assert quiet.stderr.strip().splitlines()[-1].startswith("error: graft parameter rho > 0 needs `fisher:")
    assert "Traceback" not in quiet.stderr
    verbose = run_process("mergekit-yaml", str(config), str(tmp_path / "out"), "-v")
    assert verbose.returncode != 0 and "Traceback" in verbose.stderr and "GraftError" in verbose.stderr
    assert not (tmp_path / "out").exists()
