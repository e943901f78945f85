"""The one exception type users see: a problem with their input, said in one line.

Raised anywhere below the command line; :mod:`graftmerge.cli` prints it as ``error: <message>``
and exit status 2 (also for mergekit's own commands, which it wraps), so nothing below
``cli/`` knows about click.
"""


class GraftError(ValueError):
    """Bad input (config, checkpoint, Fisher cache); the message says what to do next.

    Command-line entry points print ``error: <message>`` and exit non-zero;
    the traceback is shown only with ``-v``.
    """
