"""``sweep --eval``'s results log (DIR/results.jsonl), read back by one reader that checks every record.

A resumed sweep uses what it reads back as if it had just scored it: a point's record decides
the choice, θpost's is the bar every point is held to. So each line is checked before use:
the first is the header of *this* sweep (same config, grid, tasks, inputs and settings); each
other is θpost's or a grid point's record with exactly the fields the sweep writes, of the
types it writes: splits from {validation, test}, raw scores finite numbers, normalised role
scores in [0, 1], ``null`` (NaN) only in a record that says why in ``error``, a point on the
header's grid. A record repeated word for word (a log copied onto itself) counts once; two
different records of one point are refused, since either could be the real one.

Torn lines: a kill can leave only the line being written unfinished, without its newline, so
only that is dropped (and only when it begins as a record does). A log with no complete line
is this sweep's own start torn by a kill only when its bytes begin this sweep's header;
anything else (another program's file, a sweep of other settings) is refused and left as it is.
Every refusal is one line naming the file and line and what to do.
"""

from __future__ import annotations

import math
from pathlib import Path

from graftmerge.errors import GraftError
from graftmerge.formats.json_file import parse_json_bytes
from graftmerge.formats.results_log import complete_lines, record_line

FORMAT = 1
SPLITS = ("validation", "test")
ROLES = ("old", "new")
HEADER_FIELDS = {
    "format": "results format", "config_sha256": "graft config (sha256 of the config file)",
    "grid": "grid", "tasks_sha256": "task file or task data (fingerprint)",
    "inputs_sha256": "input files (a model or Fisher file changed since)", "settings": "evaluation settings",
}
RECORD_FIELDS = {"post": ("kind", "splits", "scores", "roles", "seconds"),
                 "point": ("kind", "lambda", "rho", "splits", "scores", "roles", "seconds")}
OPTIONAL_FIELDS = ("error", "trial", "layers", "rho_layers", "config")  # a search's: trial, anchors, config
SEARCH_FIELD = "search"  # a search's header: its space, seed and sampler (the grid: the values its trials took)
TORN_START = b'{"kind": "po'  # every record line begins so ("post" or "point"); a torn one begins as much of it


def check_same_sweep(found: dict, expected: dict, path: Path) -> None:
    """GraftError naming the first field in which results.jsonl's header differs from this sweep's."""
    for field, what in HEADER_FIELDS.items():
        if found.get(field) != expected[field]:
            detail = f": {found.get(field)} there, {expected[field]} here" if field in ("grid", "settings") else ""
            raise GraftError(f"{path} is the log of another sweep (its {what} differs{detail}); give the same "
                             "config, grid, tasks and settings to resume it, or choose another output folder")
    if found.get(SEARCH_FIELD) != expected.get(SEARCH_FIELD):
        raise GraftError(f"{path} is the log of another search or of a sweep (its search space, seed or sampler "
                         "differs); choose another output folder")
    extra = sorted(set(found) - set(HEADER_FIELDS) - {"kind", SEARCH_FIELD})
    if extra:
        raise GraftError(f"{path}, line 1: the header has a field {extra[0]!r} no sweep writes; the log was edited: "
                         "choose another output folder")


def record_key(record: dict) -> tuple:
    """(kind, λ, ρ, splits, per-layer λ, trial): what a record finished (a search's trial: its number and anchors
    too, since two trials may ask for the same point)."""
    layers = record.get("layers")
    return (record["kind"], record.get("lambda"), record.get("rho"), tuple(record["splits"]),
            tuple(layers) if isinstance(layers, list) else None, record.get("trial"))


def _number(value) -> bool:
    """Whether ``value`` is a JSON number (not a boolean) that is finite."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _score_problem(value, normalised: bool) -> str | None:
    """What is wrong with one score (None: a finite number, in [0, 1] when ``normalised``; ``null`` is NaN)."""
    if value is None:
        return None
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    if not _number(value):
        return f"{shown} is not a number"
    if normalised and not 0 <= value <= 1:
        return f"{shown} is outside [0, 1], where every normalised score lies"
    return None


def _splits_problem(record: dict) -> str | None:
    """What is wrong with a record's ``splits`` (θpost: both; a point: one)."""
    splits = record["splits"]
    if not isinstance(splits, list) or not all(isinstance(split, str) for split in splits):
        return "'splits' is not a list of split names"
    wanted = [list(SPLITS)] if record["kind"] == "post" else [[split] for split in SPLITS]
    if splits not in wanted:
        return f"'splits' is {splits}, which a sweep never scores a {record['kind']} on"
    return None


def _scores_problem(record: dict) -> str | None:
    """What is wrong with a record's raw ``scores`` ({task: {split: number or null}}) and ``roles``."""
    scores, roles, splits = record["scores"], record["roles"], record["splits"]
    if not isinstance(scores, dict) or not all(isinstance(v, dict) for v in scores.values()):
        return "'scores' is not an object of tasks, each an object of splits"
    for task, values in scores.items():
        for split, value in values.items():
            problem = f"split {split!r} was not scored" if split not in splits else _score_problem(value, False)
            if problem:
                return f"the score of task {task!r} ({split}): {problem}"
    if not isinstance(roles, dict) or sorted(roles) != sorted(splits) or not all(
            isinstance(v, dict) and set(v) <= set(ROLES) for v in roles.values()):
        return f"'roles' is not an object of the splits {splits}, each of the roles old and new"
    for split, values in roles.items():
        for role, value in values.items():
            problem = _score_problem(value, True)
            if problem:
                return f"the {role}-role score ({split}): {problem}"
    return None


