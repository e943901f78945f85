"""YAML the user hands us (merge configs, tasks files): parsed within bounds, any failure one line naming the file.

One reader for every YAML file: a document nested more than ``MAX_YAML_DEPTH`` deep, or
of more than ``MAX_YAML_NODES`` values once its aliases are expanded (``&a [*b, *b, ...]``
doubles per line: a few lines describe a billion values), is refused before it is built,
so neither the parser nor anything that walks the result (pydantic, a ``repr`` in an error
message) can spend hours or gigabytes on it. Merge configs are then checked against
mergekit's schema.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator
from typing import Any

import yaml
from mergekit.config import InputModelDefinition, MergeConfiguration
from pydantic import ValidationError

from graftmerge.errors import GraftError
from graftmerge.formats.json_file import MAX_JSON_DEPTH, TOO_LONG_INTEGER
from graftmerge.pipeline import data_aware_plan, graft_plan
from graftmerge.pipeline.graft_plan import plan_from_merge_config

MAX_YAML_DEPTH = MAX_JSON_DEPTH  # a merge config nests about 7 deep, a tasks file 4
MAX_YAML_NODES = 100_000  # values after expanding aliases; real configs and tasks files have hundreds


@contextlib.contextmanager
def config_file_errors(config_file: str, what: str = "merge config") -> Iterator[None]:
    """Reading or parsing ``config_file`` (a ``what``) inside the block: any failure becomes one GraftError line."""
    try:
        yield
    except GraftError:
        raise
    except OSError as error:
        raise GraftError(f"{config_file}: cannot read ({error.strerror})") from error
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        line = f":{mark.line + 1}" if mark else ""
        raise GraftError(f"{config_file}{line}: not valid YAML ({error.problem or error.context})") from error
    except yaml.YAMLError as error:
        raise GraftError(f"{config_file}: not valid YAML ({str(error).splitlines()[0]})") from error
    except (RecursionError, MemoryError) as error:
        raise GraftError(f"{config_file}: not a valid {what} (nested too deeply or too large to read)") from error
    except (ValidationError, RuntimeError) as error:
        first = str(error).strip().splitlines()
        raise GraftError(f"{config_file}: not a valid {what} ({' '.join(first[:3])})") from error
    except UnicodeDecodeError as error:
        raise GraftError(f"{config_file}: not a valid {what} (not UTF-8 text)") from error
    except (ValueError, OverflowError) as error:  # yaml's int() past Python's limit; a date such as 2024-13-01
        reason = TOO_LONG_INTEGER if "integer string conversion" in str(error) else str(error).splitlines()[0]
        raise GraftError(f"{config_file}: not a valid {what} ({reason})") from error


def yaml_children(node: yaml.Node) -> list[yaml.Node]:
    """The nodes directly inside ``node`` (a mapping's keys and values)."""
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def check_yaml_size(node: yaml.Node, config_file: str, what: str) -> None:
    """GraftError unless ``node`` nests at most MAX_YAML_DEPTH deep, expands to at most MAX_YAML_NODES values
    and names no key twice in one mapping (YAML would keep the last silently).

    Walked without recursion; an alias is the very node it names, so each node is sized
    once (memoised) while its expansion is counted in full, and an alias inside its own
    anchor (an endless document) is refused too.
    """
    sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (values, depth)
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(node, False)]
    while stack:
        current, children_done = stack.pop()
        key = id(current)
        where = f"{config_file}:{current.start_mark.line + 1}: not a valid {what}"
        if children_done:
            inner = [sizes[id(child)] for child in yaml_children(current)]
            sizes[key] = values, depth = 1 + sum(v for v, _ in inner), 1 + max((d for _, d in inner), default=0)
            open_nodes.discard(key)
            if depth > MAX_YAML_DEPTH:
                raise GraftError(f"{where} (nested more than {MAX_YAML_DEPTH} deep)")
            if values > MAX_YAML_NODES:
                raise GraftError(f"{where} (more than {MAX_YAML_NODES:,} values once its aliases are expanded)")
        elif key not in sizes:
            if key in open_nodes:
                raise GraftError(f"{where} (an alias inside its own anchor: the document never ends)")
            check_distinct_keys(current, config_file)
            open_nodes.add(key)
            stack.append((current, True))
            stack.extend((child, False) for child in yaml_children(current))


def check_distinct_keys(node: yaml.Node, config_file: str) -> None:
    """GraftError naming the line of a key that a mapping ``node`` names twice."""
    if not isinstance(node, yaml.MappingNode):
        return
    seen = set()
    for key, _ in node.value:
        if isinstance(key, yaml.ScalarNode):
            if (key.tag, key.value) in seen:
                raise GraftError(f"{config_file}:{key.start_mark.line + 1}: the key {key.value!r} is given twice "
                                 "in one mapping; keep one")
            seen.add((key.tag, key.value))


