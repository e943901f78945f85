"""Lazy, validated access to a folder of safetensors shards.

Only headers are read up front (so a config can be checked before any tensor is
loaded); tensors are read one at a time through safetensors' memory map.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import safe_open

from graftmerge.errors import GraftError
from graftmerge.formats.json_file import (
    TOO_LONG_INTEGER,
    DuplicateKeyError,
    load_json_file,
    refuse_duplicate_keys,
)

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
INDEX_NAME = "model.safetensors.index.json"
SAMPLE_BYTES = 4096  # per window of a sampled fingerprint; three windows (start, middle, end) per tensor


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


@dataclass(frozen=True)
class SafetensorsLayout:
    """One shard's header, checked: its tensors, where their bytes lie, and the header's own sha256."""

    file: Path
    data_start: int  # 8 + header length: where the data section begins
    header_sha256: str
    tensors: dict[str, TensorInfo]
    offsets: dict[str, tuple[int, int]]  # [begin, end) of each tensor within the data section
    identity: FileIdentity | None = None  # the file as its header was read (``file_identity``)


FileIdentity = tuple[int, int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns


def file_identity(info: os.stat_result) -> FileIdentity:
    """What pins a file's bytes: device, inode, size, mtime and ctime.

    The kernel sets ctime on every change to a file and user space cannot set it back
    (``os.utime`` restores mtime only), so an in-place rewrite changes ctime and a file
    replaced by rename has another inode: while all five agree, the bytes are the same.
    """
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _identity_change(before: FileIdentity, after: FileIdentity) -> str:
    """How a pinned file changed, in words."""
    if before[:2] != after[:2]:
        return "replaced by another file"
    if before[2] != after[2]:
        return f"size {before[2]} → {after[2]} bytes"
    return "rewritten in place" + (" (modification time put back)" if before[3] == after[3] else "")


def check_unchanged(pinned: dict[Path, FileIdentity]) -> None:
    """GraftError naming the first file of ``pinned`` that is gone or no longer has its pinned identity."""
    for file, before in sorted(pinned.items()):
        try:
            after = file_identity(os.stat(file))
        except OSError as error:
            raise GraftError(f"{file} was removed or became unreadable while the merge read it ({error.strerror}); "
                             "run again") from error
        if after != before:
            raise GraftError(f"{file} changed while the merge read it ({_identity_change(before, after)}); "
                             "run again")


def read_safetensors_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and check one shard's header against its size; raise GraftError if corrupt."""
    return read_safetensors_layout(file).tensors


