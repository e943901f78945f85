#!/usr/bin/env python
"""Re-analyse a finished `graftmerge demo --lm` run from its results.json, without training anything.

Prints (or writes with --tables) the corrected markdown tables: 95 % paired-t intervals on
every paired difference, the value-prior baseline per seed, the paper's own baselines
(unmasked OPSD + merge included) and where the chosen λ and ρ sit in the grid; --plot
writes the figure (Pareto frontiers, chosen points and differences with intervals).
A registration-2 run (`"registration": 2`, docs/demo-preregistration-2.md) recorded its own
intervals, gates and verdicts: for it the script lays those out (experiments.demo.lm_results_2)
and recomputes nothing.

    .venv/bin/python -m experiments.reanalyse_demo docs/results/demo-full-results.json \\
        --tables /tmp/tables.md --plot docs/results/demo-full-results.png
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from experiments.demo import lm_results_2
from experiments.demo.lm_plots import results_figure
from experiments.demo.lm_reanalysis import markdown_report, reanalyse
from graftmerge.errors import GraftError
from graftmerge.formats.json_file import load_json_file


def _replace(path: Path, write) -> None:
    """Write through a temporary file beside ``path``, then rename: never a half-written output."""
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(descriptor)
    try:
        write(Path(temporary))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # mkstemp creates 0600; an output is as readable as any other
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, re-analyse, print or write; ``error: …`` and status 2 on bad input."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="results.json of a `graftmerge demo --lm` run")
    parser.add_argument("--tables", type=Path, help="write the markdown here instead of printing it")
    parser.add_argument("--plot", type=Path, help="write the results figure (PNG) here")
    arguments = parser.parse_args(argv)
    try:
        for output in (arguments.tables, arguments.plot):
            if output is not None and output.resolve() == arguments.results.resolve():
                raise GraftError(f"{output}: is the input results file; choose another output")
            if output is not None and not output.parent.is_dir():
                raise GraftError(f"{output}: its folder does not exist")
        results = load_json_file(arguments.results, "demo results file")
        if not isinstance(results, dict):
            raise GraftError(f"{arguments.results}: not a results.json of `graftmerge demo --lm` (not an object)")
        if results.get("registration") == 2:
            analysis = lm_results_2.check_results(results, str(arguments.results))
            report, figure = lm_results_2.markdown_report(analysis), lm_results_2.results_figure
        else:
            analysis = reanalyse(results, str(arguments.results))
            report, figure = markdown_report(analysis), results_figure
    except GraftError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if arguments.tables is None:
        print(report, end="")
    else:
        _replace(arguments.tables, lambda path: path.write_text(report, encoding="utf-8"))
    if arguments.plot is not None:
        _replace(arguments.plot, lambda path: figure(analysis, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
