"""``graftmerge merge CONFIG OUT``: the explicit equivalent of ``mergekit-yaml``.

Takes every mergekit-yaml option (they come from mergekit's own option model).
"""

from __future__ import annotations

import click
import yaml
from mergekit.options import MergeOptions, add_merge_options
from pydantic import ValidationError

from graftmerge import _import_hook
from graftmerge.errors import GraftError


@click.command("merge")
@click.argument("config_file", type=click.Path(dir_okay=False))
@click.argument("out_path", type=click.Path(file_okay=False))
@add_merge_options
def merge(merge_options: MergeOptions, config_file: str, out_path: str) -> None:
    """Run a merge config (graft or any mergekit method) and write the model to OUT_PATH.

    Same as `mergekit-yaml CONFIG_FILE OUT_PATH`: graft configs are validated
    completely, and the global mask threshold computed, before any tensor is
    merged; a failed graft leaves nothing in OUT_PATH.
    """
    _import_hook.install()
    from mergekit.merge import run_merge

    from graftmerge.hub.models import localize_models

    merge_options.apply_global_options()
    config, source = read_merge_config(config_file)
    # Hub-id models from the local HF cache (mergekit cannot resolve them offline).
    run_merge(localize_models(config), out_path, options=merge_options, config_source=source)


def read_merge_config(config_file: str):
    """(mergekit ``MergeConfiguration``, YAML text) of a config file; GraftError when unreadable."""
    from mergekit.config import MergeConfiguration

    try:
        with open(config_file, encoding="utf-8") as handle:
            source = handle.read()
        config = MergeConfiguration.model_validate(yaml.safe_load(source))
    except OSError as error:
        raise GraftError(f"{config_file}: cannot read ({error.strerror})") from error
    except yaml.YAMLError as error:
        raise GraftError(f"{config_file}: not valid YAML ({str(error).splitlines()[0]})") from error
    except (ValidationError, RuntimeError) as error:
        first = str(error).strip().splitlines()
        raise GraftError(f"{config_file}: not a valid merge config ({' '.join(first[:3])})") from error
    return config, source


def read_graft_config(config_file: str):
    """(config, YAML text, validated GraftPlan) of a graft config; GraftError for any other method."""
    from graftmerge.graft_plan import plan_from_merge_config

    config, source = read_merge_config(config_file)
    if config.merge_method != "graft":
        raise GraftError(f"{config_file}: merge_method is {config.merge_method!r}; this command needs a graft config")
    return config, source, plan_from_merge_config(config)
