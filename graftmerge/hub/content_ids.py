"""What the Hub says a file is (a git blob id, or an LFS sha256), checked against the bytes.

Push compares local files with the remote listing's ids (:func:`same_as_remote`), so a
re-run uploads only what differs. Pull checks the Hub's own answers: a HEAD answer's ETag
must be a content id and ``X-Repo-Commit`` the commit asked for before huggingface_hub
turns them into paths (:func:`checked_hub_answers`), and a fetched blob must hash to its
name (:func:`check_blob_content`).
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2
from huggingface_hub import get_session

from graftmerge.errors import GraftError
from graftmerge.formats.file_hash import file_sha256

# An ETag the Hub may send for a file: its git blob id or (LFS) sha256, optionally weak and quoted. The
# client names the blob it writes after it (``blobs/<etag>``): nothing else may reach that path.
HUB_ETAG = re.compile(r'^(?:W/)?"?(?P<hash>[0-9a-f]{40}|[0-9a-f]{64})"?$')
ETAG_HEADERS = ("ETag", "X-Linked-Etag")


def git_blob_id(data: bytes) -> str:
    """The git object id the Hub reports for a regular (non-LFS) file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()



def same_as_remote(remote: Any, local: Path | bytes) -> bool:
    """Whether a remote ``RepoFile`` holds exactly ``local`` (a file, or bytes): size, then content id."""
    size = len(local) if isinstance(local, bytes) else local.stat().st_size
    if remote is None or remote.size != size:
        return False
    if remote.lfs is not None:
        sha256 = hashlib.sha256(local).hexdigest() if isinstance(local, bytes) else file_sha256(local)
        return remote.lfs.sha256 == sha256
    data = local if isinstance(local, bytes) else local.read_bytes()
    return remote.blob_id == git_blob_id(data)


@contextmanager
def checked_hub_answers(commit: str, where: str) -> Iterator[None]:
    """While a file of ``commit`` is fetched in this thread, every HEAD answer is checked before
    huggingface_hub reads it: an ETag must be a content hash, ``X-Repo-Commit`` the commit asked for.

    huggingface_hub writes ``blobs/<ETag>`` and ``snapshots/<X-Repo-Commit>/…`` as the server
    says; an ETag ``"/home/you/.bashrc"`` or ``"../../x"`` would be a write outside the cache (a
    staging folder would not contain it: an absolute or deep ``..`` name leaves any folder). So the
    very response the client uses is checked, by a hook on its shared session, before the client
    computes a path; the hook is removed afterwards and ignores other threads' requests.
    """
    thread = threading.get_ident()

    def check(response: httpx2.Response) -> None:
        """Refuse a HEAD answer whose names would become paths, before huggingface_hub reads it."""
        if threading.get_ident() != thread or response.request.method != "HEAD":
            return
        for header in ETAG_HEADERS:
            value = response.headers.get(header)
            if value is not None and not HUB_ETAG.fullmatch(value):
                raise GraftError(f"{where}: the Hub's {header} {value[:80]!r} for {response.request.url.path} is "
                                 "not a content hash (a hostile or broken server); nothing was written")
        served = response.headers.get("X-Repo-Commit")
        if served is not None and served != commit:
            raise GraftError(f"{where}: the Hub answered commit {served[:80]!r} for a file of commit {commit} (a "
                             "hostile or broken server); nothing was written")

    hooks = get_session().event_hooks["response"]
    hooks.append(check)
    try:
        yield
    finally:
        hooks.remove(check)


def check_blob_content(blob: Path, where: str, name: str) -> None:
    """A blob fetched into the cache holds what its name (the Hub's ETag: sha256 or git blob id) says.

    The bytes may come from wherever the Hub's ``Location`` sent the client; the ETag is the
    Hub's own word for them. A mismatch removes the blob (the next pull fetches it again).
    """
    found = HUB_ETAG.fullmatch(blob.name)
    if found is None:
        return  # a plain file of the snapshot (a stripped config), not a blob
    actual = file_sha256(blob) if len(blob.name) == 64 else file_git_blob_id(blob)
    if actual != blob.name:
        blob.unlink()
        raise GraftError(f"{where}: {name} as fetched does not match the Hub's hash for it ({blob.name[:12]}…, got "
                         f"{actual[:12]}…); it was removed, pull again")


def file_git_blob_id(path: Path, block_bytes: int = 1 << 24) -> str:
    """:func:`git_blob_id` of a file, read a block at a time."""
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(block_bytes), b""):
            digest.update(block)
    return digest.hexdigest()
