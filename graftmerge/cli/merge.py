"""``graftmerge merge CONFIG OUT``: the explicit equivalent of ``mergekit-yaml``.

Takes every mergekit-yaml option (they come from mergekit's own option model).
"""

from __future__ import annotations

import click
from mergekit.options import MergeOptions, add_merge_options

from graftmerge.adapter import import_hook


@click.command("merge")
@click.argument("config_file", type=click.Path(dir_okay=False))
@click.argument("out_path", type=click.Path(file_okay=False))
@click.option("--no-threshold-cache", is_flag=True,
              help="Compute the global mask threshold afresh, without reading or writing the threshold cache "
                   "(for inputs edited in place; for mergekit-yaml set GRAFTMERGE_NO_THRESHOLD_CACHE=1).")
@add_merge_options
def merge(merge_options: MergeOptions, config_file: str, out_path: str, no_threshold_cache: bool) -> None:
    """Run a merge config (graft or any mergekit method) and write the model to OUT_PATH.

    Same as `mergekit-yaml CONFIG_FILE OUT_PATH`: graft configs are validated
    completely, and the global mask threshold computed, before any tensor is
    merged; a failed graft leaves nothing in OUT_PATH.
    """
    import_hook.install()
    # lazy: after install(), so run_merge is the hook's wrapped one; mergekit's merge code skipped by --help
    from mergekit.merge import run_merge

    from graftmerge.formats.output_folder import check_not_inputs
    from graftmerge.pipeline.config_files import read_merge_config
    merge_options.apply_global_options()
    config, source = read_merge_config(config_file)
    check_not_inputs(out_path, [("merge config", config_file)])  # OUT, replaced whole, may not hold the config
    # run_merge as mergekit-yaml runs it: the hook's wrappers read cached Hub ids from the local HF cache
    settings = {"use_threshold_cache": False} if no_threshold_cache and config.merge_method == "graft" else {}
    run_merge(config, out_path, options=merge_options, config_source=source, **settings)
