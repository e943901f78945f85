"""Hostile artifacts: every corrupt model shard, Fisher cache or delta folder is refused in one line.

A battery of damaged inputs (safetensors headers and offsets, shard indexes, Fisher and
delta manifests, stored dtypes and shapes, values the math needs) goes through the real
entry points: the stock ``mergekit-yaml`` and ``graftmerge merge`` (click commands run in
this process with the import hook installed, tests.helpers.runners.run_cli), a few real processes, and
``graftmerge fisher pull`` / ``delta pull`` against the fake Hub of tests/helpers/fake_hub.py. Each must end
with exit status 2 and one ``error: ...`` line naming the file (and tensor or key), no
traceback, no OUT, and the inputs byte for byte as they were.

Also here: the adversarial KFAC basis V(I + 50·e₁wᵀ) that fixed random probes could not
see, and the threshold cache keyed by content (an input edited in place, same size,
mtime restored, must not reuse a stale threshold).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from graftmerge.cli import main
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.math.eigenbasis import check_orthonormal
from graftmerge.pipeline.delta_extract import extract_delta
from tests.helpers.configs import graft_yaml
from tests.helpers.fisher_caches import write_diagonal_cache, write_mixed_cache
from tests.helpers.models import copy_model, read_model, tree_digest
from tests.helpers.runners import error_line, run_cli, run_process

pytestmark = pytest.mark.usefixtures("plain_argv")  # pytest's own flags must not reach report_errors' -v

SHARD = "model-00011-of-00011.safetensors"  # of the tiny model: norm, both layer-1 norms, layer-1 down_proj
NORM, DOWN = "model.norm.weight", "model.layers.1.mlp.down_proj.weight"
LN1, LN2 = "model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"
Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"
DEEP = 200_000  # nesting levels of the deep-JSON cases


# -- raw file surgery -----------------------------------------------------------------------


def read_raw(file: Path) -> tuple[dict, bytes]:
    """(header as a dict, data section) of a safetensors file."""
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def write_raw(file: Path, header: dict | bytes, data: bytes) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def edit_header(file: Path, edit: Callable[[dict], None]) -> None:
    header, data = read_raw(file)
    edit(header)
    write_raw(file, header, data)


def edit_tensors(file: Path, edit: Callable[[dict], None]) -> None:
    """Load every tensor of a shard, ``edit`` the dict, save it back (metadata kept)."""
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def edit_json(file: Path, edit: Callable[[dict], None]) -> None:
    value = json.loads(file.read_text())
    edit(value)
    file.write_text(json.dumps(value))


def deep_json(prefix: str = '{"deep": ', suffix: str = "}") -> bytes:
    return (prefix + "[" * DEEP + "]" * DEEP + suffix).encode()


def duplicate_key(file: Path, key: str) -> None:
    """Append a second ``key`` to the top-level JSON object of ``file`` (header or plain JSON)."""
    if file.suffix == ".safetensors":
        header, data = read_raw(file)
        raw = json.dumps(header)
        write_raw(file, (raw[:-1] + f", {json.dumps(key)}: {json.dumps(header[key])}}}").encode(), data)
    else:
        raw = file.read_text().rstrip()
        value = json.loads(raw)
        file.write_text(raw[:-1] + f", {json.dumps(key)}: {json.dumps(value[key])}}}")


def set_offsets(name: str, offsets: list) -> Callable[[dict], None]:
    return lambda header: header[name].update(data_offsets=offsets)


def shifted(header: dict, by: int) -> None:
    for name, entry in header.items():
        if name != "__metadata__":
            entry["data_offsets"] = [o + by for o in entry["data_offsets"]]


def gap(file: Path) -> None:
    header, data = read_raw(file)
    shifted(header, 8)
    write_raw(file, header, b"\0" * 8 + data)


def orthogonal_to_old_probes(n: int) -> torch.Tensor:
    """A unit w with wᵀx = 0 for the 4 fixed-seed probes the old read check used (‖V x‖ = ‖x‖)."""
    probes = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    basis = torch.linalg.qr(probes.double())[0]
    w = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    w -= basis @ (basis.T @ w)
    return w / w.norm()


def adversarial(vectors: torch.Tensor) -> torch.Tensor:
    """V(I + 50·e₁wᵀ) = V + 50·v₁wᵀ: ‖V'x‖ = ‖x‖ for every old probe x, yet far from orthonormal."""
    w = orthogonal_to_old_probes(vectors.shape[1])
    return (vectors.double() + 50 * vectors.double()[:, :1] * w[None, :]).float()


