"""Push and pull a graftmerge artifact folder (a manifest plus data files) as one Hub model repo.

Generic over the artifact kind (:class:`ArtifactKind`: manifest file name, how to open a
local folder, which files a manifest names, how to pick some layers, the model card);
:mod:`graftmerge.hub.kinds` defines the Fisher cache and the delta.

Push resumes by asking the Hub, not a local journal: every data file is its own commit,
and a re-run lists the repo (size, LFS sha256 or git blob id per file) and uploads only
files that differ. The manifest and the card are committed last, so the repo reads as a
complete artifact only once every data file is there.

Pull goes through the Hugging Face cache (``HF_HUB_CACHE``), which makes a re-run skip
every file already fetched and lets ``org/name@rev`` resolve offline later. The manifest
is read first (over the network, into memory) to decide which files to fetch; it is
written into the cache only after them, so a snapshot with a manifest is complete.
``-o DIR`` then assembles DIR from the cache (hard links when possible) in a hidden
sibling folder, manifest last, renamed into place: DIR is locked from the start of the
pull and replaced whole (:mod:`graftmerge.formats.output_folder`).

What is pulled is a stranger's (:mod:`graftmerge.hub.untrusted`): every file name a
manifest or index gives is checked before it becomes a path, every file read from the
cache must be the snapshot's own (a link into the same repo's ``blobs/``, never one
planted to lead elsewhere), and ``*config.json`` files lose ``auto_map`` and
``custom_pipelines`` (in the snapshot and in ``-o``), so no pulled folder can make
transformers import code, even under ``--trust-remote-code``. Push strips them too.
The manifest's fields are checked before any data file is fetched
(``ArtifactKind.check_schema``), and what was fetched is validated as a merge would open
it, plus every value once (``ArtifactKind.validate_folder``), before ``-o`` is published
or a snapshot this pull completed is kept complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    RepoFile,
    constants,
    get_hf_file_metadata,
    get_session,
    hf_hub_download,
    hf_hub_url,
)
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, hf_raise_for_status
from tqdm.auto import tqdm

from graftmerge.errors import GraftError
from graftmerge.formats.file_hash import file_sha256
from graftmerge.formats.json_file import load_json_file, parse_json_bytes
from graftmerge.formats.output_folder import NEW, OVERWRITE, Inputs, OutputFolder, check_not_inputs
from graftmerge.hub.references import (
    HubReference,
    check_revision,
    hub_reference_or_none,
    parse_hub_reference,
)
from graftmerge.hub.untrusted import (
    MAX_JSON_BYTES,
    cached_file,
    check_cache_folder,
    check_file_name,
    is_config_file,
    read_json_bytes,
    replace_file,
    without_remote_code,
)

COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
# An ETag the Hub may send for a file: its git blob id or (LFS) sha256, optionally weak and quoted. The
# client names the blob it writes after it (``blobs/<etag>``): nothing else may reach that path.
HUB_ETAG = re.compile(r'^(?:W/)?"?(?P<hash>[0-9a-f]{40}|[0-9a-f]{64})"?$')
ETAG_HEADERS = ("ETag", "X-Linked-Etag")
KEPT_REMOTE_FILES = (".gitattributes", "README.md")


class HubArtifactNotFound(GraftError):
    """The Hub has no such repo, or (offline) the local cache has no copy: maybe a local path was meant."""


class NotThisKind(GraftError):
    """The repo exists but has no manifest of this kind: it may be another kind (:func:`pull_first_kind`)."""


def files_map_values(manifest: Mapping[str, Any], read: Callable[[str], bytes]) -> list[str]:
    """Data files of a manifest with a ``files`` map (tensor key → file), as Fisher caches have."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise GraftError("the manifest has no `files` map")
    return sorted(set(files.values()))


