"""Command-line runners for tests: console scripts in this process (:func:`run_cli`), as real
processes (:func:`run_process`), ``graftmerge`` through click's runner (:func:`cli`,
:func:`invoke`), and the one-line error contract each bad input must keep."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch
from click.testing import CliRunner

from graftmerge.cli import main
from tests.helpers.models import read_model

BIN = Path(sys.executable).parent
REMOTE_CODE_PROMPT = "Do you wish to run the custom code"


# Console scripts run in this process by run_cli: name → (module, click command).
IN_PROCESS = {
    "mergekit-yaml": ("mergekit.scripts.run_yaml", "main"),
    "mergekit-multi": ("mergekit.scripts.multimerge", "main"),
    "graftmerge": ("graftmerge.cli", "main"),
    "python -m experiments.demo": ("experiments.demo.cli", "demo"),  # the repository's experiment, not installed
}


def forget_process_state() -> None:
    """Drop what a merge leaves in memory, so the next in-process run starts like a fresh
    process: mergekit's loaders. (graftmerge keeps nothing of a merge in the process; the
    on-disk threshold cache, $GRAFTMERGE_CACHE_DIR, is kept: that is what persists between
    real runs.)"""
    from mergekit.io.tasks import LoaderCache

    LoaderCache().flush_all()
    LoaderCache().loaders.clear()


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a console script of this environment (mergekit-yaml, mergekit-multi, graftmerge, or the
    experiment's ``python -m experiments.demo``)
    in this process, through its click command, as if it were a fresh process.

    The graft import hook is installed here as graftmerge_hook.pth installs it at start-up.
    ``env`` is set for the run only; ``cwd`` is entered for the run only. The result reads
    like a subprocess's: exit status, stdout, stderr (an uncaught exception's traceback is
    appended to stderr, as the interpreter would print it). Tests whose subject is the
    process itself (start-up, the .pth hook, signals, torchrun) use :func:`run_process`.
    """
    from click.testing import CliRunner

    from graftmerge.adapter import import_hook

    import_hook.install()
    module, attribute = IN_PROCESS[args[0]]
    command = getattr(importlib.import_module(module), attribute)
    forget_process_state()
    previous = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        result = CliRunner().invoke(command, list(args[1:]), env=env, prog_name=args[0])
    finally:
        os.chdir(previous)
        forget_process_state()
    stderr = result.stderr
    if result.exc_info is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info))
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, stderr)


def run_process(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
                timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a console script of this environment (or ``python``) as a real subprocess."""
    command = [str(BIN / args[0]), *args[1:]]
    environment = None if env is None else {**os.environ, **env}
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=environment, timeout=timeout)


ROOT = Path(__file__).resolve().parents[2]


def load_script(path: Path):
    """A script of ``scripts/`` or ``experiments/`` loaded as a module in this process (its ``main`` takes
    argv): bad inputs checked without paying a new process each."""
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(path: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """A script as a user runs it: a real process, this checkout importable, offline. One inside a
    package (``experiments/``) runs as its module, ``python -m experiments.<name>``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    if (path.parent / "__init__.py").exists():
        command = ["-m", ".".join(path.relative_to(ROOT).with_suffix("").parts)]
    else:
        command = [str(path)]
    return subprocess.run([sys.executable, *command, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def mergekit_yaml_model(tmp_path: Path, config: str, name: str) -> dict[str, torch.Tensor]:
    """Run ``config`` through the stock mergekit-yaml into ``tmp_path/name``; its tensors."""
    (tmp_path / f"{name}.yml").write_text(config)
    result = run_cli("mergekit-yaml", str(tmp_path / f"{name}.yml"), str(tmp_path / name))
    assert result.returncode == 0, result.stderr[-3000:]
    return read_model(tmp_path / name)


def error_line(result) -> str:
    """The contract for a finished process (``run_cli``/``run_process``): exit 2, exactly one ``error: ...``
    line, last on stderr (progress bars aside), no traceback; that line."""
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    lines = [
        line for line in result.stderr.splitlines() if line.strip() and "it/s]" not in line and "s/it]" not in line
    ]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    return errors[0]


def one_line_error(result) -> str:
    """The CLI's contract for bad input: exit 2, one `error: ...` line, no traceback."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


def cli(*args: str):
    """``graftmerge ARGS`` in this process, push and pull without progress bars; stdin is empty."""
    quiet = ["-q"] if args[1:2] in (("pull",), ("push",)) and "-q" not in args else []
    return CliRunner().invoke(main, [*map(str, args), *quiet], input="")


def refused(result) -> str:
    """The CLI's contract for bad input: exit 2, one ``error: ...`` line on stderr, no traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    assert result.exit_code == 2, (result.output, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output + result.stderr
    assert REMOTE_CODE_PROMPT not in result.output + result.stderr
    return lines[0]


def invoke(command, *args: str):
    return CliRunner().invoke(command, [*args, "-q"], catch_exceptions=False)