def old_probe_error(vectors: torch.Tensor) -> float:
    """What the previous read check measured: max |‖V x‖ − 1| over 4 fixed random unit probes."""
    probes = torch.randn(vectors.shape[1], 4, generator=torch.Generator().manual_seed(0))
    probes /= probes.norm(dim=0, keepdim=True)
    return float(((vectors @ probes).norm(dim=0) - 1).abs().max())


# -- the battery ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One corruption: how to make it (on a fresh copy), and what the error line must say."""

    artifact: str  # "model" (a donor_ft), "fisher" (a mixed KFAC cache), "diagfisher", "delta"
    corrupt: Callable[[Path], Path]  # folder copy -> the path the error must name
    expected: str
    rho: float = 0.1  # fisher cases mask; model and delta cases run with and without


def model_case(corrupt: Callable[[Path], object], expected: str) -> Case:
    """A donor_ft case; the error names what ``corrupt`` returns when it is a path, else the edited shard."""
    def named(folder: Path) -> Path:
        result = corrupt(folder)
        return result if isinstance(result, Path) else folder / SHARD
    return Case("model", named, expected, rho=0.0)


def write(file: Path, data: bytes) -> Path:
    file.write_bytes(data)
    return file


def shard_edit(edit: Callable[[Path], None]) -> Callable[[Path], None]:
    return lambda folder: edit(folder / SHARD)


def index_edit(edit: Callable[[dict], None]) -> Callable[[Path], Path]:
    def corrupt(folder: Path) -> Path:
        edit_json(folder / "model.safetensors.index.json", edit)
        return folder / "model.safetensors.index.json"
    return corrupt


def write_index(raw: bytes) -> Callable[[Path], Path]:
    def corrupt(folder: Path) -> Path:
        (folder / "model.safetensors.index.json").write_bytes(raw)
        return folder / "model.safetensors.index.json"
    return corrupt


def drop_tensor(folder: Path) -> Path:
    edit_tensors(folder / SHARD, lambda t: t.pop(NORM))
    edit_json(folder / "model.safetensors.index.json", lambda index: index["weight_map"].pop(NORM))
    return folder