@dataclass(frozen=True)
class ArtifactKind:
    """What push/pull need to know about one kind of graftmerge artifact."""

    name: str  # the CLI group: `graftmerge <name> pull`
    label: str  # in messages: "Fisher cache"
    manifest_name: str
    format_name: str | None = None  # the manifest's "format" field; None: another project's format
    # (recognised by check_schema alone), which graftmerge pulls but does not push
    render_card: Callable[[Mapping[str, Any], str, str | None, Mapping[str, int]], str] | None = None
    # Data files named by a manifest; ``read(name)`` gives a small file of the artifact
    # (an index) from wherever it is being read: the local folder, or the Hub.
    list_files: Callable[[Mapping[str, Any], Callable[[str], bytes]], list[str]] = files_map_values
    open_folder: Callable[[Path], Mapping[str, Any]] | None = None  # full local check; default: generic
    select_layers: Callable[[Mapping[str, Any], Sequence[str]], dict[str, Any]] | None = None
    # Before any data file is fetched: the manifest's fields (GraftError naming ``where``).
    check_schema: Callable[[Mapping[str, Any], str], None] | None = None
    # After the pull: the folder checked as a merge opens it, plus the values a pull can afford.
    validate_folder: Callable[[Path], None] | None = None
    missing_hint: str = ""  # appended when the Hub repo lacks a data file

    @property
    def noun(self) -> str:
        """How messages name the kind: "graftmerge Fisher cache", or a foreign format's own label."""
        return f"graftmerge {self.label}" if self.format_name is not None else self.label

    def data_files(self, manifest: Mapping[str, Any], read: Callable[[str], bytes], where: str) -> list[str]:
        """The manifest's data files, each checked to be a safe name inside the folder (manifests come from the Hub)."""
        try:
            files = self.list_files(manifest, read)
        except GraftError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as error:
            shown = str(error).splitlines()[0] if str(error).strip() else type(error).__name__
            raise GraftError(f"{where}: {self.manifest_name} does not name its files ({shown})") from error
        return [check_file_name(name, where, self.manifest_name) for name in files]

    def check_manifest(self, manifest: Any, where: str) -> dict[str, Any]:
        """``manifest`` itself if it is one of this kind (its ``format`` field); GraftError otherwise.

        A foreign format (no ``format_name``) only has to be a JSON object here; ``check_schema`` checks it.
        """
        if self.format_name is None and not isinstance(manifest, dict):
            raise GraftError(f"{where} is not a {self.label} ({self.manifest_name} is not a JSON object)")
        if self.format_name is not None and (not isinstance(manifest, dict)
                                             or manifest.get("format") != self.format_name):
            found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
            raise GraftError(
                f"{where} is not a graftmerge {self.label} ({self.manifest_name} has format {found!r}, "
                f"not {self.format_name!r})"
            )
        return manifest

    def open_local(self, folder: Path) -> tuple[dict[str, Any], list[str]]:
        """(manifest, data files) of a complete local artifact folder; GraftError if it is not one."""
        if not folder.is_dir():
            raise GraftError(f"{folder} is not a folder")
        manifest_file = folder / self.manifest_name
        if not manifest_file.is_file():
            raise GraftError(f"{folder} is not a {self.noun} (no {self.manifest_name})")
        if self.open_folder is not None:
            manifest = dict(self.open_folder(folder))
        else:
            manifest = self.check_manifest(load_json_file(manifest_file, "manifest"), str(folder))
        files = self.data_files(manifest, lambda name: (folder / name).read_bytes(), str(folder))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise GraftError(f"{self.label} {folder} is missing file(s) {', '.join(missing[:5])}")
        return manifest, files


# -- hashing: what the Hub reports per file -----------------------------------------


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


# -- errors ---------------------------------------------------------------------------


@contextmanager
def hub_errors(kind: ArtifactKind, reference: HubReference, action: str) -> Iterator[None]:
    """huggingface_hub's exceptions as one-line GraftErrors that say what to do."""
    try:
        yield
    except GatedRepoError as error:
        raise GraftError(f"{reference.repo_id} is gated: accept its terms on the Hub, then pass --token or log in (`hf auth login`)") from error
    except RepositoryNotFoundError as error:
        raise HubArtifactNotFound(
            f"no Hub repo {reference.repo_id} (or it is private: pass --token or log in with `hf auth login`)"
        ) from error
    except RevisionNotFoundError as error:
        raise GraftError(f"revision {reference.revision_or_main!r} does not exist in Hub repo {reference.repo_id}") from error
    except RemoteEntryNotFoundError as error:
        response = getattr(error, "response", None)
        missing = str(response.url).rsplit("/", 1)[-1] if response is not None else kind.manifest_name
        if missing == kind.manifest_name:
            raise NotThisKind(f"{reference} is not a {kind.noun} (the repo has no {missing})") from error
        raise GraftError(f"{reference} is not a {kind.noun} (the repo has no {missing}{kind.missing_hint})") from error
    except OfflineModeIsEnabled as error:
        raise HubArtifactNotFound(
            f"cannot {action} {reference}: the Hub is offline (HF_HUB_OFFLINE=1) and it is not in the local "
            f"Hugging Face cache; run `graftmerge {kind.name} pull {reference}` where the Hub is reachable"
        ) from error
    except (httpx2.ConnectError, httpx2.TimeoutException, httpx2.RemoteProtocolError, LocalEntryNotFoundError) as error:
        raise GraftError(
            f"cannot {action} {reference}: the Hub did not answer ({type(error).__name__}); "
            "run the same command again, it resumes where it stopped"
        ) from error
    except HfHubHTTPError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise GraftError(f"cannot {action} {reference}: {first}; run the same command again to resume") from error


