"""mergekit's own commands, ``mergekit-yaml`` and ``mergekit-multi``, held to graftmerge's error contract.

Both are click programs. When the import hook (:mod:`graftmerge.adapter.import_hook`) sees
one imported, :func:`wrap_config_script` wraps its command: the config file is read by
graftmerge's reader first, and any GraftError the command raises, from reading the
config to the last tensor of a graft, is one ``error:`` line and exit 2 (the traceback
with ``-v``). click's own usage errors in these commands are one line too.
"""

from __future__ import annotations

import functools
import sys

from graftmerge.cli.errors import one_line_click_errors, raise_for_cli
from graftmerge.errors import GraftError
from graftmerge.formats.output_folder import check_not_inputs
from graftmerge.pipeline.config_files import check_yaml_documents, read_merge_config


def wrap_config_script(script_module) -> None:
    """``mergekit-yaml`` / ``mergekit-multi``: their config file is read by graftmerge's reader first.

    mergekit parses the YAML itself, where a missing file, bad YAML or an integer past
    Python's 4300-digit limit is a traceback; read first, any of them is one ``error:``
    line and exit 2 (for every merge method: mergekit could not have run such a config).
    A config that reads is then run by mergekit's own command, unchanged; a GraftError
    it raises (a graft merge refusing its inputs) is one ``error:`` line as well.
    """
    command = getattr(script_module, "main", None)
    original = getattr(command, "callback", None)
    if original is None or getattr(original, "_graftmerge_wrapped", False):
        return
    check = check_yaml_documents if script_module.__name__.endswith("multimerge") else read_merge_config

    @functools.wraps(original)
    def callback(*args, **kwargs):
        """Read the config with graftmerge's checks, then run mergekit's command (docstring: the original's)."""
        try:
            check(kwargs["config_file"])
            for out in (kwargs.get("out_path"), kwargs.get("intermediate_dir")):  # never holding the config file
                if out is not None:
                    check_not_inputs(out, [("merge config", kwargs["config_file"])])
            return original(*args, **kwargs)
        except GraftError as error:
            raise_for_cli(error, verbose=_verbosity(kwargs) > 0)

    callback._graftmerge_wrapped = True
    command.callback = callback
    _one_line_usage_errors(command)


def _verbosity(kwargs: dict) -> int:
    """mergekit's ``-v`` count among the command's arguments: raw (the callback is mergekit's option wrapper,
    which builds MergeOptions from them), or already in MergeOptions."""
    return kwargs.get("verbosity") or getattr(kwargs.get("merge_options"), "verbosity", 0) or 0


def _one_line_usage_errors(command) -> None:
    """click's usage errors of mergekit's command (missing argument, unknown option) as ``error:`` lines too."""
    make_context, invoke = command.make_context, command.invoke

    def checked_make_context(*args, **kwargs):
        """mergekit's command's context; a usage error is one ``error:`` line."""
        with one_line_click_errors():
            return make_context(*args, **kwargs)

    def checked_invoke(context):
        """mergekit's command run; click's own errors in it are one ``error:`` line."""
        with one_line_click_errors():
            return invoke(context)

    command.make_context, command.invoke = checked_make_context, checked_invoke


# Imported directly (not through the hook): wrap whichever of the commands is loaded.
for _script in ("mergekit.scripts.run_yaml", "mergekit.scripts.multimerge"):
    if _script in sys.modules:
        wrap_config_script(sys.modules[_script])