MODEL_CASES = {
    "truncated shard": model_case(
        lambda f: (f / SHARD).write_bytes((f / SHARD).read_bytes()[:-10]), "truncated or corrupt"
    ),
    "trailing bytes": model_case(
        lambda f: (f / SHARD).write_bytes((f / SHARD).read_bytes() + b"\0" * 16), "truncated or corrupt"
    ),
    "header length 2^62": model_case(
        lambda f: (f / SHARD).write_bytes(struct.pack("<Q", 2**62) + (f / SHARD).read_bytes()[8:]),
        "corrupt or truncated safetensors header",
    ),
    "five-byte file": model_case(lambda f: (f / SHARD).write_bytes(b"abcde"), "not a safetensors file"),
    "header not JSON": model_case(shard_edit(lambda s: write_raw(s, b"{" + b"x" * 40, read_raw(s)[1])), "not JSON"),
    "header is a list": model_case(shard_edit(lambda s: write_raw(s, b"[1, 2]", read_raw(s)[1])), "not a JSON object"),
    "header repeats a tensor": model_case(shard_edit(lambda s: duplicate_key(s, NORM)), f"key '{NORM}' appears twice"),
    "header nested 200k deep": model_case(
        shard_edit(lambda s: write_raw(s, deep_json('{"__metadata__": '), read_raw(s)[1])), "nested too deeply"
    ),
    "metadata not str to str": model_case(
        shard_edit(lambda s: edit_header(s, lambda h: h.update(__metadata__={"format": 1}))),
        "__metadata__ is not a map of strings to strings",
    ),
    "entry without data_offsets": model_case(
        shard_edit(lambda s: edit_header(s, lambda h: h[NORM].pop("data_offsets"))),
        f"corrupt header entry for tensor '{NORM}'",
    ),
    "entry with an extra key": model_case(
        shard_edit(lambda s: edit_header(s, lambda h: h[NORM].update(crc=1))),
        f"corrupt header entry for tensor '{NORM}'",
    ),
    "unknown dtype": model_case(
        shard_edit(lambda s: edit_header(s, lambda h: h[NORM].update(dtype="F128"))),
        f"tensor '{NORM}' has unsupported dtype F128",
    ),
    "float dimension": model_case(
        shard_edit(lambda s: edit_header(s, lambda h: h[NORM].update(shape=[64.0]))), f"tensor '{NORM}' (shape [64.0]"
    ),
    "bool dimension": model_case(
        shard_edit(lambda s: edit_header(s, lambda h: h[NORM].update(shape=[True, 64]))),
        f"tensor '{NORM}' (shape [True, 64]",
    ),
    "negative dimension": model_case(
        shard_edit(lambda s: edit_header(s, lambda h: h[NORM].update(shape=[-64]))), f"tensor '{NORM}' (shape [-64]"
    ),
    "float offsets": model_case(
        shard_edit(
            lambda s: edit_header(s, lambda h: h[NORM].update(data_offsets=[float(o) for o in h[NORM]["data_offsets"]]))
        ),
        f"tensor '{NORM}' (data_offsets",
    ),
    "overlapping offsets": model_case(
        shard_edit(lambda s: edit_header(s, lambda h: h[LN2].update(data_offsets=h[LN1]["data_offsets"]))),
        "overlaps the tensor before it",
    ),
    "gap before the first tensor": model_case(shard_edit(gap), "leaves a gap before it"),
    "offsets shorter than the shape": model_case(
        shard_edit(
            lambda s: edit_header(
                s, lambda h: h[NORM].update(data_offsets=[h[NORM]["data_offsets"][0], h[NORM]["data_offsets"][1] - 4])
            )
        ),
        f"tensor '{NORM}' offsets do not match its shape",
    ),
    "transposed shape": model_case(
        lambda f: edit_header(f / SHARD, lambda h: h[DOWN].update(shape=[96, 64])) or f, f"shape mismatch for {DOWN}"
    ),
    "wrong shape": model_case(
        lambda f: edit_tensors(f / SHARD, lambda t: t.update({NORM: torch.zeros(3)})) or f, f"shape mismatch for {NORM}"
    ),
    "missing tensor": model_case(drop_tensor, f"missing from donor_ft {{folder}}: {NORM}"),
    "index puts a tensor in the wrong shard": model_case(
        index_edit(lambda i: i["weight_map"].update({NORM: "model-00001-of-00011.safetensors"})),
        f"lists tensor '{NORM}' in model-00001-of-00011.safetensors",
    ),
    "index omits a tensor": model_case(
        index_edit(lambda i: i["weight_map"].pop(NORM)), f"does not list tensor '{NORM}'"
    ),
    "index names a shard outside": model_case(
        index_edit(lambda i: i["weight_map"].update({NORM: "../x.safetensors"})),
        "'../x.safetensors' is not a .safetensors file inside the folder",
    ),
    "index without weight_map": model_case(write_index(b'{"metadata": {}}'), "no `weight_map`"),
    "index nested 200k deep": model_case(write_index(deep_json('{"weight_map": {}, "deep": ')), "nested deeper than"),
    "index repeats a key": model_case(
        lambda f: duplicate_key(f / "model.safetensors.index.json", "weight_map") or f / "model.safetensors.index.json",
        "key 'weight_map' appears twice",
    ),
}


def manifest_edit(edit: Callable[[dict], None]) -> Callable[[Path], Path]:
    def corrupt(folder: Path) -> Path:
        edit_json(folder / "fisher_manifest.json", edit)
        return folder
    return corrupt


def manifest_bytes(make: Callable[[str], bytes]) -> Callable[[Path], Path]:
    def corrupt(folder: Path) -> Path:
        file = folder / "fisher_manifest.json"
        file.write_bytes(make(file.read_text()))
        return file
    return corrupt


def fisher_key(folder: Path, which: str) -> str:
    """A tensor key of the mixed cache: ``diag`` (model.norm.weight), ``rows``/``columns``/... of q_proj."""
    manifest = json.loads((folder / "fisher_manifest.json").read_text())
    if which == "diag":
        return manifest["entries"][NORM]["diagonal"]["key"]
    side, field = which.split("/")
    return manifest["factors"][manifest["entries"][Q]["kfac"][side]][field]


def cache_tensor(which: str, edit: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Path], Path]:
    """Replace one stored tensor of the cache by ``edit(tensor)``; the error must name its key."""
    def corrupt(folder: Path) -> Path:
        key = fisher_key(folder, which) if "/" in which or which == "diag" else which
        shard = folder / json.loads((folder / "fisher_manifest.json").read_text())["files"][key]
        edit_tensors(shard, lambda tensors: tensors.update({key: edit(tensors[key]).contiguous()}))
        return Path(key)  # named as a key, not a path
    return corrupt


