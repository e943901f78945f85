"""graftmerge's test suite; a package so that tests import their shared code as ``tests.helpers``."""