# -- push -----------------------------------------------------------------------------


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


# -- pull -----------------------------------------------------------------------------


@dataclass
class PullResult:
    """Where a pulled artifact is now, and which of its files this pull had to download."""

    folder: Path  # the artifact to use: the cache snapshot, or the assembled output folder
    commit: str
    files: list[str]  # data files of the pulled artifact
    fetched: list[str]  # of those, downloaded by this call (the rest were cached)
    stripped: dict[str, list[str]] = field(default_factory=dict)  # config file -> remote-code fields removed


def _storage_folder(cache_dir: Path, repo_id: str) -> Path:
    """The repo's folder in the cache layout (``models--org--name``), where refs and snapshots live."""
    return cache_dir / ("models--" + repo_id.replace("/", "--"))


def _cache_dir(cache_dir: str | os.PathLike | None) -> Path:
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
        raise GraftError(f"{where}: {ref} in the Hugging Face cache does not hold a commit sha (delete it and pull again)")
    return commit


def _write_ref(storage: Path, revision: str, commit: str) -> None:
    """refs/<revision> → commit, as the cache layout has it: how `org/name@branch` resolves offline."""
    where = f"ref {revision}"
    ref = storage / "refs" / check_revision(revision, where)
    check_cache_folder(storage, where, *_ref_folders(revision))
    ref.parent.mkdir(parents=True, exist_ok=True)
    check_cache_folder(storage, where, *_ref_folders(revision))  # nothing was linked in meanwhile
    if not ref.is_symlink() and ref.is_file() and ref.stat().st_size <= 64 and ref.read_text(errors="replace") == commit:
        return
    replace_file(ref, commit.encode())


def _cached_commit(kind: ArtifactKind, reference: HubReference, cache_dir: Path) -> str | None:
    """The commit of a complete cached copy (its manifest is there), or None."""
    storage = _storage_folder(cache_dir, reference.repo_id)
    check_cache_folder(storage, str(reference))
    revision = reference.revision_or_main
    commit = _read_ref(storage, revision, str(reference))
    if commit is None and COMMIT_SHA.fullmatch(revision):
        commit = revision
    if commit is None or not os.path.lexists(storage / "snapshots" / commit / kind.manifest_name):
        return None
    return commit


def _remote_manifest(
    kind: ArtifactKind, reference: HubReference, cache_dir: Path, token: str | None
) -> tuple[str, bytes] | None:
    """(commit, manifest bytes) from the Hub; None when the Hub cannot be reached."""
    if constants.is_offline_mode():
        return None
    url = hf_hub_url(reference.repo_id, kind.manifest_name, revision=reference.revision_or_main)
    try:
        metadata = get_hf_file_metadata(url, token=token)
    except (httpx2.ConnectError, httpx2.TimeoutException, OfflineModeIsEnabled):
        return None
    commit = metadata.commit_hash
    if metadata.size is not None and metadata.size > MAX_JSON_BYTES:  # refused before it is read into memory
        raise GraftError(f"{reference}: {kind.manifest_name} is {metadata.size} bytes, too large for a manifest "
                         "(corrupt or hostile)")
    if commit is None or not COMMIT_SHA.fullmatch(commit):
        raise GraftError(f"{reference}: the Hub did not say which commit it serves; check HF_ENDPOINT")
    storage = _storage_folder(cache_dir, reference.repo_id)
    check_cache_folder(storage, str(reference), f"snapshots/{commit}")
    if os.path.lexists(storage / "snapshots" / commit / kind.manifest_name):
        where = f"{reference.repo_id}@{commit[:12]}"
        return commit, read_json_bytes(cached_file(storage, commit, kind.manifest_name, where), where)
    response = get_session().get(hf_hub_url(reference.repo_id, kind.manifest_name, revision=commit),
                                 headers=build_hf_headers(token=token))
    hf_raise_for_status(response)
    return commit, response.content


