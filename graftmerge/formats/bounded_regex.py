"""Regular expressions from untrusted configs, matched in time linear in the name.

PEFT matches ``target_modules``, ``exclude_modules``, ``rank_pattern``, ``alpha_pattern``
and ``layers_pattern`` with Python's ``re``, a backtracking engine: a pattern such as
``(a|aa)*b`` or ``(.*\\.)*x`` takes exponential time on a name it almost matches, and an
adapter_config.json is untrusted input. Here the pattern keeps Python's meaning and runs
on RE2 (``google-re2``), whose time is linear in the name for every pattern it accepts:

1. Python's own parser reads the pattern (what Python refuses is refused, one line);
2. the parse tree is written out again in RE2's syntax. Every class of characters (a
   literal under ``(?i)``, ``[...]``, ``\\d``, ``.``...) is written as the exact set of
   name characters Python's ``re`` matches with it, so no difference between the two
   engines' flags, classes or case folding can change an answer;
3. what RE2 cannot run in linear time has no translation and is refused, one line
   naming the field and the pattern: backreferences, lookahead / lookbehind,
   conditional groups, atomic groups and possessive quantifiers; so is a pattern
   longer than :data:`MAX_PATTERN` characters or one RE2 will not compile (repetition
   counts above 1000, a program over its memory bound).

Names are module names: printable ASCII without spaces (``!`` to ``~``), at most
:data:`MAX_NAME` characters; on such names Python's ``$`` (end, or before a final
newline) and ``^`` are RE2's, and ``\\b`` / ``\\B`` agree. Another name is refused in one
line rather than matched by a rule that might differ from PEFT's.
"""

from __future__ import annotations

import functools
import importlib
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import re2

from graftmerge.errors import GraftError

# Python's own regex parser and compiler (``re._parser`` since 3.11, ``sre_parse`` before).
_STDLIB = ("re._{}" if sys.version_info >= (3, 11) else "sre_{}").format
sre_compile = importlib.import_module(_STDLIB("compiler" if sys.version_info >= (3, 11) else "compile"))
sre_constants = importlib.import_module(_STDLIB("constants"))
sre_parse = importlib.import_module(_STDLIB("parser" if sys.version_info >= (3, 11) else "parse"))

MAX_PATTERN = 100_000  # an explicit alternation of every module of a 400-layer model fits; ~1 s to compile
MAX_NAME = 1_000
SHOWN = 200  # characters of a pattern a message shows
NAME_CHARACTERS = tuple(chr(code) for code in range(0x21, 0x7F))  # what a module name is made of
_PLAIN_NAME = re.compile(r"[!-~]+")
_NOT_LINEAR = {
    "GROUPREF": "a backreference", "GROUPREF_EXISTS": "a conditional group (?(...)...)",
    "ASSERT": "a lookahead or lookbehind", "ASSERT_NOT": "a lookahead or lookbehind",
    "ATOMIC_GROUP": "an atomic group (?>...)", "POSSESSIVE_REPEAT": "a possessive quantifier",
}
_ANCHORS = {"AT_BEGINNING": "^", "AT_BEGINNING_STRING": "^", "AT_END": "$", "AT_END_STRING": "$",
            "AT_BOUNDARY": r"\b", "AT_NON_BOUNDARY": r"\B"}
_MEMORY = 8 << 20


class Unsupported(Exception):
    """A pattern Python accepts that has no linear-time translation (the reason in words)."""


@dataclass(frozen=True)
class BoundedRegex:
    """A Python pattern translated to RE2: ``regex`` (RE2), its capture groups by Python's names."""

    source: str
    regex: Any
    groups: dict[str, str]


def check_pattern(source: str, where: str, what: str, captures: bool = False) -> BoundedRegex:
    """``source`` (Python syntax) compiled for linear-time matching, or one GraftError line.

    ``where`` names the config file, ``what`` the field and the pattern as the user wrote it
    (cut to :data:`SHOWN` characters in a message).
    """
    what = what if len(what) <= SHOWN else what[:SHOWN] + "..."
    if not isinstance(source, str) or len(source) > MAX_PATTERN:
        raise GraftError(f"{where}: {what} is longer than {MAX_PATTERN} characters; graftmerge refuses it "
                         "(a pattern that long could take unbounded time to match)")
    try:
        return _translated(source, captures)
    except (re.error, OverflowError) as error:
        raise GraftError(f"{where}: {what} is not a valid regular expression ({error})") from None
    except RecursionError:
        raise GraftError(f"{where}: {what} nests groups too deeply to be parsed; graftmerge refuses it") from None
    except Unsupported as error:
        raise GraftError(f"{where}: {what} is not supported: {error}; graftmerge matches adapter patterns "
                         "in linear time (RE2) and refuses what could run unboundedly") from None


def pattern_match(source: str, name: str, where: str, what: str) -> dict[str, str | None] | None:
    """``re.match(source, name)``: the named groups of a match at the start of ``name``, or None."""
    compiled = check_pattern(source, where, what, captures=True)
    found = compiled.regex.match(_checked_name(name, where, what))
    if found is None:
        return None
    return {key: None if found.group(group) is None else found.group(group).decode() for key, group in
            compiled.groups.items()}


