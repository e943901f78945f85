"""``graftmerge fisher accumulate OLDER NEWER -o OUT --decay γ``: the online, EWC-style sum of two diagonal caches."""

from __future__ import annotations

import click

from graftmerge.cli import report_errors


@click.command("accumulate")
@click.argument("older", type=click.Path())
@click.argument("newer", type=click.Path())
@click.option("-o", "--output", "out", required=True, type=click.Path(file_okay=False),
              help="New cache folder: decay·OLDER + NEWER.")
@click.option("--decay", type=float, required=True, metavar="γ",
              help="Weight of the older cache, in [0, 1] (1: a plain sum; 0: NEWER alone).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
@report_errors
def fisher_accumulate(older: str, newer: str, out: str, decay: float, no_progress: bool, verbose: bool) -> None:
    """Write OUT = decay·OLDER + NEWER, diagonal by diagonal (online EWC's running Fisher).

    OLDER is the running Fisher so far, NEWER the Fisher of the current model;
    OUT belongs to NEWER's model. Both must be diagonal caches of the same
    weights and shapes. docs/continual.md, Accumulated Fisher.

    \b
    graftmerge fisher accumulate fisher/step-1 fisher/step-2 -o fisher/running-2 --decay 0.9
    """
    # lazy: the cache code loads torch; only when the command runs, so --help stays fast
    from graftmerge.pipeline.fisher_accumulate import accumulate_caches

    click.echo(f"wrote {accumulate_caches(older, newer, out, decay, progress=not no_progress)}")