def pull_artifact(
    kind: ArtifactKind,
    reference: HubReference | str,
    *,
    output: str | os.PathLike | None = None,
    layers: Sequence[str] = (),
    token: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> PullResult:
    """Fetch ``reference`` into the Hugging Face cache (and assemble ``output`` from it).

    ``layers``: globs on parameter names; only files holding those weights' tensors are
    fetched and ``output`` (required then) gets a manifest listing just them. Offline,
    or when the Hub does not answer, a complete cached copy is used as it is. Every file
    is checked to be the snapshot's own before it is read or linked (see the module doc).
    """
    if isinstance(reference, str):
        reference = parse_hub_reference(reference)
    inputs = [(f"Hugging Face cache folder of {reference.repo_id}", _storage_folder(_cache_dir(cache_dir),
                                                                                    reference.repo_id))]
    if output is not None:
        check_not_inputs(output, inputs)  # -o may not be (in) the cache folder the pull reads
    _check_pull(kind, output, layers, overwrite)
    if output is None:
        return _pull(kind, reference, None, layers, token, cache_dir, progress)
    with _output_folder(output, overwrite, inputs) as staged:  # locked before anything is fetched
        return _pull(kind, reference, staged, layers, token, cache_dir, progress)


def pull_first_kind(kinds: Sequence[ArtifactKind], reference: HubReference | str,
                    **options: Any) -> tuple[ArtifactKind, PullResult]:
    """``pull_artifact`` of the first of ``kinds`` whose manifest the repo (or offline, the cache) has.

    ``graftmerge delta pull`` takes a graftmerge delta or a PEFT LoRA adapter: each kind is
    asked in turn, and one that the repo is not (no manifest of its kind, or no cached copy
    offline) costs one metadata request and nothing else. When no kind fits: one line naming
    every manifest looked for, or (the Hub unreachable, the repo missing) the first kind's error.
    """
    if isinstance(reference, str):
        reference = parse_hub_reference(reference)
    errors: list[GraftError] = []
    for kind in kinds:
        try:
            return kind, pull_artifact(kind, reference, **options)
        except (NotThisKind, HubArtifactNotFound) as error:
            errors.append(error)
    if all(isinstance(error, NotThisKind) for error in errors):
        others = ", nor ".join(f"a {kind.noun} (no {kind.manifest_name})" for kind in kinds[1:])
        raise NotThisKind(f"{errors[0]}{', nor ' + others if others else ''}") from errors[0]
    raise next(error for error in errors if not isinstance(error, NotThisKind))


def _output_folder(output: str | os.PathLike, overwrite: bool, inputs: Inputs = ()) -> OutputFolder:
    """``-o`` as an output folder: replaced whole, only with ``--overwrite``; none of ``inputs``."""
    return OutputFolder(output, replace=OVERWRITE if overwrite else NEW, hint="pass --overwrite to replace it",
                        inputs=inputs)


def _pull(kind: ArtifactKind, reference: HubReference, staged: OutputFolder | None, layers: Sequence[str],
          token: str | None, cache_dir: str | os.PathLike | None, progress: bool) -> PullResult:
    """``pull_artifact`` once ``-o`` (``staged``, if any) is locked: fetch, then fill and publish it."""
    cache = _cache_dir(cache_dir)
    with hub_errors(kind, reference, "pull"):
        online, commit, raw = _pull_manifest(kind, reference, cache, token)
        where = f"{reference.repo_id}@{commit[:12]}"
        manifest = kind.check_manifest(parse_json_bytes(raw, f"{where}/{kind.manifest_name}", "manifest"), where)
        if layers:
            manifest = _select_layers(kind, manifest, layers, where)
            manifest["pulled"] = {"from": f"{reference.repo_id}@{commit}", "layers": list(layers)}
        fetch = _SnapshotFiles(kind, reference, cache, commit, online, token)
        files = kind.data_files(manifest, lambda name: read_json_bytes(fetch(name), f"{where}/{name}"), where)
        if kind.check_schema is not None:
            kind.check_schema(manifest, f"{where}/{kind.manifest_name}")  # before anything large is fetched
        for name in tqdm(files, desc=f"pull {kind.name}", unit="file", disable=not progress or not files):
            fetch(name)
        stripped = fetch.strip_remote_code(files)
        completed_now = online and not os.path.lexists(fetch.snapshot / kind.manifest_name)
        if online:
            fetch.complete()
        if staged is None and completed_now:
            _validate_pulled(kind, fetch.snapshot, where, fetch.snapshot / kind.manifest_name)
        sources = {name: fetch.checked(name) for name in [*files, kind.manifest_name]}
    folder = fetch.snapshot
    if staged is not None:
        data = raw if not layers else json.dumps(manifest, indent=1, sort_keys=True).encode()
        fill_folder(staged.staging, sources, files, kind.manifest_name, data)
        undo = fetch.snapshot / kind.manifest_name if completed_now else None  # and the snapshot incomplete
        _validate_pulled(kind, staged.staging, where, undo)  # a failure leaves -o as it was
        folder = staged.publish()
    return PullResult(folder=folder, commit=commit, files=files, fetched=fetch.fetched, stripped=stripped)


def _validate_pulled(kind: ArtifactKind, folder: Path, where: str, undo: Path | None = None) -> None:
    """``kind.validate_folder`` on what was pulled, messages naming ``where``; on failure ``undo`` is removed.

    ``undo``: the snapshot's manifest, when this pull completed the snapshot: removing it
    leaves the cached copy incomplete, so nothing resolves to it offline.
    """
    if kind.validate_folder is None:
        return
    try:
        kind.validate_folder(folder)
    except GraftError as error:
        if undo is not None and os.path.lexists(undo):
            os.unlink(undo)
        text = str(error).replace(str(folder), where)
        raise GraftError(f"pull refused: {text if where in text else f'{where}: {text}'}") from error


def _select_layers(kind: ArtifactKind, manifest: dict[str, Any], layers: Sequence[str], where: str) -> dict[str, Any]:
    """``kind.select_layers``, a malformed (downloaded) manifest reported in one line."""
    try:
        return kind.select_layers(manifest, layers)
    except GraftError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
        shown = str(error).splitlines()[0] if str(error).strip() else type(error).__name__
        raise GraftError(f"{where}: corrupt {kind.manifest_name}, cannot pick layers from it ({type(error).__name__}: {shown})") from error


def _check_pull(kind: ArtifactKind, output: str | os.PathLike | None, layers: Sequence[str],
                overwrite: bool) -> None:
    """Refuse a pull that cannot succeed before anything is fetched."""
    if layers and output is None:
        raise GraftError(f"--layers makes a partial {kind.label}, which needs its own folder: add -o {kind.name}/NAME")
    if layers and kind.select_layers is None:
        raise GraftError(f"a {kind.label} cannot be pulled by layers")
    if output is not None and os.path.lexists(output) and not overwrite:
        raise GraftError(f"{output} already exists; pass --overwrite to replace it")
    if output is not None and Path(output).is_symlink():
        raise GraftError(f"{output} is a link; pull into a plain folder (remove the link, or give its target)")


def _pull_manifest(
    kind: ArtifactKind, reference: HubReference, cache: Path, token: str | None
) -> tuple[bool, str, bytes]:
    """(online, commit, manifest bytes): from the Hub when it answers, else from a complete cached copy."""
    found = _remote_manifest(kind, reference, cache, token)
    if found is not None:
        return True, *found
    commit = _cached_commit(kind, reference, cache)
    if commit is None:
        raise HubArtifactNotFound(
            f"{reference} is not in the local Hugging Face cache ({cache}) and the Hub cannot be reached "
            f"(HF_HUB_OFFLINE=1 or no network); run `graftmerge {kind.name} pull {reference}` where it is reachable"
        )
    storage, where = _storage_folder(cache, reference.repo_id), f"{reference.repo_id}@{commit[:12]}"
    check_cache_folder(storage, where, f"snapshots/{commit}")
    return False, commit, read_json_bytes(cached_file(storage, commit, kind.manifest_name, where), where)


@dataclass
class _SnapshotFiles:
    """Files of one commit's cache snapshot: read from the cache, else fetched from the Hub (never offline)."""

    kind: ArtifactKind
    reference: HubReference
    cache: Path
    commit: str
    online: bool
    token: str | None
    fetched: list[str] = field(default_factory=list)  # downloaded by this pull, in order

    @property
    def storage(self) -> Path:
        """The repo's folder in the cache."""
        return _storage_folder(self.cache, self.reference.repo_id)

    @property
    def snapshot(self) -> Path:
        """The commit's snapshot folder (complete once it holds the manifest)."""
        return self.storage / "snapshots" / self.commit

    @property
    def where(self) -> str:
        """How messages name this snapshot."""
        return f"{self.reference.repo_id}@{self.commit[:12]}"

    def checked(self, name: str) -> Path:
        """The real file behind ``name``, refused if it is a link leading out of this repo's blobs."""
        return cached_file(self.storage, self.commit, name, self.where)

    def __call__(self, name: str) -> Path:
        """One file of the snapshot (its checked real path): from the cache, else from the Hub (never offline)."""
        reference, kind = self.reference, self.kind
        check_cache_folder(self.storage, self.where, f"snapshots/{self.commit}")
        if (self.snapshot / name).exists():
            return self.checked(name)
        if not self.online:
            raise HubArtifactNotFound(
                f"{reference} is only partly in the local Hugging Face cache ({name} is missing) and the Hub "
                f"cannot be reached; run `graftmerge {kind.name} pull {reference}` where it is reachable"
            )
        with checked_hub_answers(self.commit, self.where):
            hf_hub_download(reference.repo_id, name, revision=self.commit, cache_dir=str(self.cache), token=self.token)
        self.fetched.append(name)
        check_blob_content(self.checked(name), self.where, name)
        return self.checked(name)

    def strip_remote_code(self, files: Sequence[str]) -> dict[str, list[str]]:
        """Rewrite each config of the snapshot that names code to import without those fields; what was removed."""
        stripped = {}
        for name in files:
            if not is_config_file(name):
                continue
            cleaned, removed = without_remote_code(read_json_bytes(self.checked(name), f"{self.where}/{name}"),
                                                   f"{self.where}/{name}")
            if removed:
                replace_file(self.snapshot / name, cleaned)  # a plain file in place of the link to the blob
                stripped[name] = removed
        return stripped

    def complete(self) -> None:
        """Manifest last (from now on the snapshot reads as complete), then the ref for offline use."""
        reference = self.reference
        if not (self.snapshot / self.kind.manifest_name).exists():
            with checked_hub_answers(self.commit, self.where):
                hf_hub_download(reference.repo_id, self.kind.manifest_name, revision=self.commit,
                                cache_dir=str(self.cache), token=self.token)
            check_blob_content(self.checked(self.kind.manifest_name), self.where, self.kind.manifest_name)
        self.checked(self.kind.manifest_name)
        if reference.revision_or_main != self.commit:
            _write_ref(self.storage, reference.revision_or_main, self.commit)


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
    actual = file_sha256(blob) if len(blob.name) == 64 else _file_git_blob_id(blob)
    if actual != blob.name:
        blob.unlink()
        raise GraftError(f"{where}: {name} as fetched does not match the Hub's hash for it ({blob.name[:12]}…, got "
                         f"{actual[:12]}…); it was removed, pull again")


def _file_git_blob_id(path: Path, block_bytes: int = 1 << 24) -> str:
    """:func:`git_blob_id` of a file, read a block at a time."""
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(block_bytes), b""):
            digest.update(block)
    return digest.hexdigest()