def cache_shard(edit: Callable[[Path], None]) -> Callable[[Path], Path]:
    def corrupt(folder: Path) -> Path:
        shard = folder / "fisher-00001.safetensors"
        edit(shard)
        return shard
    return corrupt


def poke(value: float, index: int = 3) -> Callable[[torch.Tensor], torch.Tensor]:
    def edit(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        tensor.view(-1)[index] = value
        return tensor
    return edit


def drop_key(folder: Path) -> Path:
    edit_tensors(folder / "fisher-00001.safetensors", lambda t: t.pop(NORM))
    return Path(NORM)


def first_factor(manifest: dict) -> dict:
    return manifest["factors"][sorted(manifest["factors"])[0]]


FISHER_CASES = {
    "manifest without entries": Case("fisher", manifest_edit(lambda m: m.pop("entries")), "no `entries`"),
    "manifest nested 200k deep": Case(
        "fisher",
        manifest_bytes(lambda text: deep_json(text.rstrip()[:-1] + ', "deep": ')),
        "nested deeper than 32 levels",
    ),
    "manifest repeats a key": Case(
        "fisher",
        lambda f: duplicate_key(f / "fisher_manifest.json", "kind") or f / "fisher_manifest.json",
        "key 'kind' appears twice",
    ),
    "manifest not JSON": Case(
        "fisher", manifest_bytes(lambda text: text[: len(text) // 2].encode()), "corrupt manifest"
    ),
    "format_version true": Case(
        "fisher", manifest_edit(lambda m: m.update(format_version=True)), "format version True is not supported"
    ),
    "unknown kind": Case("fisher", manifest_edit(lambda m: m.update(kind="weird")), "`kind` is 'weird'"),
    "entries is a list": Case("fisher", manifest_edit(lambda m: m.update(entries=[1, 2])), "`entries` is list"),
    "unknown representation": Case(
        "fisher",
        manifest_edit(lambda m: m["entries"][NORM].update(representation="full")),
        f"entries['{NORM}']` has representation 'full'",
    ),
    "unknown factor key": Case(
        "fisher",
        manifest_edit(lambda m: m["entries"][Q]["kfac"].update(rows="kfac/nope/rows")),
        "names factor 'kfac/nope/rows', which `factors` does not have",
    ),
    "diagonal key not filed": Case(
        "fisher",
        manifest_edit(lambda m: m["files"].pop(NORM)),
        f"tensor {NORM!r} is named but `files` has no shard for it",
    ),
    "diagonal keyed by another name": Case(
        "fisher",
        manifest_edit(lambda m: m["entries"][NORM]["diagonal"].update(key="nope")),
        "names tensor 'nope'; a diagonal is stored under its weight's own name",
    ),
    "files names a path outside": Case(
        "fisher",
        manifest_edit(lambda m: m["files"].update({NORM: "../x.safetensors"})),
        "'../x.safetensors', not a .safetensors file inside the cache",
    ),
    "factor rank above size": Case(
        "fisher", manifest_edit(lambda m: first_factor(m).update(rank=10**6)), "rank 1000000"
    ),
    "factor with an unknown field": Case(
        "fisher", manifest_edit(lambda m: first_factor(m).update(scale=2)), "has unknown field 'scale'"
    ),
    "model.tensors with a float dimension": Case(
        "fisher",
        manifest_edit(lambda m: m["model"]["tensors"][NORM].update(shape=[64.5])),
        f"model.tensors['{NORM}']` has shape [64.5]",
    ),
    "entry for a tensor the model lacks": Case(
        "fisher",
        manifest_edit(lambda m: m["entries"].update({"model.bogus.weight": m["entries"][NORM]})),
        "entry for 'model.bogus.weight', which is not a tensor",
    ),
    "diagonal stored F16": Case(
        "fisher", cache_tensor("diag", lambda t: t.half()), "is F16 [64]; the format stores F32"
    ),
    "diagonal stored I64": Case(
        "fisher", cache_tensor("diag", lambda t: t.long()), "is I64 [64]; the format stores F32"
    ),
    "diagonal stored BOOL": Case(
        "fisher", cache_tensor("diag", lambda t: t > 0.5), "is BOOL [64]; the format stores F32"
    ),
    "eigenvalues stored F64": Case("fisher", cache_tensor("rows/eigenvalues", lambda t: t.double()), "is F64 [64]"),
    "eigenvectors of the wrong shape": Case(
        "fisher",
        cache_tensor("columns/eigenvectors", lambda t: t[:, :63]),
        "is F32 [64, 63]; the format stores F32 [64, 64]",
    ),
    "tensor missing from its shard": Case("fisher", drop_key, f"has no tensor '{NORM}'"),
    "shard missing": Case(
        "fisher",
        lambda f: (f / "fisher-00001.safetensors").unlink() or f,
        "is missing shard(s) fisher-00001.safetensors",
    ),
    "shard truncated": Case(
        "fisher", cache_shard(lambda s: s.write_bytes(s.read_bytes()[:-4])), "truncated or corrupt"
    ),
    "shard with overlapping offsets": Case(
        "fisher",
        cache_shard(lambda s: edit_header(s, lambda h: h[LN2].update(data_offsets=h[LN1]["data_offsets"]))),
        "overlaps the tensor before it",
    ),
    "diagonal NaN": Case("fisher", cache_tensor("diag", poke(float("nan"))), "contains NaN or Inf"),
    "diagonal Inf": Case("fisher", cache_tensor("diag", poke(float("inf"))), "contains NaN or Inf"),
    "diagonal negative": Case("fisher", cache_tensor("diag", poke(-1.0)), "contains negative entries"),
    "eigenvalue negative": Case("fisher", cache_tensor("rows/eigenvalues", poke(-1.0, 0)), "contains negative entries"),
    "eigenvalue NaN": Case("fisher", cache_tensor("columns/eigenvalues", poke(float("nan"), 1)), "contains NaN or Inf"),
    "eigenvector NaN": Case(
        "fisher", cache_tensor("columns/eigenvectors", poke(float("nan"), 70)), "contain NaN or Inf"
    ),
    "eigenvectors scaled": Case("fisher", cache_tensor("rows/eigenvectors", lambda t: t * 1.5), "are not orthonormal"),
    "adversarial eigenvectors V(I + 50 e1 wT)": Case(
        "fisher", cache_tensor("rows/eigenvectors", adversarial), "are not orthonormal (max |VᵀV − I| = "
    ),
    "transposed 2-D diagonal": Case(
        "diagfisher", cache_tensor(K, lambda t: t.T), "is F32 [64, 32]; the format stores F32 [32, 64]"
    ),
}


SHARD_OF_DELTA = "model-00001-of-00001.safetensors"  # a tiny model's delta is one shard


def delta_manifest(edit: Callable[[dict], None]) -> Callable[[Path], Path]:
    def corrupt(folder: Path) -> Path:
        edit_json(folder / "delta_manifest.json", edit)
        return folder / "delta_manifest.json"
    return corrupt


def delta_tensor(name: str, edit: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Path], Path]:
    """Replace tensor ``name`` of the delta in its shard (same index); the error must name the shard."""
    def corrupt(folder: Path) -> Path:
        shard = folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]
        edit_tensors(shard, lambda tensors: tensors.update({name: edit(tensors[name]).contiguous()}))
        return shard
    return corrupt


def delta_index(edit: Callable[[dict], None]) -> Callable[[Path], Path]:
    def corrupt(folder: Path) -> Path:
        edit_json(folder / "model.safetensors.index.json", edit)
        return folder / "model.safetensors.index.json"
    return corrupt


def drop_delta_tensor(folder: Path) -> Path:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    edit_tensors(folder / index["weight_map"][NORM], lambda t: t.pop(NORM))
    edit_json(folder / "model.safetensors.index.json", lambda i: i["weight_map"].pop(NORM))
    return folder


DELTA_CASES = {
    "manifest without weight": Case("delta", delta_manifest(lambda m: m.pop("weight")), "no `weight`", rho=0.0),
    "manifest weight NaN": Case(
        "delta",
        delta_manifest(lambda m: m.update(weight=float("nan"))),
        "`weight` is nan, not a finite number",
        rho=0.0,
    ),
    "manifest weight true": Case("delta", delta_manifest(lambda m: m.update(weight=True)), "`weight` is bool", rho=0.0),
    "manifest dtype float16": Case(
        "delta", delta_manifest(lambda m: m.update(dtype="float16")), "`dtype` is 'float16'", rho=0.0
    ),
    "manifest sampled_sha256 not a sha256": Case(
        "delta",
        delta_manifest(lambda m: m["donor"].update(sampled_sha256="x")),
        "`donor.sampled_sha256` is not a sha256",
        rho=0.0,
    ),
    "manifest donor_ft tensors differ": Case(
        "delta",
        delta_manifest(lambda m: m["donor_ft"]["tensors"].pop(NORM)),
        "`donor.tensors` and `donor_ft.tensors` differ",
        rho=0.0,
    ),
    "manifest format_version 2": Case(
        "delta", delta_manifest(lambda m: m.update(format_version=2)), "format version 2 is not supported", rho=0.0
    ),
    "manifest nested 200k deep": Case(
        "delta",
        lambda f: write(
            f / "delta_manifest.json", deep_json((f / "delta_manifest.json").read_text().rstrip()[:-1] + ', "deep": ')
        ),
        "nested deeper than 32 levels",
        rho=0.0,
    ),
    "stored F16, manifest float32": Case(
        "delta",
        delta_tensor(NORM, lambda t: t.half()),
        f"delta tensor '{NORM}' is stored as F16, but the manifest says float32",
        rho=0.0,
    ),
    "NaN in a delta (merge kernel)": Case(
        "delta", delta_tensor(DOWN, poke(float("nan"), 100)), f"delta tensor '{DOWN}' contains NaN or Inf", rho=0.0
    ),
    "Inf in a delta (threshold pass)": Case(
        "delta", delta_tensor(DOWN, poke(float("-inf"), 7)), f"delta tensor '{DOWN}' contains NaN or Inf", rho=0.01
    ),
    "delta shard truncated": Case(
        "delta",
        lambda f: write(f / SHARD_OF_DELTA, (f / SHARD_OF_DELTA).read_bytes()[:-3]),
        "truncated or corrupt",
        rho=0.0,
    ),
    "delta index puts a tensor in the wrong shard": Case(
        "delta",
        delta_index(lambda i: i["weight_map"].update({NORM: "nowhere.safetensors"})),
        "lists missing shard(s) nowhere.safetensors",
        rho=0.0,
    ),
    "delta tensor missing": Case("delta", drop_delta_tensor, "its tensors do not match its manifest", rho=0.0),
}

CASES = {**{f"model: {k}": v for k, v in MODEL_CASES.items()}, **{f"fisher: {k}": v for k, v in FISHER_CASES.items()},
         **{f"delta: {k}": v for k, v in DELTA_CASES.items()}}


@pytest.fixture(scope="module")
def pristine(tied_models, tmp_path_factory) -> dict[str, Path]:
    """The good artifacts every case damages a copy of."""
    root = tmp_path_factory.mktemp("pristine")
    m = tied_models
    return {
        "model": m["donor_ft"],
        "fisher": write_mixed_cache(root / "mixed", m["post"]),
        "diagfisher": write_diagonal_cache(root / "diag", m["post"]),
        "delta": extract_delta(m["donor"], m["donor_ft"], root / "delta", progress=False),
    }


def delta_yaml(post: Path, delta: Path, rho: float, fisher: Path | None) -> str:
    params = f"  rho: {rho}\n" + (f"  fisher: {fisher}\n" if fisher else "")
    return (f"merge_method: graft\nbase_model: {post}\nmodels:\n  - model: {delta}\n    parameters: {{role: delta}}\n"
            f"parameters:\n{params}dtype: float32\n")


def case_config(case: Case, m: dict, bad: Path, pristine: dict) -> str:
    if case.artifact == "model":
        return graft_yaml(m["post"], m["donor"], [(bad, 1)])
    if case.artifact == "delta":
        return delta_yaml(m["post"], bad, case.rho, pristine["fisher"] if case.rho else None)
    return graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1)], rho=case.rho, fisher=bad)


