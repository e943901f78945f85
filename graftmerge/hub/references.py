"""``org/name@rev`` and ``hf://org/name@rev``: how a Hub artifact is named in configs and CLIs.

Pure string logic, no IO apart from :func:`hub_reference_or_none`, which asks whether a
local path of that name exists (a local folder always wins over a Hub id).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from graftmerge.errors import GraftError

HF_SCHEME = "hf://"
# The Hub's repo ids: one namespace, one name; letters, digits, '-', '_', '.' (no '--' or '..').
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
_REVISION = re.compile(r"^[\w.\-/]+$")  # branch, tag (may hold '/', e.g. refs/pr/1) or commit sha


@dataclass(frozen=True)
class HubReference:
    """A Hub model repo and an optional revision (None: the default branch)."""

    repo_id: str
    revision: str | None = None

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
    if not _REPO_ID.match(repo_id) or "--" in repo_id or ".." in repo_id:
        raise GraftError(
            f"{text!r} is not a Hub reference; write org/name, org/name@revision or hf://org/name@revision"
        )
    if at and not (revision and _REVISION.match(revision)):
        raise GraftError(f"{text!r}: the revision after '@' must be a branch, tag or commit sha")
    return HubReference(repo_id, revision if at else None)


def hub_reference_or_none(text: str) -> HubReference | None:
    """The Hub reference ``text`` stands for, or None when it names (or must name) a local path.

    ``hf://`` is always the Hub. Otherwise an existing path wins, and anything written as a
    path (``./x``, ``/x``, ``~/x``, more or fewer than one '/') stays local.
    """
    if text.startswith(HF_SCHEME):
        return parse_hub_reference(text)
    if os.path.exists(text) or text.startswith((".", "/", "~")):
        return None
    try:
        return parse_hub_reference(text)
    except GraftError:
        return None