def _record_problem(record, grid: dict) -> str | None:
    """What is wrong with one record (not the header) in words; None when it is one the sweep writes."""
    if not isinstance(record, dict):
        return "it is not a JSON object"
    kind = record.get("kind")
    if kind not in RECORD_FIELDS:
        return "a second header" if kind == "header" else f"'kind' is {kind!r}, not post or point"
    missing = [field for field in RECORD_FIELDS[kind] if field not in record]
    unknown = sorted(set(record) - set(RECORD_FIELDS[kind]) - set(OPTIONAL_FIELDS))
    if missing or unknown:
        return f"the field {missing[0]!r} is missing" if missing else f"the field {unknown[0]!r} is no sweep's"
    if kind == "point":
        if "trial" in record and not (isinstance(record["trial"], int) and not isinstance(record["trial"], bool)
                                      and record["trial"] >= 0):
            return "'trial' is not a trial number"
        if "layers" in record and not (isinstance(record["layers"], list) and record["layers"]
                                       and all(_number(v) and v >= 0 for v in record["layers"])):
            return "'layers' is not a list of per-layer λ anchors"
        if "rho_layers" in record and not (isinstance(record["rho_layers"], list) and record["rho_layers"]
                                           and all(_number(v) and 0 <= v < 1 for v in record["rho_layers"])):
            return "'rho_layers' is not a list of per-layer ρ anchors"
        if "config" in record and not (isinstance(record["config"], int) and not isinstance(record["config"], bool)
                                       and record["config"] >= 0):
            return "'config' is not the index of a searched config"
        if not (_number(record["lambda"]) and _number(record["rho"])):
            return "'lambda' and 'rho' must be numbers"
        if record["lambda"] not in grid["lambda"] or record["rho"] not in grid["rho"]:
            return f"the point λ {record['lambda']}, ρ {record['rho']} is not on this sweep's grid"
    problem = _splits_problem(record) or _scores_problem(record)
    if problem:
        return problem
    if not (_number(record["seconds"]) and record["seconds"] >= 0):
        return "'seconds' is not a number of seconds"
    if "error" in record and not (isinstance(record["error"], str) and record["error"]):
        return "'error' is not a message"
    if "error" not in record and _has_null(record):
        return "a score is null (NaN) but the record has no 'error' saying so"
    return None


def _has_null(record: dict) -> bool:
    """Whether any score or role score of ``record`` is ``null`` (NaN as written)."""
    return any(value is None for part in ("scores", "roles") for values in record[part].values()
               for value in values.values())


def _refuse(path: Path, line: int, problem: str) -> GraftError:
    """The one-line error for a bad record: where, what, and what to do."""
    return GraftError(f"{path}, line {line}: {problem}; no sweep writes such a record (the log was edited or "
                      "damaged): delete that line to score it again, or choose another output folder")


def _header(line: bytes, path: Path, expected: dict) -> dict:
    """The first line, checked to be this sweep's header."""
    try:
        found = parse_json_bytes(line, f"{path}, line 1", "results log")
    except GraftError as error:
        raise GraftError(f"{error}; it is no sweep's log and is left as it is: choose another output folder") from None
    if not isinstance(found, dict) or found.get("kind") != "header":
        raise GraftError(f"{path}: the first line is not a sweep's header, so this is no log of graftmerge's; it "
                         "is left as it is: choose another output folder")
    check_same_sweep(found, expected, path)
    return found


def parse_sweep_log(raw: bytes, path: Path, expected: dict) -> tuple[list[dict], int]:
    """(the header and each distinct record, in order; the bytes kept), every record checked (module doc).

    ``expected``: this sweep's header. No records (and 0 kept) for an empty log or a header torn by a kill.
    """
    lines, torn = complete_lines(raw)
    if not lines:
        if not record_line(expected).startswith(raw):
            raise GraftError(f"{path} holds no complete line and is not the start of this sweep's log; it is left "
                             "as it is: choose another output folder")
        return [], 0
    records = [_header(lines[0], path, expected)]
    if torn and not (torn.startswith(TORN_START) or TORN_START.startswith(torn)):
        raise _refuse(path, len(lines) + 1, "the last line has no newline and does not begin as a record does")
    seen: dict[tuple, tuple[int, dict]] = {}
    for number, line in enumerate(lines[1:], 2):
        try:
            record = parse_json_bytes(line, f"{path}, line {number}", "results log record")
        except GraftError as error:
            raise GraftError(f"{error}; delete that line to score it again, or choose another output folder") from None
        problem = _record_problem(record, expected["grid"])
        if problem:
            raise _refuse(path, number, problem)
        key = record_key(record)
        if key in seen:
            if seen[key][1] != record:
                raise GraftError(f"{path}, lines {seen[key][0]} and {number}: two different records of the same "
                                 f"{'point' if key[0] == 'point' else 'θpost'} on {'+'.join(key[3])}, so neither "
                                 "can be trusted; delete both lines to score it again, or choose another output folder")
            continue  # the same record twice: counted once
        seen[key] = (number, record)
        records.append(record)
    return records, len(raw) - len(torn)
