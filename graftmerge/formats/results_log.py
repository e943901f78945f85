"""An append-only JSON Lines file that survives a kill: what a long run has finished, one record per line.

Each record is written as one line, then flushed and fsynced before the run goes on, so a
killed run loses at most the record it was writing: a torn last line, without its newline.
What the lines mean, and which torn line may be cut off, is the caller's ``parse``: one
function that reads the whole file and checks every record (for ``sweep --eval``,
:mod:`graftmerge.formats.sweep_log`). The file is opened without following a link, and
must be a regular file of one link owned by this user: a log is never written through a
symbolic or hard link into someone else's file. Non-finite numbers are written as
``null`` (JSON has no NaN).
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from graftmerge.errors import GraftError
from graftmerge.formats.json_file import MAX_JSON_BYTES

# (the whole file's bytes, its path) → (its records, the byte length of what is kept); GraftError when bad
Parse = Callable[[bytes, Path], tuple[list[dict], int]]


def _finite_or_null(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (nested dicts and lists)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_null(item) for item in value]
    return value


def record_line(record: dict) -> bytes:
    """One record as the bytes of its line (NaN and infinities as ``null``)."""
    return (json.dumps(_finite_or_null(record), allow_nan=False, ensure_ascii=False) + "\n").encode()


def complete_lines(raw: bytes) -> tuple[list[bytes], bytes]:
    """(every line that ends in a newline, without it; what follows the last newline: a torn line or b"")."""
    lines = raw.split(b"\n")
    return lines[:-1], lines[-1]


def _open_log(path: Path, create: bool) -> int | None:
    """A descriptor of the log, opened for appending without following a link; None when absent and not created.

    GraftError unless it is a regular file with one link, owned by this user, and small enough.
    """
    flags = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        if create:
            raise GraftError(f"cannot create {path}: its folder is gone") from None
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise GraftError(f"{path} is a symbolic link; graftmerge never writes a results log through a link: "
                             "remove the link or choose another output folder") from error
        raise GraftError(f"cannot open {path} ({error.strerror}); choose another output folder") from error
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or info.st_uid != os.getuid():
        os.close(fd)
        raise GraftError(f"{path} is not a results log of yours (a special file, a hard link or another user's); "
                         "graftmerge never writes through one: remove it or choose another output folder")
    if info.st_size > MAX_JSON_BYTES:
        os.close(fd)
        raise GraftError(f"{path} is {info.st_size:,} bytes, more than a results log may be ({MAX_JSON_BYTES:,})")
    return fd


def _read_all(fd: int) -> bytes:
    """Everything in the open file, from its start."""
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def read_log(path: Path, parse: Parse) -> list[dict] | None:
    """The log's records as ``parse`` checks them (nothing is changed); None when there is no log."""
    fd = _open_log(path, create=False)
    if fd is None:
        return None
    try:
        records, _ = parse(_read_all(fd), path)
    finally:
        os.close(fd)
    return records


class ResultsLog:
    """Append records to a log (creating it), each one on disk before :meth:`append` returns.

    Opening reads the log through ``parse`` and cuts off what it does not keep (a torn last
    line), so the next record starts on a line of its own. :attr:`records`: those kept.
    """

    def __init__(self, path: Path, parse: Parse):
        self.path = path
        self._fd = _open_log(path, create=True)
        try:
            raw = _read_all(self._fd)
            self.records, end = parse(raw, path)
            if end != len(raw):
                os.ftruncate(self._fd, end)
                os.fsync(self._fd)
        except BaseException:
            os.close(self._fd)
            raise

    def append(self, record: dict) -> None:
        """Write ``record`` as one line, fsynced."""
        data = record_line(record)
        while data:
            data = data[os.write(self._fd, data):]
        os.fsync(self._fd)
        self.records.append(record)

    def close(self) -> None:
        """Close the file (every record is already on disk)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ResultsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