def pattern_fullmatch(source: str, name: str, where: str, what: str) -> bool:
    """``re.fullmatch(source, name) is not None``, in time linear in ``name``."""
    return check_pattern(source, where, what).regex.fullmatch(_checked_name(name, where, what)) is not None


def pattern_matches_start(source: str, name: str, where: str, what: str) -> bool:
    """``re.match(source, name) is not None``, in time linear in ``name``."""
    return check_pattern(source, where, what).regex.match(_checked_name(name, where, what)) is not None


def _checked_name(name: str, where: str, what: str) -> bytes:
    """``name`` as bytes (RE2's fast path) if it is a plain module name, the only names the translation is exact on."""
    if len(name) > MAX_NAME or not _PLAIN_NAME.fullmatch(name):
        what = what if len(what) <= SHOWN else what[:SHOWN] + "..."
        shown = name[:80] + ("..." if len(name) > 80 else "")
        raise GraftError(f"{where}: module name {shown!r} is not printable ASCII of at most {MAX_NAME} "
                         f"characters without spaces; graftmerge matches {what} only on such names")
    return name.encode("ascii")


@functools.lru_cache(maxsize=4096)
def _translated(source: str, captures: bool) -> BoundedRegex:
    """The RE2 regex that matches exactly the names Python's ``re`` matches with ``source``."""
    parsed = sre_parse.parse(source)
    flags = parsed.state.flags
    text = _emit(list(parsed), flags, captures)
    options = re2.Options()
    options.log_errors = False
    options.max_mem = _MEMORY
    options.never_capture = not captures
    try:
        regex = re2.compile(text, options)
    except re2.error as error:
        reason = error.args[0].decode(errors="replace") if error.args and isinstance(error.args[0], bytes) else error
        raise Unsupported(f"RE2 cannot compile it ({reason})") from None
    names = parsed.state.groupdict if captures else {}
    return BoundedRegex(source=source, regex=regex, groups={name: f"g{group}" for name, group in names.items()})


def _emit(nodes: Sequence[tuple[Any, Any]], flags: int, captures: bool) -> str:
    """RE2 syntax for a sequence of Python parse-tree nodes under ``flags``."""
    return "".join(_emit_node(op, value, flags, captures) for op, value in nodes)


def _emit_node(op: Any, value: Any, flags: int, captures: bool) -> str:
    """RE2 syntax for one Python parse-tree node; Unsupported for what has no linear-time equivalent."""
    name = getattr(op, "name", str(op))
    if name in ("LITERAL", "NOT_LITERAL", "ANY", "IN"):
        return _character_class(op, value, flags)
    if name == "AT" and getattr(value, "name", None) in _ANCHORS:
        return _ANCHORS[value.name]
    if name == "BRANCH":
        return "(?:" + "|".join(_emit(list(item), flags, captures) for item in value[1]) + ")"
    if name == "SUBPATTERN":
        group, add_flags, del_flags, body = value
        inner = _emit(list(body), (flags | add_flags) & ~del_flags, captures)
        return f"(?P<g{group}>{inner})" if captures and group is not None else f"(?:{inner})"
    if name in ("MAX_REPEAT", "MIN_REPEAT"):
        low, high, body = value
        count = f"{{{low},}}" if high == sre_constants.MAXREPEAT else f"{{{low},{high}}}"
        return f"(?:{_emit(list(body), flags, captures)}){count}" + ("?" if name == "MIN_REPEAT" else "")
    if name in _NOT_LINEAR:
        raise Unsupported(f"it uses {_NOT_LINEAR[name]}, which RE2, a linear-time matcher, cannot express")
    raise Unsupported(f"it uses {name} {value!r}, which has no linear-time equivalent here")


def _character_class(op: Any, value: Any, flags: int) -> str:
    """The exact set of name characters one character node matches under ``flags``, as an RE2 class."""
    if op == sre_constants.LITERAL and not flags & re.IGNORECASE:
        members = (chr(value),) if 0x21 <= value <= 0x7E else ()
    else:
        members = _members(op, tuple(value) if isinstance(value, list) else value, flags)
    if not members:
        return r"[^\x00-\x{10FFFF}]"
    if len(members) == 1:
        return f"\\x{{{ord(members[0]):x}}}"
    runs: list[list[int]] = []
    for code in map(ord, members):
        if runs and runs[-1][1] == code - 1:
            runs[-1][1] = code
        else:
            runs.append([code, code])
    return "[" + "".join(f"\\x{{{a:x}}}" + (f"-\\x{{{b:x}}}" if b > a else "") for a, b in runs) + "]"


@functools.lru_cache(maxsize=4096)
def _members(op: Any, value: Any, flags: int) -> tuple[str, ...]:
    """The name characters Python's ``re`` matches with the one node ``(op, value)``, asked of ``re`` itself."""
    state = sre_parse.State()
    state.flags = flags
    value = list(value) if isinstance(value, tuple) else value
    single = sre_compile.compile(sre_parse.SubPattern(state, [(op, value)]))
    return tuple(character for character in NAME_CHARACTERS if single.fullmatch(character))