@pytest.mark.parametrize("tool", ["mergekit-yaml", "graftmerge merge"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_corrupt_artifact_is_one_line_naming_it(tmp_path, tied_models, pristine, name, tool):
    case = CASES[name]
    bad = tmp_path / case.artifact
    shutil.copytree(pristine[case.artifact], bad)
    named = case.corrupt(bad)
    config = tmp_path / "graft.yml"
    config.write_text(case_config(case, tied_models, bad, pristine))
    watched = [bad, tied_models["post"], tied_models["donor"], tied_models["donor_ft"], pristine["fisher"]]
    before = [tree_digest(p) for p in watched]
    out = tmp_path / "out"
    line = error_line(run_cli(*tool.split(), str(config), str(out)))
    assert case.expected.format(folder=bad) in line, line
    assert str(named) in line, (str(named), line)  # the file (or the tensor key) is named
    assert not out.exists()
    assert [tree_digest(p) for p in watched] == before


def test_the_battery_is_large():
    assert len(CASES) >= 40 and len({c.artifact for c in CASES.values()}) == 4


# -- the adversarial basis ------------------------------------------------------------------


def test_adversarial_basis_fools_fixed_probes_but_not_the_full_check():
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))[0].float()
    hostile = adversarial(basis)
    assert old_probe_error(hostile) < 1e-3  # the old read check passed it
    check_orthonormal(basis, "good")
    with pytest.raises(Exception, match=r"are not orthonormal \(max \|VᵀV − I\| = "):
        check_orthonormal(hostile, "hostile")
    truncated = basis[:, :10].contiguous()  # a rank-10 side: its Gram is 10 × 10
    check_orthonormal(truncated, "truncated")
    with pytest.raises(Exception, match="not orthonormal"):
        check_orthonormal(adversarial(truncated), "truncated hostile")


