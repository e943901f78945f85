"""The ``graftmerge`` command: thin click wrappers over the library.

Every subcommand turns a :class:`GraftError` into ``error: <message>`` and a
non-zero exit; ``-v`` shows the traceback instead.
"""

from __future__ import annotations

import functools

import click

from graftmerge import __version__
from graftmerge.errors import GraftError, cli_error


def report_errors(command):
    """GraftError becomes ``error: <message>`` and exit 2; ``-v``/``--verbose`` re-raises it."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except GraftError as error:
            if _verbose():
                raise
            raise cli_error(error) from None

    return wrapper


def _verbose() -> bool:
    """``--verbose`` of the running command, or mergekit's ``-v`` verbosity count."""
    context = click.get_current_context(silent=True)
    if context is None:
        return False
    options = context.params.get("merge_options")
    return bool(context.params.get("verbose")) or getattr(options, "verbosity", 0) > 0


class _LazyGroup(click.Group):
    """Import each subcommand's module only when it is used (keeps --help fast)."""

    _lazy = {
        "fisher": ("graftmerge.cli.fisher", "fisher"),
        "merge": ("graftmerge.cli.merge", "merge"),
        "demo": ("graftmerge.cli.demo", "demo"),
        "plan": ("graftmerge.cli.plan", "plan"),
        "sweep": ("graftmerge.cli.sweep", "sweep"),
        "suggest": ("graftmerge.cli.suggest", "suggest"),
        "delta": ("graftmerge.cli.delta", "delta"),
        "import-gguf": ("graftmerge.cli.import_gguf", "import_gguf"),
    }

    def list_commands(self, ctx):
        return sorted([*super().list_commands(ctx), *self._lazy])

    def get_command(self, ctx, name):
        if name in self._lazy:
            module, attribute = self._lazy[name]
            command = getattr(__import__(module, fromlist=[attribute]), attribute)
            command.callback = report_errors(command.callback)
            return command
        return super().get_command(ctx, name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
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
    graftmerge fisher estimate MODEL ...   estimate a retention Fisher cache
    graftmerge fisher compress CACHE -k K -o OUT   keep the top-K KFAC eigenvectors per side
    graftmerge delta extract DONOR FT -o D write a graft as a shareable folder
    graftmerge import-gguf FILE -o DIR     a GGUF causal LM as a Hugging Face folder
    """
