"""Checks on what a Hub repo, or a shared Hugging Face cache, hands graftmerge.

An artifact pulled from the Hub is a stranger's: its manifest names the files to fetch,
its configs may name code for transformers to import, and the cache it lands in may
hold links planted by someone else. Everything here turns such input into either a
value that is safe to use or a one-line :class:`GraftError`:

* :func:`check_file_name`: a file name from a manifest or an index stays inside the
  artifact folder (no NUL or control characters, no ``..``, no absolute path, no
  backslash, no empty part) and is a kind of file graftmerge pulls (``.safetensors``
  and ``.json``: never code).
* :func:`without_remote_code`: a ``*config.json`` with every field that makes
  transformers import code (``auto_map``, ``custom_pipelines``) removed, so that a
  pulled folder never makes ``--trust-remote-code`` fetch or run anyone's code.
* :func:`cached_file`: a file of a cache snapshot, refused unless it is a plain file of
  the snapshot or a link into the same repo's ``blobs/``; a link anywhere else (another
  repo, ``/etc/passwd``) is never followed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from graftmerge.errors import GraftError
from graftmerge.formats.json_file import TOO_LONG_INTEGER

# Config fields from which transformers imports code: ``auto_map`` (AutoConfig, AutoModel*,
# AutoTokenizer, processors; "module.Class" or "other/repo--module.Class") and
# ``custom_pipelines`` (pipeline tasks with an "impl" class to import).
REMOTE_CODE_FIELDS = ("auto_map", "custom_pipelines")
PULLED_SUFFIXES = (".safetensors", ".json")  # what a graftmerge artifact is made of
MAX_NAME_PART = 200  # characters per '/'-separated part (file systems stop at 255 bytes)
MAX_NAME = 1000
MAX_JSON_BYTES = 256 * 2**20  # a manifest, index or config read into memory; real ones are far smaller


def file_name_problem(name: Any) -> str | None:
    """Why ``name`` (from a downloaded manifest or index) cannot be used as a path, or None if it can."""
    if not isinstance(name, str) or not name:
        return "not a file name"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "a NUL or control character"
    if "\\" in name or ":" in name:
        return "a backslash or ':'"
    if name.startswith("/"):
        return "an absolute path"
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "an empty, '.' or '..' part"
    if len(name) > MAX_NAME or any(len(part) > MAX_NAME_PART for part in parts):
        return "a name too long for a file system"
    if not name.endswith(PULLED_SUFFIXES):
        return f"not a {' or '.join(PULLED_SUFFIXES)} file"
    return None


def check_file_name(name: Any, where: str, manifest_name: str) -> str:
    """``name`` if it is safe to join to the artifact folder; a one-line GraftError otherwise."""
    problem = file_name_problem(name)
    if problem is not None:
        raise GraftError(f"{where}: {manifest_name} names a file graftmerge will not pull ({name!r}: {problem})")
    return name


def is_config_file(name: str) -> bool:
    """``config.json``, ``tokenizer_config.json``, ``generation_config.json``...: files transformers reads code
    names from."""
    return name.rsplit("/", 1)[-1].endswith("config.json")


def _strip(value: Any) -> tuple[Any, list[str]]:
    """``value`` without remote-code fields at any depth, and the dotted names of the fields removed."""
    if isinstance(value, dict):
        removed, kept = [], {}
        for key, item in value.items():
            if key in REMOTE_CODE_FIELDS:
                removed.append(key)
                continue
            kept[key], inner = _strip(item)
            removed += [f"{key}.{field}" for field in inner]
        return kept, removed
    if isinstance(value, list):
        pairs = [_strip(item) for item in value]
        return [item for item, _ in pairs], [field for _, fields in pairs for field in fields]
    return value, []


def without_remote_code(raw: bytes, where: str) -> tuple[bytes, list[str]]:
    """(config bytes without ``auto_map``/``custom_pipelines``, the fields removed); ``raw`` itself when none.

    GraftError when ``raw`` is not a JSON object: transformers could not read it either.
    """
    try:
        config = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise GraftError(f"{where} is not valid JSON ({str(error).splitlines()[0]})") from error
    except ValueError as error:  # json's int(): an integer past Python's int/str conversion limit
        raise GraftError(f"{where} is not valid JSON for graftmerge ({TOO_LONG_INTEGER})") from error
    except MemoryError as error:
        raise GraftError(f"{where} is not valid JSON for graftmerge (too large to parse in memory)") from error
    if not isinstance(config, dict):
        raise GraftError(f"{where} is not a JSON object")
    try:
        cleaned, removed = _strip(config)
    except RecursionError as error:
        raise GraftError(f"{where} is nested too deeply to be a config") from error
    if not removed:
        return raw, []
    return (json.dumps(cleaned, indent=2, ensure_ascii=False) + "\n").encode(), removed


def read_json_bytes(path: Path, where: str) -> bytes:
    """The bytes of a JSON file of an artifact (manifest, index, config); GraftError if it is implausibly large."""
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise GraftError(f"{where} is {size} bytes, too large for a JSON file of an artifact (corrupt or hostile)")
    return path.read_bytes()


def replace_file(path: Path, data: bytes) -> None:
    """``path`` becomes a plain file holding ``data`` (a link there is replaced, never written through)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def check_cache_folder(storage: Path, where: str, *inside: str) -> None:
    """Refuse a repo's cache folder whose ``blobs``/``snapshots``/``refs`` (or ``inside``) lead elsewhere.

    huggingface_hub writes downloads under them; a planted link would make it write
    outside the cache, or read another repo's files as this one's. The repo's own folder
    may be a link (a cache moved to a bigger disk); what is under it must not be.
    """
    home = storage.resolve()
    for relative in ("blobs", "snapshots", "refs", *inside):
        entry = storage / relative
        if os.path.lexists(entry) and entry.resolve() != home / relative:
            raise GraftError(
                f"{where}: {entry} in the Hugging Face cache is a link to {entry.resolve()}, outside this repo's "
                f"cache folder; refusing it (delete {entry} and pull again)"
            )