def load_yaml_documents(source: str, config_file: str, what: str = "merge config") -> list[tuple[object, yaml.Node]]:
    """(value, node) of every YAML document in ``source``, each checked by :func:`check_yaml_size` before it is built.

    The nodes carry line numbers for messages. GraftError naming ``config_file`` for anything unreadable.
    """
    documents = []
    with config_file_errors(config_file, what):
        loader = yaml.SafeLoader(source)
        try:
            while loader.check_node():
                node = loader.get_node()
                check_yaml_size(node, config_file, what)
                documents.append((loader.construct_document(node), node))
        finally:
            loader.dispose()
    return documents


def load_yaml_file(config_file: str, what: str) -> tuple[object, yaml.Node | None, str]:
    """(value, root node, text) of a one-document YAML file, read within bounds; GraftError naming it otherwise."""
    with config_file_errors(config_file, what), open(config_file, encoding="utf-8") as handle:
        source = handle.read()
    documents = load_yaml_documents(source, config_file, what)
    if len(documents) > 1:
        raise GraftError(f"{config_file}:{documents[1][1].start_mark.line + 1}: a {what} is one YAML document, "
                         "this file has several")
    value, node = documents[0] if documents else (None, None)
    return value, node, source


# The merge methods graftmerge adds, with their parameters: their configs are held to every key being one
# mergekit reads, and a parameter written at the top level is told where it goes.
METHOD_PARAMETERS = {
    "graft": graft_plan.GLOBAL_PARAMETERS,
    **{method: (*data_aware_plan.MODEL_PARAMETERS, *extra)
       for method, extra in data_aware_plan.GLOBAL_PARAMETERS.items()},
}


def _unknown_key(key: Any, known: list[str], place: str, config_file: str, parameters=()) -> GraftError:
    """``key`` named, with the closest of ``known`` when one is close (a misspelling), else all of them."""
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    if key in parameters:
        hint = f"{key} is a parameter of the method: put it under `parameters:`"
    elif close:
        hint = f"did you mean {close[0]}?"
    else:
        hint = f"the keys mergekit reads here: {', '.join(known)}"
    return GraftError(f"{config_file}: unknown key {key}{place} ({hint})")


def check_config_keys(data: Any, config_file: str, extra: tuple[str, ...] = ()) -> None:
    """A graft, fisher or regmean config's top-level and ``models:`` keys are all keys mergekit reads.

    mergekit ignores any other key, so a misspelt ``base_modle:`` would be dropped silently
    and the config refused for lacking ``base_model``; here the misspelt key is named, with
    the closest key mergekit knows. Configs of mergekit's own methods are left as mergekit
    takes them. ``extra``: keys the calling command reads itself (``mergekit-multi``'s ``name``).
    """
    method = data.get("merge_method") if isinstance(data, dict) else None
    if not isinstance(method, str) or method not in METHOD_PARAMETERS:
        return
    top = [*MergeConfiguration.model_fields, *extra]
    for key in data:
        if key not in top:
            raise _unknown_key(key, top, "", config_file, METHOD_PARAMETERS[method])
    entry_keys = list(InputModelDefinition.model_fields)
    models = data.get("models")
    for number, entry in enumerate(models if isinstance(models, list) else [], start=1):
        for key in entry if isinstance(entry, dict) else ():
            if key not in entry_keys:
                raise _unknown_key(key, entry_keys, f" in model {number} of `models:`", config_file,
                                   METHOD_PARAMETERS[method])


def read_merge_config(config_file: str):
    """(mergekit ``MergeConfiguration``, YAML text) of a config file; GraftError when unreadable."""
    data, _, source = load_yaml_file(config_file, "merge config")
    check_config_keys(data, config_file)  # a GraftError of its own (config_file_errors would reword it)
    with config_file_errors(config_file):
        config = MergeConfiguration.model_validate(data)
    return config, source


def check_yaml_documents(config_file: str) -> None:
    """``config_file`` (a ``mergekit-multi`` file: several YAML documents) parses, and its graft, fisher and
    regmean documents name only keys mergekit reads; GraftError naming it otherwise."""
    with config_file_errors(config_file), open(config_file, encoding="utf-8") as handle:
        source = handle.read()
    for data, _ in load_yaml_documents(source, config_file):
        check_config_keys(data, config_file, extra=("name",))  # mergekit-multi's own key


def read_graft_config(config_file: str):
    """(config, YAML text, validated GraftPlan) of a graft config; GraftError for any other method."""
    config, source = read_merge_config(config_file)
    if config.merge_method != "graft":
        raise GraftError(f"{config_file}: merge_method is {config.merge_method!r}; this command needs a graft config")
    return config, source, plan_from_merge_config(config)
