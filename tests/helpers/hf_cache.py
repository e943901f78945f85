"""A folder laid out as the Hugging Face cache keeps a download, for offline tests of Hub ids."""

from __future__ import annotations

import hashlib
from pathlib import Path


def place_in_hf_cache(cache: Path, repo_id: str, folder: Path) -> Path:
    """``folder``'s files as the cache holds ``repo_id``: blobs, refs/main, snapshots/<commit> of links; the
    snapshot."""
    storage = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir(exist_ok=True)
    for file in sorted(Path(folder).iterdir()):
        data = file.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(snapshot.name)
    return snapshot
