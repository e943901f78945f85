"""``graftmerge delta extract``: write Δ = weight·(θft − θdonor) as a shareable folder.

Streams one tensor at a time (at most one output shard is held in memory) and
writes into a hidden staging folder next to the output, manifest last, then
renames it into place (:mod:`graftmerge.formats.output_folder`, under a lock): an
interrupted extract leaves no folder that looks like a delta.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from graftmerge import __version__
from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import SAFETENSORS_DTYPES, Checkpoint, check_same_tensors
from graftmerge.formats.delta_folder import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_NAME,
    MANIFEST_NAME,
    source_record,
)
from graftmerge.formats.output_folder import NEW, OutputFolder
from graftmerge.hub.untrusted import read_json_bytes, without_remote_code
from graftmerge.math.donor_delta import donor_delta

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_SHARD_BYTES = 2 * 10**9
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str | int) -> int:
    """``"2GB"`` → 2·10⁹ bytes (K/M/G are powers of 1000, KiB/MiB/GiB of 1024, as in HF's max_shard_size)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).upper() not in _UNITS:
        raise GraftError(f"shard size {text!r} is not a size like 500MB, 2GB or 1GiB")
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size <= 0:
        raise GraftError(f"shard size must be positive, got {text!r}")
    return size


def plan_shards(sizes: dict[str, int], shard_bytes: int) -> list[list[str]]:
    """Tensors in name order, packed greedily into shards of at most ``shard_bytes`` (a bigger tensor gets its own)."""
    shards: list[list[str]] = []
    filled = 0
    for name in sorted(sizes):
        if not shards or (filled + sizes[name] > shard_bytes and filled > 0):
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += sizes[name]
    return shards


def extract_delta(
    donor: str | os.PathLike,
    donor_ft: str | os.PathLike,
    output: str | os.PathLike,
    *,
    weight: float = 1.0,
    dtype: str = "float32",
    shard_bytes: int | str | None = None,
    progress: bool = True,
) -> Path:
    """Write the delta folder ``output`` (which must not exist); return its path.

    ``shard_bytes``: largest shard (``"500MB"`` or bytes); default ``DEFAULT_SHARD_BYTES``.
    """
    output = Path(output)
    shard_bytes = _checked_options(output, weight, dtype, shard_bytes)
    donor_checkpoint, ft_checkpoint = _open_checkpoints(donor, donor_ft)
    manifest = _manifest(donor_checkpoint, ft_checkpoint, weight, dtype)
    itemsize = SAFETENSORS_DTYPES["F32" if dtype == "float32" else "BF16"][1]
    shards = plan_shards({n: i.numel * itemsize for n, i in donor_checkpoint.tensors.items()}, shard_bytes)
    folder = OutputFolder(output, replace=NEW, hint="choose a new folder (extract never overwrites)").open()
    staging = folder.staging
    try:
        weight_map, total = _write_shards(donor_checkpoint, ft_checkpoint, shards, staging, weight,
                                          DTYPES[dtype], progress)
        (staging / INDEX_NAME).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
        )
        if (donor_checkpoint.folder / "config.json").exists():
            _copy_config(donor_checkpoint.folder / "config.json", staging / "config.json")
        (staging / (MANIFEST_NAME + ".tmp")).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(staging / (MANIFEST_NAME + ".tmp"), staging / MANIFEST_NAME)
        _make_shareable(staging)
        folder.publish()
    finally:
        folder.close()
    return output


def _checked_options(output: Path, weight: float, dtype: str, shard_bytes: int | str | None) -> int:
    """GraftError for a bad option (existing output, weight, dtype, shard size); the shard size in bytes."""
    if output.exists():
        raise GraftError(f"output {output} already exists; choose a new folder (extract never overwrites)")
    if not math.isfinite(weight):
        raise GraftError(f"--weight must be a finite number, got {weight}")
    if dtype not in DTYPES:
        raise GraftError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return parse_size(DEFAULT_SHARD_BYTES if shard_bytes is None else shard_bytes)


def _open_checkpoints(donor: str | os.PathLike, donor_ft: str | os.PathLike) -> tuple[Checkpoint, Checkpoint]:
    """The two checkpoints (headers only); GraftError if they are one folder or hold different tensors."""
    donor_checkpoint = Checkpoint(donor, label=f"donor {donor}")
    ft_checkpoint = Checkpoint(donor_ft, label=f"donor_ft {donor_ft}")
    if donor_checkpoint.folder.resolve() == ft_checkpoint.folder.resolve():
        raise GraftError(f"DONOR and DONOR_FT are the same folder ({donor}); the delta would be zero")
    check_same_tensors(donor_checkpoint, [ft_checkpoint])
    return donor_checkpoint, ft_checkpoint


def _manifest(donor: Checkpoint, donor_ft: Checkpoint, weight: float, dtype: str) -> dict:
    """The delta folder's manifest: format, formula, weight, dtype and both sources' identities."""
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "graftmerge_version": __version__,
        "formula": "weight * (donor_ft - donor)",
        "weight": weight,
        "dtype": dtype,
        "donor": source_record(donor),
        "donor_ft": source_record(donor_ft),
        "non_floating_zeroed": sorted(n for n, i in donor.tensors.items() if not i.is_floating),
    }


def _write_shards(donor: Checkpoint, donor_ft: Checkpoint, shards: list[list[str]], staging: Path,
                  weight: float, target: torch.dtype, progress: bool) -> tuple[dict[str, str], int]:
    """Write each shard's deltas (one shard in memory at a time); (tensor → shard file, total bytes)."""
    weight_map: dict[str, str] = {}
    total = 0
    bar = tqdm(total=len(donor.tensors), desc="delta extract", unit="tensor", disable=not progress)
    for number, names in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            tensors[name] = _delta_tensor(donor, donor_ft, name, weight).to(target).contiguous()
            total += tensors[name].numel() * tensors[name].element_size()
            weight_map[name] = file
            bar.update()
        save_file(tensors, str(staging / file), metadata={"format": "pt", "graftmerge": "delta"})
        del tensors
    bar.close()
    return weight_map, total


def _copy_config(source: Path, target: Path) -> None:
    """The donor's config.json without the fields that name code to run (``auto_map``, ``custom_pipelines``).

    A delta is for sharing, and mergekit loads its config like any input's: it must never
    make ``--trust-remote-code`` run code. (It carries no code files anyway.)
    """
    where = f"donor config {source}"
    target.write_bytes(without_remote_code(read_json_bytes(source, where), where)[0])


def _make_shareable(staging: Path) -> None:
    """Give the staged files and folder the umask's usual permissions: a delta is for sharing."""
    umask = os.umask(0)
    os.umask(umask)
    for file in staging.iterdir():  # safetensors writes shards owner-only; a delta is for sharing
        os.chmod(file, 0o666 & ~umask)
    os.chmod(staging, 0o777 & ~umask)


def _delta_tensor(donor: Checkpoint, donor_ft: Checkpoint, name: str, weight: float) -> torch.Tensor:
    """weight·(ft − donor) in float32 (float64 for float64 inputs): the graft kernel's own op order.

    Non-floating tensors (none in usual LLM checkpoints) carry no delta: zeros.
    """
    if not donor.tensors[name].is_floating:
        return torch.zeros(donor.tensors[name].shape, dtype=torch.float32)
    return donor_delta(donor.read(name), [donor_ft.read(name)], [weight])
