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


class OutOfMemory(GraftError):
    """A process ran out of memory: the command line says so in one line and exits at once.

    Exiting at once (no interpreter shutdown) because shutdown's own handlers (e.g. torch's)
    may import or allocate, fail again, and print a traceback after the one line.
    """

