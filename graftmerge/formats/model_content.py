"""What a model is, by content: the sha256 of every weight tensor's bytes, wherever its folder lies.

Two things need a model's identity and neither may trust its path: a Fisher cache must be
used with the model it was estimated on (the same weights copied elsewhere, or named by
their Hub id, are the same model; a fine-tune of the same shapes is not), and an estimate
checkpoint must resume only the model it was summing (a model saved over the same path is
another model).

:func:`weights_sha256` hashes each tensor's bytes, by name, dtype and shape, so resharding
or another header order changes nothing, while any changed byte of any tensor changes it.
Hub blob names are not trusted: every file is hashed once, and its tensors' digests are kept
in the user cache (:mod:`~graftmerge.formats.user_cache`, record names keyed by the user's
secret) under the file's identity (device, inode, size, mtime, ctime: the kernel sets ctime
on every change), so later runs on the same unchanged files skip the hashing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path

from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import Checkpoint, SafetensorsLayout, file_identity
from graftmerge.formats.file_hash import file_sha256
from graftmerge.formats.user_cache import read_record, record_name, write_record

TENSOR_DIGESTS = "tensor-sha256"  # the user cache's folder of per-file tensor digests
SETTLED_SECONDS = 2.0  # a file changed more recently than this is hashed again next time
BLOCK_BYTES = 1 << 24
HEX_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MODEL_FILES = ("config.json", "generation_config.json")  # besides the weights, what a model run reads


def _hash_tensors(layout: SafetensorsLayout) -> tuple[dict[str, str], os.stat_result]:
    """(sha256 of each tensor's bytes, the file's stat after the read); GraftError if it changed meanwhile."""
    digests = {}
    with open(layout.file, "rb") as handle:
        if layout.identity is not None and file_identity(os.fstat(handle.fileno())) != layout.identity:
            raise GraftError(f"{layout.file} changed since its header was read; run again")
        for name, (begin, end) in sorted(layout.offsets.items(), key=lambda item: item[1]):
            digest = hashlib.sha256()
            handle.seek(layout.data_start + begin)
            left = end - begin
            while left:
                block = handle.read(min(left, BLOCK_BYTES))
                if not block:
                    raise GraftError(f"{layout.file} is shorter than its header says; run again")
                digest.update(block)
                left -= len(block)
            digests[name] = digest.hexdigest()
        after = os.fstat(handle.fileno())
    if layout.identity is not None and file_identity(after) != layout.identity:
        raise GraftError(f"{layout.file} changed while it was hashed; run again")
    return digests, after


def _record_subject(layout: SafetensorsLayout, info: os.stat_result) -> str:
    """What a record of this file's digests is named by (keyed by the user's secret in ``record_name``)."""
    return f"graftmerge tensor digests v1 {file_identity(info)} {str(Path(layout.file).resolve())!r}"


def _recorded(layout: SafetensorsLayout) -> dict[str, str] | None:
    """The digests recorded for this very file (same identity now), checked; None when there are none."""
    try:
        info = os.stat(layout.file)
    except OSError:
        return None
    if layout.identity is not None and file_identity(info) != layout.identity:
        return None
    name = record_name(TENSOR_DIGESTS, _record_subject(layout, info))
    data = read_record(TENSOR_DIGESTS, name) if name is not None else None
    try:
        digests = json.loads(data) if data is not None else None
    except ValueError:
        return None
    if (not isinstance(digests, dict) or set(digests) != set(layout.offsets)
            or not all(isinstance(v, str) and HEX_SHA256.match(v) for v in digests.values())):
        return None
    return digests


def tensor_sha256s(layout: SafetensorsLayout) -> dict[str, str]:
    """sha256 of each tensor's bytes in one shard: from the user cache when this unchanged file was hashed
    before, else hashed now (and recorded once the file has settled)."""
    digests = _recorded(layout)
    if digests is not None:
        return digests
    digests, after = _hash_tensors(layout)
    if time.time_ns() - after.st_ctime_ns >= SETTLED_SECONDS * 1e9:
        name = record_name(TENSOR_DIGESTS, _record_subject(layout, after))
        if name is not None:
            write_record(TENSOR_DIGESTS, name, json.dumps(digests, sort_keys=True).encode())
    return digests


def weights_sha256(checkpoint: Checkpoint) -> str:
    """One sha256 of every tensor of the model: name, dtype, shape and the sha256 of its bytes.

    The same for the same tensors whatever the folder, the shard layout or the header
    order; a cast copy (bf16 of an fp32 model) has other bytes, so another digest.
    """
    digest = hashlib.sha256(b"graftmerge weights v1\n")
    found: dict[str, str] = {}
    for layout in checkpoint.layouts.values():
        found.update(tensor_sha256s(layout))
    for name in sorted(found):
        info = checkpoint.tensors[name]
        digest.update(f"{name}\0{info.dtype}\0{list(info.shape)}\0{found[name]}\n".encode())
    return digest.hexdigest()


def model_fingerprint(folder: str | os.PathLike, label: str = "model") -> str:
    """sha256 of what a run on the model folder computes with: its weights (:func:`weights_sha256`), the files
    that configure them (``config.json``, ``generation_config.json``) and its own code (``*.py``, run with
    ``trust_remote_code``), byte for byte."""
    checkpoint = Checkpoint(folder, label=label)
    digest = hashlib.sha256(f"graftmerge model v1\nweights {weights_sha256(checkpoint)}\n".encode())
    code = sorted(file.name for file in Path(folder).glob("*.py"))
    for name in (*MODEL_FILES, *code):
        file = Path(folder) / name
        digest.update(f"{name} {file_sha256(file) if file.is_file() else None}\n".encode())
    return digest.hexdigest()
