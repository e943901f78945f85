"""Files a command writes beside its main output (``--json``, ``--plot``, ``--save-rollouts``).

Such a file is held to what an output folder is: it may not be, lie inside, or hold any input
of the command, nor lie inside the folder the command replaces (one check for every written
path: :func:`graftmerge.formats.output_folder.check_not_inputs`); and it is written whole: a
temporary file created beside it (``O_EXCL``, a name no one else has), then renamed over it,
so a link at its path is replaced, never written through, and a kill leaves the old file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from graftmerge.errors import GraftError
from graftmerge.formats.output_folder import Inputs, check_not_inputs


def check_output_file(path: str | os.PathLike, inputs: Inputs, option: str) -> Path:
    """``path`` as a Path; GraftError when it is an input, inside or holding one (``inputs``), or a folder.

    ``option``: how the user named it (``--json``), for the message. Reads only: call it before any work.
    """
    inputs = list(inputs)
    check_not_inputs(path, inputs, what=option)
    if os.path.isdir(path) and not os.path.islink(path):
        raise GraftError(f"{option} {path} is a folder; give a file name")
    return Path(path)


@contextlib.contextmanager
def replacing(path: str | os.PathLike, inputs: Inputs, option: str) -> Iterator[Path]:
    """A fresh temporary file beside ``path`` to write; renamed over ``path`` when the block ends without error.

    ``path`` is checked again first (:func:`check_output_file`); its folder is created if missing.
    On an error the temporary file goes and ``path`` is as it was.
    """
    path = check_output_file(path, inputs, option)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{path.suffix}", dir=path.parent)
    except OSError as error:
        raise GraftError(f"cannot write {option} {path} ({error.strerror or error})") from error
    os.close(handle)
    temporary = Path(name)
    try:
        yield temporary
        os.replace(temporary, path)
    except OSError as error:
        raise GraftError(f"cannot write {option} {path} ({error.strerror or error})") from error
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()


def write_output_file(path: str | os.PathLike, data: bytes, inputs: Inputs, option: str) -> None:
    """Write ``data`` to ``path`` whole (see :func:`replacing`)."""
    with replacing(path, inputs, option) as temporary:
        temporary.write_bytes(data)
