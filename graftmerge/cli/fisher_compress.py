"""``graftmerge fisher compress CACHE --rank K -o OUT``: a compact KFAC cache (thin click wrapper)."""

from __future__ import annotations

import dataclasses

import click

from graftmerge.cli import report_errors


@click.command("compress")
@click.argument("cache", type=click.Path(file_okay=False))
@click.option("--rank", "-k", type=int, required=True,
              help="Eigenvectors kept per KFAC factor side (the K largest eigenvalues); 1 ≤ K ≤ the largest side.")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="New cache folder.")
@click.option("--report-delta", "config_file", type=click.Path(dir_okay=False), default=None,
              help="A graft config: on its Δ, report per KFAC weight the score mass the kept block holds and "
                   "how much of the full cache's mask (at the config's rho) the compact cache's mask keeps.")
@click.option("--device", default="cpu", show_default=True, help="Where --report-delta scores.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
@report_errors
def fisher_compress(cache: str, rank: int, output: str, config_file: str | None, device: str, no_progress: bool,
                    verbose: bool) -> None:
    """Copy a KFAC Fisher cache keeping only the top-K eigenvectors of each factor side.

    Each side with more than K eigenvectors keeps the K with the largest
    eigenvalues (all eigenvalues stay in the cache; the manifest records the
    kept `rank`); smaller sides, diagonal sides and diagonal entries are copied
    unchanged. A graft with the compact cache scores and masks only the pairs
    u_i v_jᵀ of the kept eigenvectors: a weight contributes K_rows·K_cols
    directions to D, and the rest of Δ is never masked. K = the largest side
    gives a cache that merges bit for bit like the original.

    Prints per KFAC weight the kept eigenvectors and share of Σ eigenvalues per
    side. With --report-delta CONFIG (a graft config; its fisher is replaced by
    CACHE and OUTPUT): the share of the score mass Σ σ_i d_j Δ̃_ij² in the kept
    block, and |M_compact ∩ M_full| / |M_full| at the config's rho, comparing
    the two masks as sets of full-basis directions (pairs of the same
    eigenvectors; coordinates for diagonal entries).

    \b
    graftmerge fisher compress fisher/post-kfac --rank 256 -o fisher/post-kfac-r256
    graftmerge fisher compress fisher/post-kfac -k 256 -o fisher/r256 --report-delta graft-kfac.yml
    """
    # lazy: compression and graft configs load torch and mergekit only when the command runs, so --help stays fast
    from graftmerge.pipeline.fisher_compress import (
        check_compress,
        compress_cache,
        delta_report,
        format_compress,
        format_delta_report,
    )

    plan = None
    check_compress(cache, output, rank)
    if config_file:
        from graftmerge.pipeline.config_files import read_graft_config
        from graftmerge.pipeline.graft_plan import GraftInputs

        _, _, plan = read_graft_config(config_file)  # checked completely before anything is written
        GraftInputs.open(dataclasses.replace(plan, fisher=cache, rho=max(plan.rho, 0.5)))
    result = compress_cache(cache, output, rank, progress=not no_progress)
    click.echo(format_compress(result))
    if plan is not None:
        click.echo(format_delta_report(delta_report(result, cache, plan, device, not no_progress), plan.rho))
