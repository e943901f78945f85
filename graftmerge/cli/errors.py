"""GraftError and click's own errors said the command line's way: one ``error:`` line, exit status 2.

The only place that maps errors to click: for ``graftmerge``'s commands and for mergekit's
``mergekit-yaml`` and ``mergekit-multi`` (:mod:`graftmerge.cli.mergekit_scripts`).
"""

from __future__ import annotations

import contextlib
import os
import sys

import click

from graftmerge.errors import GraftError, OutOfMemory


class OneLineError(click.ClickException):
    """A click exception shown as ``error: <message>`` (no usage text), exit status 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        """Print ``error: <message>`` to stderr (``file`` is ignored: errors always go to stderr)."""
        click.echo(f"error: {self.format_message()}", err=True)


def cli_error(error: GraftError) -> OneLineError:
    """A click exception that prints ``error: <message>`` and exits 2."""
    return OneLineError(str(error))


def raise_for_cli(error: GraftError, verbose: bool):
    """Inside a click command, a one-line ``error:`` and exit 2; with ``-v`` (or outside click), ``error`` itself."""
    if not verbose and click.get_current_context(silent=True) is not None:
        raise cli_error(error) from None
    raise error


@contextlib.contextmanager
def one_line_click_errors(enabled: bool = True):
    """click's own errors raised in the block (usage, bad parameter, file) become one ``error:`` line, exit 2.

    Help shown for a bare group (click's NoArgsIsHelpError) and our own one-line errors pass unchanged.
    """
    try:
        yield
    except (OneLineError, click.exceptions.NoArgsIsHelpError):
        raise
    except click.ClickException as error:
        if not enabled:
            raise
        context = getattr(error, "ctx", None)
        hint = f" (see '{context.command_path} --help')" if context is not None else ""
        raise OneLineError(" ".join(error.format_message().split()) + hint) from None


def exit_out_of_memory(error: OutOfMemory):
    """``error: <message>``, then exit 2 at once: no shutdown handlers, which could fail again for want of memory."""
    click.echo(f"error: {error}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)

