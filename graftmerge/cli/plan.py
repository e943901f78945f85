"""``graftmerge plan CONFIG --rho ...``: what a graft would mask, for several ρ, without merging."""

from __future__ import annotations

import dataclasses
import json
import math

import click

from graftmerge.errors import GraftError


def parse_values(text: str, option: str, *, rho: bool = False) -> list[float]:
    """``"0.25,0.5,1"`` → [0.25, 0.5, 1.0]; refuses empty lists, repeats, non-numbers, ρ outside [0, 1)."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part for part in parts):
        raise GraftError(f"{option} needs a comma-separated list of numbers, got {text!r}")
    values = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            raise GraftError(f"{option}: {part!r} is not a number") from None
        if not math.isfinite(value):
            raise GraftError(f"{option}: {part!r} is not a finite number")
        if rho and not 0 <= value < 1:
            raise GraftError(f"{option}: rho must be in [0, 1), got {part}")
        if value in values:
            raise GraftError(f"{option}: {part} is listed twice")
        values.append(value)
    return values


def open_for_masks(plan, rhos: list[float]):
    """GraftInputs of ``plan`` with its Fisher cache opened and checked (the config must name one)."""
    # lazy: the graft plan loads torch and mergekit; only when masks are opened, so --help stays fast
    from graftmerge.pipeline.graft_plan import GraftInputs

    if not plan.fisher:
        raise GraftError(
            "the config has no `fisher:` parameter; masks need a Fisher cache (see graftmerge fisher estimate)"
        )
    # Opening with a positive ρ opens and checks the cache; the ρ itself is not used.
    return GraftInputs.open(dataclasses.replace(plan, rho=max([*rhos, 0.5])))


@click.command("plan")
@click.argument("config_file", type=click.Path(dir_okay=False))
@click.option("--rho", "rho_list", required=True, metavar="R1,R2,...",
              help="Comma-separated ρ values to report, each in [0, 1), e.g. 0.001,0.01,0.1.")
@click.option("--device", default="cpu", show_default=True, help="Where to score (cpu, cuda, ...).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the full report (per tensor and ρ: masked count, score mass) as JSON.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
def plan(config_file: str, rho_list: str, device: str, json_path: str | None, no_progress: bool, verbose: bool) -> None:
    """Report what a graft config would mask for several ρ, without writing a model.

    Checks CONFIG exactly as a merge would (roles, parameters, every input's
    headers and shapes, the Fisher cache's fit), then scores every ranked tensor
    once and prints, for each ρ: the exact global threshold (rho_scope: global),
    k = ⌈ρ·D⌉, and the share of the Fisher-weighted update Σ s it removes; then a
    table with one row per tensor: masked % of its directions and removed % of its
    Σ s, per ρ. The config's own rho is ignored (a rho schedule too); its lambda,
    weights (per-layer schedules included), mask and rho_scope apply. CONFIG must
    name a Fisher cache (`fisher:`).

    \b
    graftmerge plan merge_configs/graft.yml --rho 0.001,0.01,0.1
    graftmerge plan graft.yml --rho 0.01 --json plan.json
    """
    # lazy: the graft plan loads torch and mergekit; only when the command runs, so --help stays fast
    from mergekit.options import MergeOptions

    from graftmerge.adapter import import_hook
    from graftmerge.formats.output_file import check_output_file, write_output_file
    from graftmerge.pipeline.config_files import read_graft_config
    from graftmerge.pipeline.graft_plan import plan_inputs
    from graftmerge.pipeline.mask_preview import bind_report_schedule, format_report, plan_report, report_json

    import_hook.install()  # a schedule is resolved by mergekit's planner, which must know graft
    rhos = parse_values(rho_list, "--rho", rho=True)
    config, _, graft_plan = read_graft_config(config_file)
    read_paths = [("config", config_file), *plan_inputs(graft_plan)]
    if json_path:
        check_output_file(json_path, read_paths, "--json")  # before the scoring pass: inputs are never modified
    opened = bind_report_schedule(open_for_masks(graft_plan, rhos), config, MergeOptions())
    report = plan_report(opened, rhos, device=device, progress=not no_progress)
    click.echo(format_report(report))
    if json_path:
        write_output_file(json_path, json.dumps(report_json(report), indent=1).encode(), read_paths, "--json")