def test_real_processes_refuse_in_one_line(tmp_path, tied_models, pristine):
    """Two real console scripts: an overlapping-offsets shard, and the adversarial KFAC basis."""
    m = tied_models
    for tool, name in (("mergekit-yaml", "model: overlapping offsets"),
                       ("graftmerge", "fisher: adversarial eigenvectors V(I + 50 e1 wT)")):
        case = CASES[name]
        bad = tmp_path / f"{case.artifact}-{tool}"
        shutil.copytree(pristine[case.artifact], bad)
        named = case.corrupt(bad)
        config = tmp_path / f"{tool}.yml"
        config.write_text(case_config(case, m, bad, pristine))
        out = tmp_path / f"out-{tool}"
        args = [str(config), str(out)] if tool == "mergekit-yaml" else ["merge", str(config), str(out)]
        line = error_line(run_process(tool, *args))
        assert case.expected in line and str(named) in line, line
        assert not out.exists()


# -- the threshold cache, keyed by content ------------------------------------------------------


def threshold_files(cache: Path) -> list[Path]:
    return sorted((cache / "thresholds").glob("*.json")) if (cache / "thresholds").exists() else []


def test_an_input_edited_in_place_gets_a_fresh_threshold(tmp_path, tied_models, tied_diag_cache):
    m = tied_models
    ft = copy_model(m["donor_ft"], tmp_path / "ft")
    config = tmp_path / "graft.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], [(ft, 1)], rho=0.01, fisher=tied_diag_cache))
    env = {"GRAFTMERGE_CACHE_DIR": str(tmp_path / "cache")}
    merge = lambda out, *extra, tool="graftmerge merge", more=None: run_cli(  # noqa: E731
        *tool.split(), str(config), str(tmp_path / out), *extra, env={**env, **(more or {})})
    assert merge("first").returncode == 0
    assert len(threshold_files(tmp_path / "cache")) == 1

    # Edit donor_ft in place: one tensor's delta ×20 (same shapes, so same header and size), mtime restored.
    name = "model.layers.0.mlp.up_proj.weight"
    shard = ft / Checkpoint(ft).tensors[name].file.name
    stat, stamps = shard.stat(), Checkpoint(ft).file_stamps()
    donor = Checkpoint(m["donor"]).read(name)
    edit_tensors(shard, lambda t: t.update({name: donor + 20 * (t[name] - donor)}))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert Checkpoint(ft).file_stamps() == stamps  # path, size and mtime alone would reuse the stale threshold

    assert merge("second").returncode == 0
    assert len(threshold_files(tmp_path / "cache")) == 2  # a new key: the content changed
    thresholds = {json.loads(f.read_text())["threshold"] for f in threshold_files(tmp_path / "cache")}
    assert len(thresholds) == 2  # and the stale threshold was wrong for the edited input
    assert merge("fresh", "--no-threshold-cache").returncode == 0
    yaml_run = merge("fresh-yaml", tool="mergekit-yaml", more={"GRAFTMERGE_NO_THRESHOLD_CACHE": "1"})
    assert yaml_run.returncode == 0, yaml_run.stderr[-2000:]
    assert len(threshold_files(tmp_path / "cache")) == 2  # neither wrote the cache
    second = read_model(tmp_path / "second")
    for other in ("fresh", "fresh-yaml"):
        got = read_model(tmp_path / other)
        assert all(torch.equal(got[n], second[n]) for n in second), other
    first = read_model(tmp_path / "first")
    assert not all(torch.equal(first[n], second[n]) for n in second)
    assert "--no-threshold-cache" in CliRunner().invoke(main, ["merge", "--help"]).output


