"""The ``graftmerge`` command: thin click wrappers over the library.

Every subcommand turns a :class:`GraftError` into ``error: <message>`` and exit
status 2; ``-v`` shows the traceback instead. click's own usage errors (a missing
argument, an unknown option, a bad option value) are said the same way: one
``error:`` line naming the command's ``--help``, exit status 2 (:mod:`graftmerge.cli.errors`:
the only place errors meet click; :mod:`graftmerge.cli.mergekit_scripts` holds mergekit's
own ``mergekit-yaml`` and ``mergekit-multi`` to the same contract).
"""

from __future__ import annotations

import functools
import importlib

import click

from graftmerge import __version__
from graftmerge.cli.errors import cli_error, one_line_click_errors
from graftmerge.errors import GraftError


def report_errors(command):
    """GraftError becomes ``error: <message>`` and exit 2; ``-v``/``--verbose`` re-raises it."""
    if getattr(command, "_reports_errors", False):
        return command

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        """Run ``command``; a GraftError becomes click's one-line error (wraps copies the command's docstring here)."""
        try:
            return command(*args, **kwargs)
        except GraftError as error:
            if _verbose():
                raise
            raise cli_error(error) from None

    wrapper._reports_errors = True
    return wrapper


def _verbose() -> bool:
    """``--verbose`` of the running command, or mergekit's ``-v`` verbosity count."""
    context = click.get_current_context(silent=True)
    if context is None:
        return False
    options = context.params.get("merge_options")
    return bool(context.params.get("verbose")) or getattr(options, "verbosity", 0) > 0


class LazyGroup(click.Group):
    """A command group whose subcommands load only when used.

    ``lazy_commands`` maps a name to (module, attribute, one-line summary); ``--help``
    lists the stored summaries, so it imports no subcommand module (and so no torch,
    transformers or mergekit). ``tests/test_cli_help.py`` keeps each summary equal to
    its command's own short help.
    """

    def __init__(self, *args, lazy_commands: dict[str, tuple[str, str, str]] | None = None,
                 wrap_errors: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy_commands = lazy_commands or {}
        self.wrap_errors = wrap_errors

    def make_context(self, info_name, args, parent=None, **extra):
        """click's context for this group; with ``wrap_errors``, a usage error in its own options is one line."""
        with one_line_click_errors(self.wrap_errors):
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx):
        """Run the subcommand; with ``wrap_errors``, click's errors in it (usage, parameters) are one line."""
        with one_line_click_errors(self.wrap_errors):
            return super().invoke(ctx)

    def list_commands(self, ctx):
        """Every subcommand name, the lazy ones included, sorted as --help lists them."""
        return sorted([*super().list_commands(ctx), *self.lazy_commands])

    def get_command(self, ctx, name):
        """The subcommand ``name``, its module imported now (lazy: only the command asked for loads)."""
        if name not in self.lazy_commands:
            return super().get_command(ctx, name)
        module, attribute, _ = self.lazy_commands[name]
        command = getattr(importlib.import_module(module), attribute)
        if self.wrap_errors and not getattr(command.callback, "_reports_errors", False):
            command.callback = report_errors(command.callback)
        return command

    def format_commands(self, ctx, formatter) -> None:
        """The Commands section from stored summaries: --help imports no subcommand module."""
        rows = []
        for name in self.list_commands(ctx):
            if name in self.lazy_commands:
                rows.append((name, self.lazy_commands[name][2]))
                continue
            command = super().get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit=10**6)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


MAIN_COMMANDS = {
    "fisher": ("graftmerge.cli.fisher", "fisher", "Retention Fisher caches of a post-trained model."),
    "merge": ("graftmerge.cli.merge", "merge",
              "Run a merge config (graft or any mergekit method) and write the model to OUT_PATH."),
    "demo": ("graftmerge.cli.demo", "demo",
             "Run a tiny end-to-end graft on generated checkpoints and print what it did."),
    "plan": ("graftmerge.cli.plan", "plan",
             "Report what a graft config would mask for several ρ, without writing a model."),
    "sweep": ("graftmerge.cli.sweep", "sweep",
              "Graft CONFIG once per (λ, ρ) of a grid, reading the inputs once for all of them."),
    "search": ("graftmerge.cli.search", "search",
               "Search λ and ρ (or per-layer λ) for the best trade-off on your tasks, with a trial budget instead "
               "of a grid."),
    "suggest": ("graftmerge.cli.suggest", "suggest",
                "Suggest the config's rho and lambda before any evaluation (no model written)."),
    "delta": ("graftmerge.cli.delta", "delta",
              "Grafts as files: a delta Δ = weight·(θft − θdonor), like a LoRA adapter but full-rank."),
    "eval": ("graftmerge.cli.eval", "eval_command",
             "Score MODEL (a folder, or a Hub id in the local cache) on a tasks file, per task and role."),
    "continual": ("graftmerge.cli.continual", "continual",
                  "Graft a stream of updates one after another, re-estimating the Fisher and re-choosing λ, ρ at "
                  "each step."),
    "import-gguf": ("graftmerge.cli.import_gguf", "import_gguf",
                    "Dequantize a GGUF causal LM (llama.cpp format) into a Hugging Face model folder."),
}


@click.group(
    cls=LazyGroup,
    lazy_commands=MAIN_COMMANDS,
    wrap_errors=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(__version__, prog_name="graftmerge")
def main() -> None:
    """Graft a fine-tuning delta learned on a donor checkpoint onto a post-trained model.

    \b
    graftmerge merge graft.yml out/        run a graft config (same as mergekit-yaml)
    graftmerge demo                        tiny end-to-end graft on generated models
    graftmerge plan graft.yml --rho 0.001,0.01   what each ρ would mask (no model written)
    graftmerge suggest graft.yml           propose rho (knee) and lambda (KL budget)
    graftmerge sweep graft.yml --lambda 0.5,1 --rho 0,0.01 -o DIR
                                           one model per (λ, ρ), inputs read once
    graftmerge search graft.yml --eval tasks.yml -o DIR --trials 27
                                           a trial budget instead of a grid
    graftmerge eval MODEL --tasks tasks.yml   score a model: per task, old and new roles
    graftmerge continual stream.yml -o DIR   graft a stream of updates; forgetting matrix, ACC/BWT/FWT
    graftmerge fisher estimate MODEL ...   estimate a retention Fisher cache
    graftmerge fisher compress CACHE -k K -o OUT   keep the top-K KFAC eigenvectors per side
    graftmerge delta extract DONOR FT -o D write a graft as a shareable folder
    graftmerge import-gguf FILE -o DIR     a GGUF causal LM as a Hugging Face folder
    """
