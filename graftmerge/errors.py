"""The one exception type users see: a problem with their input, said in one line."""

import contextlib

import click


class GraftError(ValueError):
    """Bad input (config, checkpoint, Fisher cache); the message says what to do next.

    Command-line entry points print ``error: <message>`` and exit non-zero;
    the traceback is shown only with ``-v``.
    """


class OneLineError(click.ClickException):
    """A click exception shown as ``error: <message>`` (no usage text), exit status 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        """Print ``error: <message>`` to stderr (``file`` is ignored: errors always go to stderr)."""
        click.echo(f"error: {self.format_message()}", err=True)


def cli_error(error: GraftError):
    """A click exception that prints ``error: <message>`` and exits 2."""
    return OneLineError(str(error))


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
