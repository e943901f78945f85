"""Quiet by default: what graftmerge's commands cause transformers to print is fixed or left out.

mergekit sets the output config's dtype through transformers' deprecated ``torch_dtype``
alias, and transformers logs ``torch_dtype is deprecated`` once per process: a notice the
user of a merge cannot act on. Merges of graftmerge's methods and the sweep's own model
folders leave that one message out; a control shows the handler here does catch it.
"""

from __future__ import annotations

import logging

import pytest
from transformers import PretrainedConfig
from transformers.utils import logging as hf_logging

from tests.helpers.configs import graft_yaml
from tests.helpers.runners import run_cli

TORCH_DTYPE_NOTICE = "`torch_dtype` is deprecated"  # transformers' words
TRANSFORMERS_CONFIG_LOGGER = "transformers.configuration_utils"  # the logger that says them


@pytest.fixture
def notices():
    """transformers' config-logger records, with its warn-once memory cleared before and after.

    The logger's own level is set to WARNING meanwhile: an earlier test in the same worker may have
    quieted transformers (its verbosity set to error), and the control must not depend on test order.
    """
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger(TRANSFORMERS_CONFIG_LOGGER)
    level = logger.level
    hf_logging.warning_once.cache_clear()
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        hf_logging.warning_once.cache_clear()


def said(records: list[logging.LogRecord]) -> list[str]:
    return [record.getMessage() for record in records if TORCH_DTYPE_NOTICE in record.getMessage()]


def test_the_handler_catches_the_notice(notices):
    """The control: transformers' alias, set outside graftmerge, logs the notice this module listens for."""
    PretrainedConfig().torch_dtype = "float32"
    assert said(notices)


@pytest.mark.parametrize("command", [["mergekit-yaml"], ["graftmerge", "merge"],
                                     ["graftmerge", "sweep", "--lambda", "1", "--rho", "0", "-o"]])
def test_a_graft_merge_and_a_sweep_say_nothing_about_torch_dtype(notices, tmp_path, tied_models, command):
    m = tied_models
    (tmp_path / "graft.yml").write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)],
                                                   out_dtype="bfloat16"))
    arguments = [*command[:2], str(tmp_path / "graft.yml"), *command[2:], str(tmp_path / "out")]
    if command[0] == "mergekit-yaml":
        arguments = ["mergekit-yaml", str(tmp_path / "graft.yml"), str(tmp_path / "out")]
    result = run_cli(*arguments)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not said(notices)
    assert TORCH_DTYPE_NOTICE not in result.stderr
