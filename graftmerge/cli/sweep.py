"""``graftmerge sweep CONFIG --lambda ... --rho ... -o DIR [--eval TASKS]``: a grid of grafts from one read of the
inputs."""

from __future__ import annotations

import click
from mergekit.options import MergeOptions, add_merge_options

from graftmerge.adapter import import_hook
from graftmerge.cli.plan import parse_values
from graftmerge.errors import GraftError

KEEP_CHOICES = ("best", "frontier", "all")  # graftmerge.pipeline.sweep_eval.KEEP (not imported: --help stays fast)


@click.command("sweep")
@click.argument("config_file", type=click.Path(dir_okay=False))
@click.option("--lambda", "lambda_list", required=True, metavar="L1,L2,...",
              help="Comma-separated values of the config's global `lambda`, e.g. 0.25,0.5,1 (a scheduled "
                   "lambda is multiplied by each).")
@click.option("--rho", "rho_list", required=True, metavar="R1,R2,...",
              help="Comma-separated ρ values, each in [0, 1); 0 = no mask.")
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(file_okay=False),
              help="New (or empty) folder; receives one model folder per (λ, ρ) (with --eval: see below).")
@click.option("--eval", "tasks_file", type=click.Path(dir_okay=False), default=None, metavar="TASKS.yml",
              help="Score every grid point on the tasks' validation splits and keep only the one the rule "
                   "chooses (OUTPUT/best/); see docs/sweeps.md.")
@click.option("--tolerance", type=float, default=None, metavar="τ",
              help="With --eval: how far the chosen point's old-role validation score may fall below "
                   "θpost's, on the normalised [0, 1] scale (default 0.01).")
@click.option("--keep", type=click.Choice(KEEP_CHOICES), default=None,
              help="With --eval: which model folders to write: best (default: OUTPUT/best/ only), "
                   "frontier (also each Pareto-frontier point's) or all (also every point's).")
@click.option("--eval-dtype", type=click.Choice(["float32", "bfloat16", "float16", "auto"]), default=None,
              help="With --eval: the evaluation model's dtype, as `graftmerge eval --dtype` [default: float32 on "
                   "CPU, bfloat16 with --cuda; auto: the dtype the sweep writes, out_dtype].")
@add_merge_options
def sweep(merge_options: MergeOptions, config_file: str, lambda_list: str, rho_list: str, out_dir: str,
          tasks_file: str | None, tolerance: float | None, keep: str | None, eval_dtype: str | None) -> None:
    """Graft CONFIG once per (λ, ρ) of a grid, reading the inputs once for all of them.

    Writes OUTPUT/lambda-<λ>_rho-<ρ>/ for every pair, each number as Python
    prints it (lambda-0.5_rho-0.001, lambda-1.0_rho-0.0): a complete model
    folder as mergekit-yaml writes it (config.json, tokenizer from the post model,
    sharded safetensors and index, README.md and the grid point's
    mergekit_config.yml). Each folder's tensors are bit for bit those of
    `mergekit-yaml` run on that mergekit_config.yml with the same options.

    \b
    Shared across the grid: the reads. A global mask needs a scoring pass
    before the merge, so inputs are read twice in all (not twice per grid
    point): the scoring pass reads each tensor and its Fisher once and scores
    Δ(λ) once per λ, fixing the exact threshold of every ρ, with one rotation
    Δ̃ = UᵀΔV per KFAC weight per λ; the writing pass reads each tensor once
    and grafts it for every grid point. The config's own lambda and rho
    are replaced (a scheduled lambda is multiplied by each swept λ, endpoint
    by endpoint: docs/grafting.md, Per-layer schedules); its per-model
    weights, fisher, mask and rho_scope apply.

    \b
    Memory: about that of one merge, whatever the grid size. One tensor's
    inputs and one grid point's graft are in memory at a time; each point's
    shard being filled waits on disk, in a scratch folder next to OUTPUT, and
    is read back only to be written, one shard at a time (--async-write does
    not apply). Shards, their names and the index are those mergekit-yaml
    writes with the same --out-shard-size. Disk, besides the outputs: up to
    one shard per grid point, and with a global KFAC mask Δ̃ of every KFAC
    weight (4 bytes per entry) per λ, until the sweep ends. All folders
    appear at once, only on success.

    \b
    With --eval TASKS.yml each point is grafted in memory and scored on
    validation (OUTPUT/results.jsonl); the highest new-role score whose
    old-role score is within τ of θpost's is chosen and written to
    OUTPUT/best/, with chosen.json and frontier.png. Run it again to resume.

    \b
    graftmerge sweep graft.yml --lambda 0.25,0.5,1 --rho 0,0.001,0.01 -o sweep/ --out-shard-size 500M
    graftmerge sweep graft.yml --lambda 0.25,0.5,1 --rho 0,0.001,0.01 --eval tasks.yml -o chosen/
    """
    # lazy: the sweep loads mergekit's merge code (and with --eval the evaluator) only when the command runs
    from graftmerge.api import sweep as run_sweep
    from graftmerge.pipeline.sweep_eval import DEFAULT_TOLERANCE

    import_hook.install()
    lambdas = parse_values(lambda_list, "--lambda")
    rhos = parse_values(rho_list, "--rho", rho=True)
    if tasks_file is None and (tolerance is not None or keep is not None or eval_dtype is not None):
        raise GraftError("--tolerance, --keep and --eval-dtype are about evaluated points: they need --eval TASKS.yml")
    result = run_sweep(config_file, out_dir, lambdas=lambdas, rhos=rhos, eval=tasks_file, tolerance=tolerance,
                       keep=keep, eval_dtype=eval_dtype, options=merge_options)
    if tasks_file is not None:
        _report(result, DEFAULT_TOLERANCE if tolerance is None else tolerance)
        return
    for folder in result:
        click.echo(f"wrote {folder}")


def evaluation_setup(options: MergeOptions, tasks_file: str, config_file: str, eval_dtype: str | None,
                     command: str) -> tuple:
    """(config, source, plan, Evaluation, make_judge) of an evaluating sweep or search (graftmerge.api's)."""
    # lazy: evaluation loads transformers and the task file's data only when a command evaluates
    from graftmerge.api import evaluation_setup as setup

    return setup(options, tasks_file, config_file, eval_dtype, command)


def _report(outcome, tolerance: float) -> None:
    """A few lines: θpost, the chosen point, validation and test role scores, what was written."""
    def roles(record: dict, split: str) -> str:
        values = record["roles"].get(split, {})
        return ", ".join(f"{role} {values[role]:.4f}" if values.get(role) is not None else f"{role} n/a"
                         for role in ("old", "new"))

    post = outcome.post
    click.echo(f"θpost: validation {roles(post, 'validation')}; test {roles(post, 'test')}")
    failed = f", {outcome.failed} failed" if outcome.failed else ""
    if outcome.chosen is None:
        click.echo(f"no point within τ = {tolerance:g} of θpost's old-role score ({outcome.qualified} qualified"
                   f"{failed}): chose θpost; best/ holds the λ = 0 graft")
    else:
        click.echo(f"chosen: λ {outcome.chosen.lam:g}, ρ {outcome.chosen.rho:g} (of {outcome.qualified} within "
                   f"τ = {tolerance:g}{failed}); test {roles(outcome.chosen_test, 'test')}")
    click.echo("Pareto frontier (λ, ρ): " + ", ".join(f"({p.lam:g}, {p.rho:g})" for p in outcome.frontier))
    for path in outcome.written:
        click.echo(f"wrote {path}")
    click.echo(f"wrote {outcome.folder / 'results.jsonl'}, chosen.json, frontier.png")
