"""Merge config files read from disk: YAML parsed, mergekit's schema validated, any failure one line naming the file."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import yaml
from mergekit.config import MergeConfiguration
from pydantic import ValidationError

from graftmerge.errors import GraftError
from graftmerge.formats.json_file import TOO_LONG_INTEGER
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


def read_merge_config(config_file: str):
    """(mergekit ``MergeConfiguration``, YAML text) of a config file; GraftError when unreadable."""
    with config_file_errors(config_file):
        with open(config_file, encoding="utf-8") as handle:
            source = handle.read()
        config = MergeConfiguration.model_validate(yaml.safe_load(source))
    return config, source


def check_yaml_documents(config_file: str) -> None:
    """``config_file`` (a ``mergekit-multi`` file: several YAML documents) parses; GraftError naming it otherwise."""
    with config_file_errors(config_file), open(config_file, encoding="utf-8") as handle:
        for _ in yaml.safe_load_all(handle.read()):
            pass


def read_graft_config(config_file: str):
    """(config, YAML text, validated GraftPlan) of a graft config; GraftError for any other method."""
    config, source = read_merge_config(config_file)
    if config.merge_method != "graft":
        raise GraftError(f"{config_file}: merge_method is {config.merge_method!r}; this command needs a graft config")
    return config, source, plan_from_merge_config(config)