def read_safetensors_layout(file: Path) -> SafetensorsLayout:
    """The one strict safetensors header parser every format uses; GraftError naming the file (and tensor).

    Checks: header length within the file and at most 100 MiB; a JSON object without
    duplicate keys; ``__metadata__`` a str → str map; each entry exactly ``dtype``,
    ``shape``, ``data_offsets``, a known dtype, integer (not bool or float) non-negative
    dims and offsets matching the shape; offsets sorted, contiguous from 0, never
    overlapping, covering the data section exactly to the end of the file.
    """
    raw, info = _header_bytes(file)
    size = info.st_size
    header = _header_json(raw, file)
    tensors: dict[str, TensorInfo] = {}
    offsets: dict[str, tuple[int, int]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            _check_metadata(entry, file)
            continue
        tensors[name], offsets[name] = _header_entry(file, name, entry)
    _check_data_layout(file, offsets, size - 8 - len(raw))
    return SafetensorsLayout(file=file, data_start=8 + len(raw), header_sha256=hashlib.sha256(raw).hexdigest(),
                             tensors=tensors, offsets=offsets, identity=file_identity(info))


def _header_bytes(file: Path) -> tuple[bytes, os.stat_result]:
    """(the header's JSON bytes, the opened file's stat); GraftError for a short file or an absurd length."""
    try:
        with open(file, "rb") as handle:
            info = os.fstat(handle.fileno())
            size = info.st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise GraftError(f"{file}: not a safetensors file (only {size} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(_MAX_HEADER_BYTES, size - 8):
                raise GraftError(
                    f"{file}: corrupt or truncated safetensors header "
                    f"(header claims {header_len} bytes, file has {size})"
                )
            return handle.read(header_len), info
    except OSError as error:
        raise GraftError(f"{file}: cannot read ({error.strerror})") from error


def _header_json(raw: bytes, file: Path) -> dict[str, Any]:
    """The header as a JSON object; GraftError if it is not JSON, nested absurdly, not an object, or repeats a key."""
    try:
        header = json.loads(raw, object_pairs_hook=refuse_duplicate_keys)
    except DuplicateKeyError as error:
        raise GraftError(f"{file}: corrupt safetensors header (key {error.args[0]!r} appears twice)") from error
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise GraftError(f"{file}: corrupt safetensors header (not JSON)") from error
    except RecursionError as error:
        raise GraftError(f"{file}: corrupt safetensors header (nested too deeply)") from error
    except ValueError as error:  # json's int(): an integer past Python's int/str conversion limit
        raise GraftError(f"{file}: corrupt safetensors header ({TOO_LONG_INTEGER})") from error
    except MemoryError as error:
        raise GraftError(f"{file}: corrupt safetensors header (too large to parse in memory)") from error
    if not isinstance(header, dict):
        raise GraftError(f"{file}: corrupt safetensors header (not a JSON object)")
    return header


def _check_metadata(metadata: Any, file: Path) -> None:
    """``__metadata__`` is a map of strings to strings (the safetensors format says so)."""
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise GraftError(f"{file}: corrupt safetensors header (__metadata__ is not a map of strings to strings)")


def _is_count(value: Any) -> bool:
    """A non-negative JSON integer (``true`` and ``1.0`` are not)."""
    return type(value) is int and value >= 0


def _header_entry(file: Path, name: str, entry: Any) -> tuple[TensorInfo, tuple[int, int]]:
    """One tensor's header entry, checked: (its TensorInfo, its [begin, end) in the data section)."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise GraftError(f"{file}: corrupt header entry for tensor {name!r} (needs exactly dtype, shape, data_offsets)")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise GraftError(f"{file}: tensor {name!r} has unsupported dtype {dtype}")
    if not isinstance(shape, list) or not all(_is_count(dim) for dim in shape):
        raise GraftError(f"{file}: corrupt header entry for tensor {name!r} (shape {shape!r} is not a list of "
                         "non-negative integers)")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise GraftError(f"{file}: corrupt header entry for tensor {name!r} (data_offsets {offsets!r} are not two "
                         "non-negative integers)")
    begin, end = offsets
    if end < begin or end - begin != math.prod(shape) * SAFETENSORS_DTYPES[dtype][1]:
        raise GraftError(f"{file}: corrupt header: tensor {name!r} offsets do not match its shape")
    return TensorInfo(name=name, shape=tuple(shape), dtype=dtype, file=file), (begin, end)


def _check_data_layout(file: Path, offsets: dict[str, tuple[int, int]], data_size: int) -> None:
    """Tensors tile the data section: sorted, from 0, no gap, no overlap, up to the end of the file."""
    position = 0
    for name, (begin, end) in sorted(offsets.items(), key=lambda item: item[1]):
        if begin != position:
            problem = "overlaps the tensor before it" if begin < position else "leaves a gap before it"
            raise GraftError(f"{file}: corrupt header: tensor {name!r} at bytes {begin}-{end} {problem} "
                             "(tensors must tile the data section)")
        position = end
    if position != data_size:
        raise GraftError(
            f"{file}: truncated or corrupt safetensors file "
            f"(header describes {position} bytes of data, the file holds {data_size})"
        )


def tensor_windows(handle: BinaryIO, start: int, size: int) -> bytes:
    """Three ``SAMPLE_BYTES`` windows (start, middle, end) of the ``size`` bytes at ``start`` of an open file.

    What sampled fingerprints hash: a few reads per tensor, whatever its size.
    """
    parts = []
    for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
        handle.seek(start + offset)
        parts.append(handle.read(min(SAMPLE_BYTES, size - offset)))
    return b"".join(parts)


def shard_sample_digest(layout: SafetensorsLayout) -> str:
    """sha256 of a shard's header and three windows of every tensor's bytes: a cheap content identity.

    Catches any edit of the header and any edit inside a sampled window; an in-place
    edit elsewhere in a large tensor goes unseen (it is sampled, not a full hash).
    """
    digest = hashlib.sha256(layout.header_sha256.encode())
    with open(layout.file, "rb") as handle:
        for begin, end in sorted(layout.offsets.values()):
            window = tensor_windows(handle, layout.data_start + begin, end - begin)
            digest.update(len(window).to_bytes(8, "little"))
            digest.update(window)
    return digest.hexdigest()


def _stat_identity(file: Path) -> FileIdentity | None:
    """``file_identity`` of ``file`` now, None when there is no such file."""
    try:
        return file_identity(os.stat(file))
    except OSError:
        return None


class TensorSource:
    """What a graft reads from each input: tensor infos by name, and one tensor at a time."""

    label: str
    tensors: dict[str, TensorInfo]

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """One tensor (or its rows ``[start, stop)``), as stored; subclasses implement it."""
        raise NotImplementedError

    def pinned(self) -> dict[Path, FileIdentity]:
        """Every file this source reads, with its identity when it was opened (none for tensors in memory)."""
        return {}

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
        self.layouts: dict[Path, SafetensorsLayout] = {}  # every shard's checked header
        self._index_identity = _stat_identity(self.folder / INDEX_NAME)
        weight_map = self._weight_map()
        files = (
            sorted({self.folder / f for f in weight_map.values()}) if weight_map is not None else self._glob_shards()
        )
        for file in files:
            self.layouts[file] = read_safetensors_layout(file)
            for name, info in self.layouts[file].tensors.items():
                if name in self.tensors:
                    raise GraftError(
                        f"{self.label}: tensor {name!r} appears in two shards ({self.tensors[name].file.name}, "
                        f"{file.name})"
                    )
                self.tensors[name] = info
        if weight_map is not None:
            self._check_index(weight_map)

    def _weight_map(self) -> dict[str, str] | None:
        """The shard index's ``weight_map`` (tensor → shard file), checked; None when there is no index."""
        index = self.folder / INDEX_NAME
        if not index.exists():
            return None
        content = load_json_file(index, "shard index")
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise GraftError(f"{index}: corrupt shard index (no `weight_map` of tensor names to shard files)")
        for shard in sorted(set(weight_map.values())):
            parts = shard.split("/")
            if not shard.endswith(".safetensors") or "\\" in shard or any(p in ("", ".", "..") for p in parts) or any(
                    ord(c) < 32 for c in shard):
                raise GraftError(f"{index}: corrupt shard index (shard name {shard!r} is not a .safetensors file "
                                 "inside the folder)")
        missing = sorted(f for f in set(weight_map.values()) if not (self.folder / f).is_file())
        if missing:
            raise GraftError(f"{index}: lists missing shard(s) {', '.join(missing)}")
        return weight_map

    def _glob_shards(self) -> list[Path]:
        """Every ``*.safetensors`` of an unindexed folder; GraftError when there is none."""
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise GraftError(
                f"{self.label}: no .safetensors files in {self.folder} "
                "(graftmerge reads safetensors only; re-save the model with safe_serialization=True)"
            )
        return files

    def _check_index(self, weight_map: dict[str, str]) -> None:
        """The index names exactly the shards' tensors, each in the shard that holds it (mergekit reads by the index)."""
        index = self.folder / INDEX_NAME
        for name, shard in sorted(weight_map.items()):
            if name not in self.tensors or self.tensors[name].file != self.folder / shard:
                raise GraftError(f"{index}: lists tensor {name!r} in {shard}, which does not hold it")
        unlisted = sorted(set(self.tensors) - set(weight_map))
        if unlisted:
            raise GraftError(f"{index}: does not list tensor {unlisted[0]!r} of {self.tensors[unlisted[0]].file.name}")

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """One tensor (or its rows ``start:stop``), loaded now, in its stored dtype."""
        # Opened per read: a mapping kept open would keep every page read so far
        # resident (and counted in RSS) for the rest of the merge.
        with safe_open(str(self.tensors[name].file), framework="pt") as handle:
            if rows is None:
                return handle.get_tensor(name)
            return handle.get_slice(name)[rows[0] : rows[1]]

    def pinned(self) -> dict[Path, FileIdentity]:
        """Every shard (and the shard index), with its identity when its header was read."""
        pinned = {file: layout.identity for file, layout in self.layouts.items()}
        if self._index_identity is not None:
            pinned[self.folder / INDEX_NAME] = self._index_identity
        return pinned

    def file_stamps(self) -> list[tuple[str, int, int]]:
        """(path, size, mtime_ns) of every shard: cheap identity for result caches."""
        stamps = []
        for file in sorted({info.file for info in self.tensors.values()}):
            stat = file.stat()
            stamps.append((str(file.resolve()), stat.st_size, stat.st_mtime_ns))
        return stamps

    def content_stamps(self) -> list[tuple[str, int, int, str]]:
        """(path, size, mtime_ns, sampled digest of header and content) of every shard: a result cache's key.

        See :func:`shard_sample_digest` for what the digest sees (and what it cannot).
        """
        stamps = []
        for file, layout in sorted(self.layouts.items()):
            stat = file.stat()
            stamps.append((str(file.resolve()), stat.st_size, stat.st_mtime_ns, shard_sample_digest(layout)))
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
                parts.append(
                    f"missing from {other.label}: {', '.join(only_post[:5])}" + (" ..." if len(only_post) > 5 else "")
                )
            if only_other:
                parts.append(
                    f"only in {other.label}: {', '.join(only_other[:5])}" + (" ..." if len(only_other) > 5 else "")
                )
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
