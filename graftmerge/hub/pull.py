"""Pull a graftmerge artifact (or a PEFT adapter) from a Hub model repo into the HF cache, and into ``-o DIR``.

Pull goes through the Hugging Face cache (``HF_HUB_CACHE``), which makes a re-run skip
every file already fetched and lets ``org/name@rev`` resolve offline later
(:mod:`graftmerge.hub.cache_layout`). The manifest is read first (over the network, into
memory) to decide which files to fetch; it is written into the cache only after them, so a
snapshot with a manifest is complete. ``-o DIR`` then assembles DIR from the cache (hard
links when possible) in a hidden sibling folder, manifest last, renamed into place: DIR is
locked from the start of the pull and replaced whole (:mod:`graftmerge.formats.output_folder`).

What is pulled is a stranger's (:mod:`graftmerge.hub.untrusted`): every file name a
manifest or index gives is checked before it becomes a path, every file read from the
cache must be the snapshot's own (a link into the same repo's ``blobs/``, never one
planted to lead elsewhere), every fetched blob must match the Hub's hash for it
(:mod:`graftmerge.hub.content_ids`), and ``*config.json`` files lose ``auto_map`` and
``custom_pipelines`` (in the snapshot and in ``-o``), so no pulled folder can make
transformers import code, even under ``--trust-remote-code``.
The manifest's fields are checked before any data file is fetched
(``ArtifactKind.check_schema``), and what was fetched is validated as a merge would open
it, plus every value once (``ArtifactKind.validate_folder``), before ``-o`` is published
or a snapshot this pull completed is kept complete.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
from huggingface_hub import (
    constants,
    get_hf_file_metadata,
    get_session,
    hf_hub_download,
    hf_hub_url,
)
from huggingface_hub.errors import OfflineModeIsEnabled
from huggingface_hub.utils import build_hf_headers, hf_raise_for_status
from tqdm.auto import tqdm

from graftmerge.errors import GraftError
from graftmerge.formats.json_file import parse_json_bytes
from graftmerge.formats.output_folder import NEW, OVERWRITE, Inputs, OutputFolder, check_not_inputs
from graftmerge.hub.artifact_kind import ArtifactKind
from graftmerge.hub.cache_layout import (
    COMMIT_SHA,
    cache_folder,
    cached_commit,
    storage_folder,
    write_ref,
)
from graftmerge.hub.content_ids import check_blob_content, checked_hub_answers
from graftmerge.hub.hub_errors import HubArtifactNotFound, NotThisKind, hub_errors
from graftmerge.hub.references import HubReference, hub_reference_or_none, parse_hub_reference
from graftmerge.hub.untrusted import (
    MAX_JSON_BYTES,
    cached_file,
    check_cache_folder,
    is_config_file,
    read_json_bytes,
    replace_file,
    without_remote_code,
)


@dataclass
class PullResult:
    """Where a pulled artifact is now, and which of its files this pull had to download."""

    folder: Path  # the artifact to use: the cache snapshot, or the assembled output folder
    commit: str
    files: list[str]  # data files of the pulled artifact
    fetched: list[str]  # of those, downloaded by this call (the rest were cached)
    stripped: dict[str, list[str]] = field(default_factory=dict)  # config file -> remote-code fields removed


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
    storage = storage_folder(cache_dir, reference.repo_id)
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
    inputs = [(f"Hugging Face cache folder of {reference.repo_id}", storage_folder(cache_folder(cache_dir),
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
    cache = cache_folder(cache_dir)
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
        raise GraftError(
            f"{where}: corrupt {kind.manifest_name}, cannot pick layers from it ({type(error).__name__}: {shown})"
        ) from error


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
    commit = cached_commit(kind.manifest_name, reference, cache)
    if commit is None:
        raise HubArtifactNotFound(
            f"{reference} is not in the local Hugging Face cache ({cache}) and the Hub cannot be reached "
            f"(HF_HUB_OFFLINE=1 or no network); run `graftmerge {kind.name} pull {reference}` where it is reachable"
        )
    storage, where = storage_folder(cache, reference.repo_id), f"{reference.repo_id}@{commit[:12]}"
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
        return storage_folder(self.cache, self.reference.repo_id)

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
            write_ref(self.storage, reference.revision_or_main, self.commit)


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
        raise HubArtifactNotFound(
            f"{kind.label} {text}: not a local folder, and {error} (write a local folder as ./{text})"
        ) from error
