"""The one exception type users see: a problem with their input, said in one line."""


class GraftError(ValueError):
    """Bad input (config, checkpoint, Fisher cache); the message says what to do next.

    Command-line entry points print ``error: <message>`` and exit non-zero;
    the traceback is shown only with ``-v``.
    """
