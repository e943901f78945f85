"""Merge config files read from disk: YAML parsed, mergekit's schema validated, any failure one line naming the file."""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator
from typing import Any

import yaml
from mergekit.config import InputModelDefinition, MergeConfiguration
from pydantic import ValidationError

from graftmerge.errors import GraftError
from graftmerge.formats.json_file import TOO_LONG_INTEGER
from graftmerge.pipeline import data_aware_plan, graft_plan
from graftmerge.pipeline.graft_plan import plan_from_merge_config


@contextlib.contextmanager
def config_file_errors(config_file: str) -> Iterator[None]:
    """Reading or parsing ``config_file`` inside the block: any failure becomes one GraftError line naming it."""
    try:
        yield
    except OSError as error:
        raise GraftError(f"{config_file}: cannot read ({error.strerror})") from error
    except yaml.YAMLError as error:
        raise GraftError(f"{config_file}: not valid YAML ({str(error).splitlines()[0]})") from error
    except (RecursionError, MemoryError) as error:
        raise GraftError(f"{config_file}: not a valid merge config (nested too deeply or too large to read)") from error
    except (ValidationError, RuntimeError) as error:
        first = str(error).strip().splitlines()
        raise GraftError(f"{config_file}: not a valid merge config ({' '.join(first[:3])})") from error
    except UnicodeDecodeError as error:
        raise GraftError(f"{config_file}: not a valid merge config (not UTF-8 text)") from error
    except ValueError as error:  # yaml's int(): an integer past Python's int/str conversion limit
        raise GraftError(f"{config_file}: not a valid merge config ({TOO_LONG_INTEGER})") from error


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
    with config_file_errors(config_file):
        with open(config_file, encoding="utf-8") as handle:
            source = handle.read()
        data = yaml.safe_load(source)
    check_config_keys(data, config_file)  # a GraftError of its own (config_file_errors would reword it)
    with config_file_errors(config_file):
        config = MergeConfiguration.model_validate(data)
    return config, source


def check_yaml_documents(config_file: str) -> None:
    """``config_file`` (a ``mergekit-multi`` file: several YAML documents) parses, and its graft, fisher and
    regmean documents name only keys mergekit reads; GraftError naming it otherwise."""
    with config_file_errors(config_file), open(config_file, encoding="utf-8") as handle:
        documents = list(yaml.safe_load_all(handle.read()))
    for data in documents:
        check_config_keys(data, config_file, extra=("name",))  # mergekit-multi's own key


def read_graft_config(config_file: str):
    """(config, YAML text, validated GraftPlan) of a graft config; GraftError for any other method."""
    config, source = read_merge_config(config_file)
    if config.merge_method != "graft":
        raise GraftError(f"{config_file}: merge_method is {config.merge_method!r}; this command needs a graft config")
    return config, source, plan_from_merge_config(config)
