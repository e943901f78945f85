"""transformers' logging silenced while graftmerge builds or parses models through it.

Building a meta model for an adapter, or parsing a GGUF header, makes transformers log
details at warning level that are not the user's concern.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from transformers.utils import logging as hf_logging


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' own logging at error level inside the block, restored after it."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
