"""``graftmerge search CONFIG --eval TASKS -o DIR --trials N``: a multi-objective search instead of a grid."""

from __future__ import annotations

import math
import sys

import click
from mergekit.options import MergeOptions, add_merge_options

from graftmerge.adapter import import_hook
from graftmerge.cli.sweep import evaluation_setup
from graftmerge.errors import GraftError

DEFAULT_LAMBDA, DEFAULT_RHO = "0,1.5", "0.0001,0.1"  # graftmerge.pipeline.search's ranges (--help stays fast)


@click.command("search")
@click.argument("config_files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--eval", "tasks_file", required=True, type=click.Path(dir_okay=False), metavar="TASKS.yml",
              help="The tasks whose old-role and new-role validation scores are the two objectives.")
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(file_okay=False),
              help="New (or empty) folder, or the folder of this search to resume.")
@click.option("--trials", required=True, type=int, help="How many points to evaluate in all (warm start included).")
@click.option("--seed", default=0, show_default=True, type=int, help="The sampler's seed.")
@click.option("--per-layer", "per_layer", default=0, type=int, metavar="G",
              help="Search λ as a mergekit gradient of G anchors over the layers (lambda: [a1, …, aG]).")
@click.option("--tolerance", type=float, default=0.01, show_default=True, metavar="τ",
              help="How far the chosen trial's old-role validation score may fall below θpost's (normalised).")
@click.option("--lambda-range", default=DEFAULT_LAMBDA, show_default=True, metavar="LOW,HIGH",
              help="The range of λ (each anchor's with --per-layer).")
@click.option("--rho-range", default=DEFAULT_RHO, show_default=True, metavar="LOW,HIGH|none",
              help="ρ's log-uniform range when a trial masks (a trial may also not mask); none: never mask.")
@click.option("--warm-start", default="corners", show_default=True, metavar="corners|none|RESULTS.jsonl",
              help="The first trials: the grid's corners, none, or the points of a previous results.jsonl.")
@click.option("--workers", default=1, show_default=True, type=int,
              help="Processes on this machine evaluating trials of the same study.")
@click.option("--join", is_flag=True, default=False,
              help="Join a running search in OUTPUT as one more worker (another machine sharing the folder).")
@click.option("--eval-dtype", type=click.Choice(["float32", "bfloat16", "float16", "auto"]), default=None,
              help="The evaluation model's dtype, as `sweep --eval-dtype`.")
@add_merge_options
def search(merge_options: MergeOptions, config_files: tuple[str, ...], tasks_file: str, out_dir: str, trials: int,
           seed: int, per_layer: int, tolerance: float, lambda_range: str, rho_range: str, warm_start: str,
           workers: int, join: bool, eval_dtype: str | None) -> None:
    """Search λ and ρ (or per-layer λ) for the best trade-off on your tasks, with a trial budget instead of a grid.

    Several CONFIGs (grafting onto the same model) are searched together: which
    config is one more choice of each trial.

    Each trial is grafted in memory and scored on the tasks' validation splits; the
    two objectives, old-role and new-role scores, are maximised by Optuna's
    multi-objective TPE sampler, the study kept in OUTPUT/study.journal. Then the
    sweep --eval rule chooses among the trials: OUTPUT/best/ (mergekit-yaml's
    output of its mergekit_config.yml, bit for bit), results.jsonl, chosen.json,
    frontier.png. Killed, run the same command again: it resumes. See docs/search.md.

    \b
    graftmerge search graft.yml --eval tasks.yml -o search/ --trials 27
    graftmerge search graft.yml --eval tasks.yml -o search/ --trials 27 --per-layer 3 --workers 2
    """
    # lazy: the search loads mergekit's merge code, transformers and optuna only when the command runs
    from graftmerge.pipeline.config_files import read_graft_config
    from graftmerge.pipeline.search import SearchRequest, Space, check_request, run_search
    from graftmerge.pipeline.search_study import optuna_module

    import_hook.install()
    merge_options.apply_global_options()
    optuna_module()  # the install line, before any work
    space = Space(_range(lambda_range, "--lambda-range"),
                  None if rho_range.strip() == "none" else _range(rho_range, "--rho-range"), per_layer)
    if per_layer < 0:
        raise GraftError(f"--per-layer must be a number of anchors ≥ 1 (or 0: one λ), got {per_layer}")
    request = SearchRequest(trials, seed, tolerance, warm_start, workers, join)
    check_request(request, space)  # before the tasks and the config are read
    config, source, plan, evaluation, make_judge = evaluation_setup(merge_options, tasks_file, config_files[0],
                                                                    eval_dtype, "search")
    others = tuple(read_graft_config(path) for path in config_files[1:])
    command = [sys.executable, "-m", "graftmerge", *sys.argv[1:], "--join"] if workers > 1 else None
    outcome = run_search(config, source, plan, space, request, out_dir, merge_options, evaluation, make_judge,
                         worker_command=command, others=others)
    if outcome is not None:
        _report(outcome, tolerance)


def _range(text: str, option: str) -> tuple[float, float]:
    """``"LOW,HIGH"`` → (low, high); GraftError for anything else."""
    parts = text.split(",")
    try:
        low, high = (float(part) for part in parts)
    except ValueError:
        raise GraftError(f"{option} must be two comma-separated numbers LOW,HIGH, got {text!r}") from None
    if not (math.isfinite(low) and math.isfinite(high)) or low > high:
        raise GraftError(f"{option} must be two finite numbers LOW ≤ HIGH, got {text!r}")
    return low, high


def _report(outcome, tolerance: float) -> None:
    """A few lines: θpost, the chosen trial, the frontier, what was written."""
    def roles(record: dict, split: str) -> str:
        values = record["roles"].get(split, {})
        return ", ".join(f"{role} {values[role]:.4f}" if values.get(role) is not None else f"{role} n/a"
                         for role in ("old", "new"))

    click.echo(f"θpost: validation {roles(outcome.post, 'validation')}; test {roles(outcome.post, 'test')}")
    chosen = outcome.chosen
    if chosen is None:
        click.echo(f"no trial within τ = {tolerance:g} of θpost's old-role score: chose θpost; best/ holds the "
                   "λ = 0 graft")
    else:
        what = f"λ anchors {list(chosen.layers)}" if chosen.layers else f"λ {chosen.lam:g}"
        what += f" (config {chosen.config + 1})" if chosen.config else ""
        click.echo(f"chosen: trial {chosen.trial}, {what}, ρ {chosen.rho:g}; test {roles(outcome.chosen_test, 'test')}")
    click.echo(f"{outcome.trials} trials; Pareto frontier: trials " + ", ".join(str(p.trial) for p in outcome.frontier)
               + f"; hypervolume {outcome.hypervolume:.4f}")
    for path in outcome.written:
        click.echo(f"wrote {path}")
    click.echo(f"wrote {outcome.folder / 'results.jsonl'}, chosen.json, frontier.png")
