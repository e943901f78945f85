"""``org/name@rev`` and ``hf://org/name@rev``: how a Hub artifact is named in configs and CLIs.

Pure string logic, no IO apart from :func:`hub_reference_or_none`, which asks whether a
local path of that name exists (a local folder always wins over a Hub id).

A reference ends up in paths (``models--org--name/refs/<revision>`` in the Hugging Face
cache) and in URLs, and may come from a stranger's config or model card, so both parts
are checked here, once, for everything that builds a :class:`HubReference`: a repo id
is ``org/name`` in the Hub's ASCII alphabet; a revision is a branch, tag (``v1.2``,
``refs/pr/1``) or commit sha whose '/'-separated parts cannot climb out of a folder.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from graftmerge.errors import GraftError

HF_SCHEME = "hf://"
# The Hub's repo ids: one namespace, one name; ASCII letters, digits, '-', '_', '.', neither
# starting nor ending with '-' or '.', at most 96 characters each (no '--' or '..', no '.git' end).
_REPO_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"{_REPO_PART}/{_REPO_PART}")
# One '/'-separated part of a branch or tag name (or a commit sha): ASCII, and not starting with
# '.', so no part is '.' or '..' and none is hidden; '..' anywhere is refused as git refuses it.
_REVISION_PART = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]*")
MAX_REVISION_LENGTH = 255
REVISION_RULE = (
    "a branch, tag or commit sha: ASCII letters, digits, '.', '_', '-', '+' in '/'-separated parts, "
    "no empty part, no part starting with '.', no '..'"
)


def is_repo_id(text: str) -> bool:
    """Whether ``text`` is a Hub model repo id, ``org/name``, in the Hub's alphabet."""
    return (
        isinstance(text, str)
        and _REPO_ID.fullmatch(text) is not None
        and "--" not in text
        and ".." not in text
        and not text.endswith(".git")
    )


def is_revision(text: str) -> bool:
    """Whether ``text`` is a branch, tag or commit sha that stays inside a folder when joined as a path."""
    return (
        isinstance(text, str)
        and 0 < len(text) <= MAX_REVISION_LENGTH
        and ".." not in text
        and all(_REVISION_PART.fullmatch(part) for part in text.split("/"))
    )


def check_revision(revision: str, reference: str) -> str:
    """``revision`` itself if it is a valid branch, tag or commit sha; a one-line GraftError naming ``reference``
    otherwise."""
    if not is_revision(revision):
        raise GraftError(
            f"{reference!r}: the revision {revision!r} is not a valid revision; write {REVISION_RULE}"
        )
    return revision


@dataclass(frozen=True)
class HubReference:
    """A Hub model repo and an optional revision (None: the default branch); both checked on creation."""

    repo_id: str
    revision: str | None = None

    def __post_init__(self) -> None:
        if not is_repo_id(self.repo_id):
            raise GraftError(
                f"{self.repo_id!r} is not a Hub repo id; write org/name (ASCII letters, digits, '-', '_', '.')"
            )
        if self.revision is not None:
            check_revision(self.revision, f"{self.repo_id}@{self.revision}")

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"

    @property
    def revision_or_main(self) -> str:
        """The revision to ask the Hub for: None means the default branch, ``main``."""
        return self.revision or "main"


def parse_hub_reference(text: str) -> HubReference:
    """``org/name``, ``org/name@rev`` or the same behind ``hf://``; GraftError otherwise."""
    body = text[len(HF_SCHEME) :] if text.startswith(HF_SCHEME) else text
    repo_id, at, revision = body.partition("@")
    repo_id = repo_id.rstrip("/")
    if not is_repo_id(repo_id):
        raise GraftError(
            f"{text!r} is not a Hub reference; write org/name, org/name@revision or hf://org/name@revision"
        )
    if at and not revision:
        raise GraftError(f"{text!r}: the revision after '@' must be a branch, tag or commit sha")
    if at:
        check_revision(revision, text)
    return HubReference(repo_id, revision if at else None)


def hub_reference_or_none(text: str) -> HubReference | None:
    """The Hub reference ``text`` stands for, or None when it names (or must name) a local path.

    ``hf://`` is always the Hub. Otherwise an existing path wins, and anything written as a
    path (``./x``, ``/x``, ``~/x``, more or fewer than one '/') stays local. ``org/name@rev``
    whose revision could climb out of a folder is refused (GraftError), never taken as a path.
    """
    if text.startswith(HF_SCHEME) or "\0" in text:
        return parse_hub_reference(text)
    if os.path.exists(text) or text.startswith((".", "/", "~")):
        return None
    repo_id, at, revision = text.partition("@")
    if at and is_repo_id(repo_id.rstrip("/")):
        return parse_hub_reference(text)  # a Hub reference, or a one-line error about its revision
    try:
        return parse_hub_reference(text)
    except GraftError:
        return None
