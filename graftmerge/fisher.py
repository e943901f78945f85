"""Deprecated: ``graftmerge.fisher`` was the Fisher cache package before it became
``graftmerge/formats/fisher_cache.py``. Import from ``graftmerge`` instead
(``from graftmerge import FisherCacheWriter``); this alias goes in graftmerge 0.3 at the
earliest (docs/api-policy.md).

A name warns (DeprecationWarning) when it is used, not when this module is imported, so
the warning points at the user's own import line; nothing heavy loads until then.
"""

import sys
import warnings

# What the old package exported (its format constants aside), all public names now.
_MOVED = ("FisherCache", "FisherCacheWriter", "KfacFactors", "open_fisher_cache")

__all__ = list(_MOVED)


def __getattr__(name: str):
    """``graftmerge.<name>``, with a DeprecationWarning naming that stable import."""
    if name not in _MOVED:
        raise AttributeError(f"module 'graftmerge.fisher' has no attribute {name!r}")
    warnings.warn(f"graftmerge.fisher is deprecated; use `from graftmerge import {name}`",
                  DeprecationWarning, stacklevel=2)
    return getattr(sys.modules["graftmerge"], name)
