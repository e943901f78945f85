"""The Hugging Face cache layout, as huggingface_hub writes it: where a repo's snapshots and refs are.

``<cache>/models--org--name/refs/<revision>`` holds a commit sha; ``snapshots/<commit>/``
holds the files (links into ``blobs/``). Read here by hand, not through huggingface_hub,
so that a pull can tell a complete snapshot (its manifest is there, written last) from a
partial one, resolve ``org/name@rev`` offline, and check every folder on the way
(:func:`~graftmerge.hub.untrusted.check_cache_folder`: no planted link leads elsewhere).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from huggingface_hub import constants

from graftmerge.errors import GraftError
from graftmerge.hub.references import HubReference, check_revision, is_repo_id
from graftmerge.hub.untrusted import check_cache_folder, replace_file

COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
# A model snapshot folder in any Hugging Face cache: .../models--org--name/snapshots/<commit>
_SNAPSHOT = re.compile(r"(?:^|/)models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})/?$")


def storage_folder(cache_dir: Path, repo_id: str) -> Path:
    """The repo's folder in the cache layout (``models--org--name``), where refs and snapshots live."""
    return cache_dir / ("models--" + repo_id.replace("/", "--"))


def snapshot_origin(folder: str | os.PathLike) -> tuple[str, str] | None:
    """(repo id, commit) when ``folder``, links followed, is a model snapshot of a Hugging Face cache; else None.

    The inverse of :func:`storage_folder` plus ``snapshots/<commit>``: how a merge of cached
    checkpoints (``graftmerge merge`` hands mergekit their snapshot folders) names its inputs by Hub id.
    """
    match = _SNAPSHOT.search(os.path.realpath(os.fspath(folder)))
    if match is None:
        return None
    repo_id = f"{match['org']}/{match['name']}"
    return (repo_id, match["commit"]) if is_repo_id(repo_id) else None


def cache_folder(cache_dir: str | os.PathLike | None) -> Path:
    """``cache_dir``, else the Hugging Face cache as configured now (tests and env may move it)."""
    return Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE).expanduser()


def _ref_folders(revision: str) -> list[str]:
    """``refs`` and each folder between it and ``refs/<revision>`` (``refs/pr`` for ``refs/pr/1``)."""
    parts = revision.split("/")[:-1]
    return [str(Path("refs", *parts[:depth])) for depth in range(1, len(parts) + 1)]


def _read_ref(storage: Path, revision: str, where: str) -> str | None:
    """The commit ``refs/<revision>`` names, None if there is no such ref; GraftError if it is not a plain sha file."""
    ref = storage / "refs" / check_revision(revision, where)
    if not os.path.lexists(ref):
        return None
    check_cache_folder(storage, where, *_ref_folders(revision))
    if ref.is_symlink() or not ref.is_file() or ref.stat().st_size > 64:
        raise GraftError(f"{where}: {ref} in the Hugging Face cache is not a ref file (delete it and pull again)")
    commit = ref.read_text(encoding="ascii", errors="replace").strip()
    if not COMMIT_SHA.fullmatch(commit):
        raise GraftError(
            f"{where}: {ref} in the Hugging Face cache does not hold a commit sha (delete it and pull again)"
        )
    return commit


def write_ref(storage: Path, revision: str, commit: str) -> None:
    """refs/<revision> → commit, as the cache layout has it: how `org/name@branch` resolves offline."""
    where = f"ref {revision}"
    ref = storage / "refs" / check_revision(revision, where)
    check_cache_folder(storage, where, *_ref_folders(revision))
    ref.parent.mkdir(parents=True, exist_ok=True)
    check_cache_folder(storage, where, *_ref_folders(revision))  # nothing was linked in meanwhile
    if (
        not ref.is_symlink()
        and ref.is_file()
        and ref.stat().st_size <= 64
        and ref.read_text(errors="replace") == commit
    ):
        return
    replace_file(ref, commit.encode())


def cached_commit(manifest_name: str, reference: HubReference, cache_dir: Path) -> str | None:
    """The commit of a complete cached copy (its manifest is there), or None."""
    storage = storage_folder(cache_dir, reference.repo_id)
    check_cache_folder(storage, str(reference))
    revision = reference.revision_or_main
    commit = _read_ref(storage, revision, str(reference))
    if commit is None and COMMIT_SHA.fullmatch(revision):
        commit = revision
    if commit is None or not os.path.lexists(storage / "snapshots" / commit / manifest_name):
        return None
    return commit