# -- pulls: the same validation after download ------------------------------------------------


def stranger_repo(fake, repo: str, folder: Path) -> None:
    """A repo on the fake Hub holding exactly ``folder``'s files (a stranger's upload, no push checks)."""
    fake.branches[repo] = {}
    fake.new_commit(repo, "main", {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}, "upload")


def pull(kind: str, repo: str, *extra: str):
    result = CliRunner().invoke(main, [kind, "pull", repo, *map(str, extra), "-q"], input="")
    return result


def refused(result) -> str:
    assert result.exit_code == 2, (result.output, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output + result.stderr
    return lines[0]


PULL_CASES = {
    "fisher: diagonal stored F16": ("fisher", FISHER_CASES["diagonal stored F16"], "all"),
    "fisher: diagonal NaN": ("fisher", FISHER_CASES["diagonal NaN"], "all"),
    "fisher: shard truncated": ("fisher", FISHER_CASES["shard truncated"], "all"),
    "fisher: overlapping offsets": ("fisher", FISHER_CASES["shard with overlapping offsets"], "all"),
    "fisher: tensor missing from its shard": ("fisher", FISHER_CASES["tensor missing from its shard"], "all"),
    "fisher: manifest without entries": ("fisher", FISHER_CASES["manifest without entries"], "manifest"),
    "fisher: unknown factor key": ("fisher", FISHER_CASES["unknown factor key"], "manifest"),
    "fisher: manifest nested 200k deep": ("fisher", FISHER_CASES["manifest nested 200k deep"], "manifest"),
    "delta: stored F16, manifest float32": ("delta", DELTA_CASES["stored F16, manifest float32"], "all"),
    "delta: NaN": ("delta", DELTA_CASES["NaN in a delta (merge kernel)"], "all"),
    "delta: manifest without weight": ("delta", DELTA_CASES["manifest without weight"], "index"),
}


@pytest.mark.parametrize("name", sorted(PULL_CASES))
def test_a_pull_validates_what_it_fetched(hub, tmp_path, pristine, name):
    kind, case, fetched = PULL_CASES[name]
    local = tmp_path / "local"
    shutil.copytree(pristine["fisher" if kind == "fisher" else "delta"], local)
    named = case.corrupt(local)
    stranger_repo(hub, "acme/hostile", local)
    out = tmp_path / "pulled"
    line = refused(pull(kind, "acme/hostile", "-o", out))
    assert case.expected in line, line
    shown = named.name if named.is_absolute() else str(named)  # a path in the pull is repo@commit/NAME
    assert shown in line or named == local, line
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".pulled")]
    if fetched == "manifest":  # refused before any shard was fetched
        assert hub.downloads == ["fisher_manifest.json"]
    elif fetched == "index":
        assert not any(d.endswith(".safetensors") for d in hub.downloads)


