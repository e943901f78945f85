"""Lazy, validated access to a folder of safetensors shards.

Only headers are read up front (so a config can be checked before any tensor is
loaded); tensors are read one at a time through safetensors' memory map.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from graftmerge.errors import GraftError

SAFETENSORS_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
}
SAFETENSORS_NAMES: dict[torch.dtype, str] = {dtype: name for name, (dtype, _) in SAFETENSORS_DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a header describes it: name, shape, dtype and the shard holding it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors spelling, e.g. "BF16"
    file: Path | None  # None for a tensor held in memory

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of the stored tensor."""
        return SAFETENSORS_DTYPES[self.dtype][0]

    @property
    def is_floating(self) -> bool:
        """Whether the tensor has a floating dtype (only those carry a delta)."""
        return self.torch_dtype.is_floating_point

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


def read_safetensors_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and check one shard's header against its size; raise GraftError if corrupt."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise GraftError(f"{file}: not a safetensors file (only {size} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(_MAX_HEADER_BYTES, size - 8):
                raise GraftError(
                    f"{file}: corrupt or truncated safetensors header "
                    f"(header claims {header_len} bytes, file has {size})"
                )
            header = json.loads(handle.read(header_len))
    except OSError as error:
        raise GraftError(f"{file}: cannot read ({error.strerror})") from error
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise GraftError(f"{file}: corrupt safetensors header (not JSON)") from error
    if not isinstance(header, dict):
        raise GraftError(f"{file}: corrupt safetensors header (not a JSON object)")
    tensors: dict[str, TensorInfo] = {}
    data_end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as error:
            raise GraftError(f"{file}: corrupt header entry for tensor {name!r}") from error
        if dtype not in SAFETENSORS_DTYPES:
            raise GraftError(f"{file}: tensor {name!r} has unsupported dtype {dtype}")
        itemsize = SAFETENSORS_DTYPES[dtype][1]
        if end - begin != math.prod(shape) * itemsize or begin < 0:
            raise GraftError(f"{file}: corrupt header: tensor {name!r} offsets do not match its shape")
        data_end = max(data_end, end)
        tensors[name] = TensorInfo(name=name, shape=shape, dtype=dtype, file=file)
    if 8 + header_len + data_end != size:
        raise GraftError(
            f"{file}: truncated or corrupt safetensors file "
            f"(header describes {8 + header_len + data_end} bytes, file has {size})"
        )
    return tensors


class TensorSource:
    """What a graft reads from each input: tensor infos by name, and one tensor at a time."""

    label: str
    tensors: dict[str, TensorInfo]

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """One tensor (or its rows ``[start, stop)``), as stored; subclasses implement it."""
        raise NotImplementedError

    def fingerprint(self) -> dict[str, dict]:
        """Names, shapes and dtypes: what a Fisher cache must match."""
        return {
            name: {"shape": list(info.shape), "dtype": info.dtype}
            for name, info in sorted(self.tensors.items())
        }


class Checkpoint(TensorSource):
    """A model folder's tensors by name; headers validated, data read lazily."""

    def __init__(self, folder: str | os.PathLike, label: str | None = None):
        self.folder = Path(folder)
        self.label = label or str(folder)
        if not self.folder.is_dir():
            raise GraftError(f"{self.label}: model folder {self.folder} does not exist")
        self.tensors: dict[str, TensorInfo] = {}
        for file in self._shard_files():
            for name, info in read_safetensors_header(file).items():
                if name in self.tensors:
                    raise GraftError(f"{self.label}: tensor {name!r} appears in two shards")
                self.tensors[name] = info

    def _shard_files(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise GraftError(f"{index}: corrupt shard index") from error
            files = sorted({self.folder / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise GraftError(f"{index}: lists missing shard(s) {', '.join(missing)}")
            return files
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise GraftError(
                f"{self.label}: no .safetensors files in {self.folder} "
                "(graftmerge reads safetensors only; re-save the model with safe_serialization=True)"
            )
        return files

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """One tensor (or its rows ``start:stop``), loaded now, in its stored dtype."""
        # Opened per read: a mapping kept open would keep every page read so far
        # resident (and counted in RSS) for the rest of the merge.
        with safe_open(str(self.tensors[name].file), framework="pt") as handle:
            if rows is None:
                return handle.get_tensor(name)
            return handle.get_slice(name)[rows[0] : rows[1]]

    def file_stamps(self) -> list[tuple[str, int, int]]:
        """(path, size, mtime_ns) of every shard: cheap identity for result caches."""
        stamps = []
        for file in sorted({info.file for info in self.tensors.values()}):
            stat = file.stat()
            stamps.append((str(file.resolve()), stat.st_size, stat.st_mtime_ns))
        return stamps


class InMemoryCheckpoint(TensorSource):
    """Tensors already in memory (mergekit's state-dict API), read in a fixed working dtype.

    Reads return contiguous tensors, so strided inputs (e.g. transposed views) rank
    and mask exactly like their contiguous copies.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype], label: str):
        self.label = label
        self._tensors = tensors
        self._dtypes = dtypes
        self.tensors = {
            name: TensorInfo(name=name, shape=tuple(t.shape), dtype=SAFETENSORS_NAMES[dtypes[name]], file=None)
            for name, t in tensors.items()
        }

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """One tensor (or its rows ``[start, stop)``), cast to its recorded dtype, contiguous."""
        tensor = self._tensors[name]
        if rows is not None:
            tensor = tensor[rows[0] : rows[1]]
        return tensor.to(self._dtypes[name]).contiguous()


def check_same_tensors(post: Checkpoint, others: list[Checkpoint]) -> None:
    """Every checkpoint in ``others`` has exactly ``post``'s tensor names and shapes."""
    for other in others:
        only_post = sorted(set(post.tensors) - set(other.tensors))
        only_other = sorted(set(other.tensors) - set(post.tensors))
        if only_post or only_other:
            parts = []
            if only_post:
                parts.append(f"missing from {other.label}: {', '.join(only_post[:5])}" + (" ..." if len(only_post) > 5 else ""))
            if only_other:
                parts.append(f"only in {other.label}: {', '.join(only_other[:5])}" + (" ..." if len(only_other) > 5 else ""))
            raise GraftError(f"tensors differ between {post.label} and {other.label} ({'; '.join(parts)})")
        for name, info in post.tensors.items():
            theirs = other.tensors[name]
            if theirs.shape != info.shape:
                raise GraftError(
                    f"shape mismatch for {name}: {info.shape} in {post.label}, {theirs.shape} in {other.label}"
                )


def hf_cache_origin(folder: Path) -> tuple[str | None, str | None]:
    """(repo id, revision) when ``folder`` is a snapshot inside the HF cache."""
    match = re.search(r"models--([^/]+?)--([^/]+)/snapshots/([0-9a-f]{7,64})/?$", str(folder.resolve()))
    if not match:
        return None, None
    return f"{match.group(1)}/{match.group(2)}", match.group(3)
