"""What push and pull need to know about one kind of graftmerge artifact (a manifest plus data files).

:class:`ArtifactKind`: the manifest's name and format, how to open and check a local
folder, which data files a manifest names, how to pick some layers, the model card;
:mod:`graftmerge.hub.kinds` defines the Fisher cache, the delta and the PEFT adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graftmerge.errors import GraftError
from graftmerge.formats.json_file import load_json_file
from graftmerge.hub.untrusted import check_file_name


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
