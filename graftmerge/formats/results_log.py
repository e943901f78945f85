"""An append-only JSON Lines file that survives a kill: what a long run has finished, one record per line.

Each record is written as one line, then flushed and fsynced before the run goes on, so a
killed run loses at most the record it was writing. That record is a torn last line (no
newline, or not JSON): :func:`read_log` leaves it out and :class:`ResultsLog` cuts it off
before appending again. A bad line anywhere else is not a kill's doing: one-line GraftError.
Non-finite numbers are written as ``null`` (JSON has no NaN) and come back as NaN.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from graftmerge.errors import GraftError
from graftmerge.formats.json_file import MAX_JSON_BYTES, parse_json_bytes


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


def read_log(path: Path) -> tuple[list[dict], int]:
    """(the complete records, the byte length they take); a torn last line is left out.

    GraftError for a file too large, or a line before the last that is not a JSON object.
    """
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise GraftError(f"{path} is {size:,} bytes, more than a results log may be ({MAX_JSON_BYTES:,})")
        raw = path.read_bytes()
    except OSError as error:
        raise GraftError(f"cannot read {path} ({error.strerror})") from error
    records, end = [], 0
    lines = raw.split(b"\n")
    for number, line in enumerate(lines[:-1], 1):  # every line that ends in a newline
        try:
            record = parse_json_bytes(line, str(path), f"line {number}")
        except GraftError:
            if number == len(lines) - 1 and not lines[-1]:
                break  # the last line: torn by a kill
            raise
        if not isinstance(record, dict):
            raise GraftError(f"{path}: line {number} is not a JSON object")
        records.append(record)
        end += len(line) + 1
    return records, end


class ResultsLog:
    """Append records to a log (creating it), each one on disk before :meth:`append` returns.

    Opening cuts off a torn last line, so the next record starts on a line of its own.
    """

    def __init__(self, path: Path):
        self.path = path
        self.records, end = read_log(path) if path.exists() else ([], 0)
        self._file = open(path, "ab")  # noqa: SIM115 - held open for the run, closed by close()
        if self._file.tell() != end:
            self._file.truncate(end)
            self._file.seek(end)
            os.fsync(self._file.fileno())

    def append(self, record: dict) -> None:
        """Write ``record`` as one line, flushed and fsynced."""
        self._file.write(record_line(record))
        self._file.flush()
        os.fsync(self._file.fileno())
        self.records.append(record)

    def close(self) -> None:
        """Close the file (every record is already on disk)."""
        self._file.close()

    def __enter__(self) -> ResultsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
