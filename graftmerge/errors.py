"""The one exception type users see: a problem with their input, said in one line."""


class GraftError(ValueError):
    """Bad input (config, checkpoint, Fisher cache); the message says what to do next.

    Command-line entry points print ``error: <message>`` and exit non-zero;
    the traceback is shown only with ``-v``.
    """


def cli_error(error: GraftError):
    """A click exception that prints ``error: <message>`` and exits 2."""
    import click

    class OneLineError(click.ClickException):
        exit_code = 2

        def show(self, file=None) -> None:
            click.echo(f"error: {self.format_message()}", err=True)

    return OneLineError(str(error))