def test_a_pull_into_the_hf_cache_is_refused_and_left_incomplete(hub, tmp_path, pristine, tied_models):
    local = tmp_path / "local"
    shutil.copytree(pristine["fisher"], local)
    FISHER_CASES["diagonal NaN"].corrupt(local)
    stranger_repo(hub, "acme/nan-cache", local)
    assert "contains NaN or Inf" in refused(pull("fisher", "acme/nan-cache"))
    snapshot = hub.cache / "models--acme--nan-cache" / "snapshots" / hub.branches["acme/nan-cache"]["main"]
    assert not (snapshot / "fisher_manifest.json").exists()  # not a complete copy: nothing resolves to it


def test_a_good_pull_passes_and_an_adversarial_basis_is_caught_at_merge(hub, tmp_path, pristine, tied_models):
    """Pulls check headers, manifest, dtypes, shapes and finite values; orthonormality is checked when read."""
    assert pull("fisher", "acme/good", "-o", tmp_path / "x").exit_code != 0  # no such repo yet
    stranger_repo(hub, "acme/good", pristine["fisher"])
    assert pull("fisher", "acme/good", "-o", tmp_path / "good").exit_code == 0
    assert tree_digest(tmp_path / "good") == tree_digest(pristine["fisher"])
    local = tmp_path / "local"
    shutil.copytree(pristine["fisher"], local)
    CASES["fisher: adversarial eigenvectors V(I + 50 e1 wT)"].corrupt(local)
    stranger_repo(hub, "acme/adversarial", local)
    assert pull("fisher", "acme/adversarial", "-o", tmp_path / "adv").exit_code == 0
    m = tied_models
    config = tmp_path / "graft.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1)], rho=0.1, fisher=tmp_path / "adv"))
    assert "are not orthonormal" in error_line(run_cli("mergekit-yaml", str(config), str(tmp_path / "out")))
