"""The user's graftmerge cache folder, and the content-keyed records kept in it across runs.

Results that are expensive to recompute and cheap to key by content live here: global
thresholds (:mod:`graftmerge.pipeline.threshold_pass`) and the digests of eigenbases that
passed the full orthonormality check (:mod:`graftmerge.formats.fisher_cache`). Nothing
in it is ever needed: a missing, unwritable or deleted folder only means recomputing.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$GRAFTMERGE_CACHE_DIR``, else ``$XDG_CACHE_HOME/graftmerge``, else ``~/.cache/graftmerge``."""
    if os.environ.get("GRAFTMERGE_CACHE_DIR"):
        return Path(os.environ["GRAFTMERGE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "graftmerge"


class PassedChecks:
    """Hex digests of contents that passed one check, one empty file per digest in ``cache_dir()/<check>/``.

    Only ever written after the check passed on the exact bytes the digest was taken of,
    so a digest found here vouches for those bytes alone (sha256: no other content has it).
    """

    def __init__(self, check: str):
        self.check = check

    def _file(self, digest: str) -> Path:
        return cache_dir() / self.check / digest

    def __contains__(self, digest: str) -> bool:
        return self._file(digest).is_file()

    def add(self, digest: str) -> None:
        """Record that ``digest``'s content passed; silently skipped when the cache folder is not writable."""
        file = self._file(digest)
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            file.touch()
        except OSError:
            pass
