"""Small JSON files of an artifact (manifests, shard indexes), read defensively.

A manifest may come from a stranger (the Hub). Its size is capped before it is
parsed, each key may appear once per object, and nesting is capped (checked
without recursion), so a hostile file gives one line naming it instead of a
MemoryError, a RecursionError, a ValueError (an integer past Python's 4300-digit
conversion limit) or a silently dropped duplicate.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from graftmerge.errors import GraftError

MAX_JSON_BYTES = 64 * 1024 * 1024  # a 0.6B model's Fisher manifest is ~100 KB
MAX_JSON_DEPTH = 32  # manifests nest 5 levels deep; free-form records a few more
# What a parser's ValueError from int() means: Python refuses to convert longer digit strings.
TOO_LONG_INTEGER = f"an integer of more than {sys.get_int_max_str_digits()} digits"


class DuplicateKeyError(ValueError):
    """A JSON object names one key twice (``json`` would keep the last one silently)."""


def refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for json: the object as a dict, or DuplicateKeyError naming the repeated key."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise DuplicateKeyError(key)
        result[key] = value
    return result


def json_depth(value: Any) -> int:
    """How deeply ``value`` nests lists and dicts (a scalar is 0), walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_json_bytes(raw: bytes, where: str, what: str, max_depth: int = MAX_JSON_DEPTH,
                     duplicates_ok: bool = False) -> Any:
    """``raw`` parsed; GraftError ``<where>: corrupt <what> (...)`` for bad JSON, a repeated key or deep nesting.

    ``duplicates_ok``: a repeated key keeps its last value, as ``json`` and transformers read a config.json.
    """
    try:
        value = json.loads(raw, object_pairs_hook=None if duplicates_ok else refuse_duplicate_keys)
    except DuplicateKeyError as error:
        raise GraftError(f"{where}: corrupt {what} (key {error.args[0]!r} appears twice in one object)") from error
    except json.JSONDecodeError as error:
        raise GraftError(f"{where}: corrupt {what} (not JSON: {error})") from error
    except UnicodeDecodeError as error:
        raise GraftError(f"{where}: corrupt {what} (not UTF-8 text)") from error
    except RecursionError as error:
        raise GraftError(f"{where}: corrupt {what} (nested deeper than {max_depth} levels)") from error
    except ValueError as error:  # json's int(): an integer past Python's int/str conversion limit
        raise GraftError(f"{where}: corrupt {what} ({TOO_LONG_INTEGER})") from error
    except MemoryError as error:
        raise GraftError(f"{where}: corrupt {what} (too large to parse in memory)") from error
    if json_depth(value) > max_depth:
        raise GraftError(f"{where}: corrupt {what} (nested deeper than {max_depth} levels)")
    return value


def load_json_file(file: Path, what: str, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH,
                   duplicates_ok: bool = False) -> Any:
    """``file`` parsed as JSON, its size checked before it is read; GraftError naming it otherwise."""
    try:
        size = file.stat().st_size
        if size > max_bytes:
            raise GraftError(f"{file}: {what} is {size} bytes, over the {max_bytes}-byte limit (not a {what})")
        raw = file.read_bytes()
    except OSError as error:
        raise GraftError(f"{file}: cannot read {what} ({error.strerror})") from error
    return parse_json_bytes(raw, str(file), what, max_depth, duplicates_ok)
