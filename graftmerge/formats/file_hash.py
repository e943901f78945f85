"""sha256 of a file, read in blocks: identity of rollout files and of Hub uploads."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: str | Path, block_bytes: int = 1 << 24) -> str:
    """Hex sha256 of the file's bytes, read ``block_bytes`` at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(block_bytes), b""):
            digest.update(block)
    return digest.hexdigest()
