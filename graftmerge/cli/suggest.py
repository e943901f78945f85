"""``graftmerge suggest CONFIG``: propose rho and lambda from the Fisher cache and the delta alone."""

from __future__ import annotations

import json
import math

import click

from graftmerge.cli.plan import parse_values
from graftmerge.errors import GraftError


def parse_positive(text: str, option: str) -> float:
    """A finite number > 0, or a one-line GraftError naming the option."""
    try:
        value = float(text)
    except ValueError:
        raise GraftError(f"{option}: {text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise GraftError(f"{option} must be a finite number > 0, got {text}")
    return value


@click.command("suggest")
@click.argument("config_file", type=click.Path(dir_okay=False))
@click.option(
    "--rho-grid",
    "rho_grid",
    default=None,
    metavar="R1,R2,...",
    help="Comma-separated ρ values, each in (0, 1), for the log grid [default: 1, 2, 5 per decade, 1e-5 … 0.5].",
)
@click.option("--kl-budget", default="0.05", show_default=True, metavar="NATS",
              help="κ: predicted per-token KL on the old task that λ may spend (nats/token).")
@click.option("--max-lambda", default="1", show_default=True, metavar="L", help="Upper bound on the suggested λ.")
@click.option("--fisher", default=None, metavar="CACHE",
              help="Fisher cache to use instead of (or in the absence of) the config's `fisher:`.")
@click.option("--device", default="cpu", show_default=True, help="Where to score (cpu, cuda, ...).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the suggestion and every number behind it as JSON.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
def suggest(config_file: str, rho_grid: str | None, kl_budget: str, max_lambda: str, fisher: str | None,
            device: str, json_path: str | None, no_progress: bool, verbose: bool) -> None:
    """Suggest the config's rho and lambda before any evaluation (no model written).

    \b
    rho: the knee of R(ρ), the share of the Fisher-weighted update Σ s = ΔᵀFΔ that
    the ρ mask removes (as `graftmerge plan` reports it), on a log grid of ρ: the grid
    point maximising R_norm − x_norm, x = log10 ρ, both normalised to [0, 1].
    lambda: min(--max-lambda, sqrt(2κ / (T̄ · Δ'ᵀFΔ'))), so that the predicted
    per-token KL on the old task, (T̄/2)·λ²·Δ'ᵀFΔ', equals the budget κ. Δ' is the
    masked delta at the suggested ρ with lambda 1 (per-model weights as in the
    config); T̄ is the mean completion tokens per rollout from the cache manifest.

    CONFIG is checked as a merge would check it; it needs a Fisher cache
    (`fisher:` or --fisher). Its own lambda and rho are ignored; its weights, mask
    and rho_scope apply. Prints R(ρ) per grid point, the suggestion with the numbers
    behind it, and a `parameters:` block to paste.

    \b
    graftmerge suggest merge_configs/graft.yml
    graftmerge suggest graft.yml --kl-budget 0.02 --rho-grid 0.0001,0.001,0.01,0.1 --json s.json
    """
    # lazy: suggesting reads the graft plan (torch, mergekit); only when the command runs, so --help stays fast
    from graftmerge.formats.output_file import check_output_file, write_output_file
    from graftmerge.pipeline.suggest import format_suggestion, suggest_graft

    budget = parse_positive(kl_budget, "--kl-budget")
    cap = parse_positive(max_lambda, "--max-lambda")
    grid = None
    if rho_grid is not None:
        grid = parse_values(rho_grid, "--rho-grid", rho=True)
        if 0.0 in grid:
            raise GraftError("--rho-grid: ρ = 0 has no place on a log grid; give values in (0, 1)")
    inputs = suggestion_inputs(config_file, fisher)
    if json_path:
        check_output_file(json_path, inputs, "--json")  # before the scoring pass: inputs are never modified
    suggestion = suggest_graft(config_file, rho_grid=grid, kl_budget=budget, max_lambda=cap, fisher=fisher,
                               device=device, progress=not no_progress)
    click.echo(format_suggestion(suggestion))
    if json_path:
        write_output_file(json_path, json.dumps(suggestion.to_dict(), indent=1).encode(), inputs, "--json")


def suggestion_inputs(config_file: str, fisher: str | None) -> list[tuple[str, str | None]]:
    """(label, path) of everything suggest reads (the config, what it names, --fisher): --json may be none of them."""
    # lazy: the graft plan loads mergekit; only when the command runs
    from graftmerge.pipeline.config_files import read_graft_config
    from graftmerge.pipeline.graft_plan import plan_inputs

    _, _, plan = read_graft_config(config_file)
    return [("config", config_file), *plan_inputs(plan), ("Fisher cache (--fisher)", fisher)]
