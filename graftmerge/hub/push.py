"""Push a graftmerge artifact folder (a manifest plus data files) to a Hub model repo; a re-run resumes.

Push resumes by asking the Hub, not a local journal: every data file is its own commit,
and a re-run lists the repo (size, LFS sha256 or git blob id per file) and uploads only
files that differ. The manifest and the card are committed last, so the repo reads as a
complete artifact only once every data file is there. ``*config.json`` files are pushed
without ``auto_map`` and ``custom_pipelines`` (:mod:`graftmerge.hub.untrusted`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, RepoFile
from tqdm.auto import tqdm

from graftmerge.errors import GraftError
from graftmerge.hub.artifact_kind import ArtifactKind
from graftmerge.hub.content_ids import same_as_remote
from graftmerge.hub.hub_errors import hub_errors
from graftmerge.hub.references import HubReference, check_revision, parse_hub_reference
from graftmerge.hub.untrusted import is_config_file, without_remote_code


@dataclass
class PushResult:
    """What a push did, file by file: tells a re-run's caller how much was resumed."""

    repo_id: str
    revision: str
    uploaded: list[str] = field(default_factory=list)  # data files, manifest and card, in commit order
    unchanged: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    commits: int = 0


def push_artifact(
    kind: ArtifactKind,
    folder: str | os.PathLike,
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool = False,
    token: str | None = None,
    api: Any = None,
    progress: bool = True,
) -> PushResult:
    """Upload ``folder`` to model repo ``repo_id`` (branch ``revision``); re-run to resume.

    Only files whose size and content id differ from the remote are uploaded, one commit
    each; a remote manifest that no longer matches is deleted first, and the manifest
    and card go in the last commit, so the repo never reads as a complete but mixed
    artifact. Stale ``*.safetensors`` of an earlier push are deleted in that commit.
    """
    folder = Path(folder)
    if kind.render_card is None:
        raise GraftError(f"graftmerge does not push a {kind.label}; use the tools of its own format")
    target = parse_hub_reference(repo_id)
    if target.revision is not None:
        raise GraftError(f"push to {target.repo_id} with --revision {target.revision}, not {repo_id!r}")
    branch = check_revision(revision, f"--revision {revision}") if revision is not None else "main"
    reference = HubReference(target.repo_id, branch)
    manifest, files = kind.open_local(folder)
    contents = {name: _pushed_content(folder, name) for name in files}
    sizes = {name: len(c) if isinstance(c, bytes) else c.stat().st_size for name, c in contents.items()}
    manifest_bytes = (folder / kind.manifest_name).read_bytes()
    card = kind.render_card(manifest, target.repo_id, branch, sizes).encode()
    api = api if api is not None else HfApi(token=token)
    result = PushResult(target.repo_id, branch)

    with hub_errors(kind, reference, "push to"):
        remote = _remote_files(api, target.repo_id, branch, private)
        to_upload = [name for name in files if not same_as_remote(remote.get(name), contents[name])]
        result.unchanged = [name for name in files if name not in to_upload]
        stale = sorted(p for p in remote if p.endswith(".safetensors") and p not in sizes)
        manifest_current = same_as_remote(remote.get(kind.manifest_name), manifest_bytes)
        if kind.manifest_name in remote and not manifest_current and (to_upload or stale):
            _commit(api, result, [CommitOperationDelete(kind.manifest_name)],
                    f"graftmerge: {kind.label} is being replaced")
            result.deleted.append(kind.manifest_name)
        _upload_data_files(kind, api, result, contents, to_upload, sizes, progress)
        final: list = []
        if not manifest_current:
            final.append(CommitOperationAdd(kind.manifest_name, manifest_bytes))
        if not same_as_remote(remote.get("README.md"), card):
            final.append(CommitOperationAdd("README.md", card))
        _commit_last(kind, api, result, final, stale)
    return result


def _pushed_content(folder: Path, name: str) -> Path | bytes:
    """What is uploaded for ``name``: the file itself, or a config's bytes without its remote-code fields."""
    if not is_config_file(name):
        return folder / name
    cleaned, removed = without_remote_code((folder / name).read_bytes(), str(folder / name))
    return cleaned if removed else folder / name


def _commit(api: Any, result: PushResult, operations: list, message: str) -> None:
    """One commit on the pushed branch, counted in ``result``."""
    api.create_commit(result.repo_id, operations, commit_message=message, revision=result.revision)
    result.commits += 1


def _remote_files(api: Any, repo_id: str, branch: str, private: bool) -> dict[str, RepoFile]:
    """Create the repo and branch if needed; path → file of what the branch holds now (what resume compares)."""
    api.create_repo(repo_id, private=True if private else None, exist_ok=True)
    if branch != "main":
        api.create_branch(repo_id, branch=branch, exist_ok=True)
    return {
        entry.path: entry
        for entry in api.list_repo_tree(repo_id, recursive=True, revision=branch)
        if isinstance(entry, RepoFile)
    }


def _upload_data_files(kind: ArtifactKind, api: Any, result: PushResult, contents: Mapping[str, Path | bytes],
                       to_upload: list[str], sizes: Mapping[str, int], progress: bool) -> None:
    """One commit per data file, so an interrupted push keeps every file it finished."""
    bar = tqdm(total=sum(sizes[n] for n in to_upload), unit="B", unit_scale=True,
               desc=f"push {kind.name}", disable=not progress)
    for index, name in enumerate(to_upload, 1):
        content = contents[name]
        _commit(api, result, [CommitOperationAdd(name, content if isinstance(content, bytes) else str(content))],
                f"graftmerge: {kind.label} file {name} ({index}/{len(to_upload)})")
        result.uploaded.append(name)
        bar.update(sizes[name])
    bar.close()


def _commit_last(kind: ArtifactKind, api: Any, result: PushResult, final: list, stale: list[str]) -> None:
    """Manifest, card and stale-shard deletions in one last commit: the repo reads as complete only after it."""
    final += [CommitOperationDelete(path) for path in stale]
    if final:
        _commit(api, result, final, f"graftmerge: {kind.label} manifest and model card")
        result.uploaded += [op.path_in_repo for op in final if isinstance(op, CommitOperationAdd)]
        result.deleted += stale
    else:
        result.unchanged += [kind.manifest_name, "README.md"]