def fill_folder(staging: Path, sources: Mapping[str, Path], files: Sequence[str], manifest_name: str,
                manifest: bytes) -> None:
    """Hard-link (or copy) ``files`` from ``sources`` into ``staging``, then write the manifest last."""
    for name in files:
        source, target = sources[name], staging / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, target, follow_symlinks=False)  # no second copy of a large blob
        except OSError:
            shutil.copyfile(source, target, follow_symlinks=False)
    (staging / (manifest_name + ".tmp")).write_bytes(manifest)
    os.replace(staging / (manifest_name + ".tmp"), staging / manifest_name)


# -- resolution for configs -------------------------------------------------------------


def resolve_artifact(kind: ArtifactKind, text: str, *, cache_dir: str | os.PathLike | None = None,
                     token: str | None = None, progress: bool = True) -> str:
    """A local folder for ``text``: itself when it is (or is written as) a local path, else its Hub copy.

    The Hub copy comes from the Hugging Face cache, fetched first when the Hub is
    reachable and the cache lacks it; offline, only a complete cached copy is used.
    """
    reference = hub_reference_or_none(text)
    if reference is None:
        return text
    try:
        return str(pull_artifact(kind, reference, token=token, cache_dir=cache_dir, progress=progress).folder)
    except HubArtifactNotFound as error:
        if text.startswith("hf://"):
            raise
        raise HubArtifactNotFound(f"{kind.label} {text}: not a local folder, and {error} (write a local folder as ./{text})") from error