def cached_file(storage: Path, commit: str, name: str, where: str) -> Path:
    """The real file behind ``snapshots/<commit>/<name>`` of a repo's cache folder ``storage``.

    Accepted: a plain file of the snapshot, or a link (as huggingface_hub makes them) to
    a file in the same repo's ``blobs/``. Anything else (a link to another repo, out of
    the cache, a loop, a folder) is a one-line GraftError; the link is not followed.
    """
    home = storage.resolve()
    entry = storage / "snapshots" / commit / name
    try:
        real = entry.resolve(strict=True)
    except FileNotFoundError as error:
        raise GraftError(f"{where}: {name} is missing from the Hugging Face cache ({entry})") from error
    except (OSError, RuntimeError) as error:  # a link loop, a name the file system refuses
        raise GraftError(f"{where}: cannot read {entry} in the Hugging Face cache ({error})") from error
    if real != home / "snapshots" / commit / name and not real.is_relative_to(home / "blobs"):
        raise GraftError(
            f"{where}: {entry} in the Hugging Face cache is a link to {real}, outside this repo's blobs; "
            f"refusing it (delete {entry} and pull again)"
        )
    if not real.is_file():
        raise GraftError(f"{where}: {entry} in the Hugging Face cache is not a file")
    return real


def check_snapshot_tree(snapshot: Path, where: str) -> Path:
    """``snapshot`` (``.../models--org--name/snapshots/<commit>``) if every entry under it is its own.

    Walks without following links; each file or link must pass :func:`cached_file`, so a
    link planted to another repo or out of the cache is refused before anything reads it.
    """
    storage, commit = snapshot.parent.parent, snapshot.name
    check_cache_folder(storage, where, f"snapshots/{commit}")
    for root, folders, files in os.walk(snapshot, followlinks=False):
        for name in [*files, *(f for f in folders if (Path(root) / f).is_symlink())]:
            cached_file(storage, commit, (Path(root) / name).relative_to(snapshot).as_posix(), where)
    return snapshot
