"""``graftmerge sweep CONFIG --lambda ... --rho ... -o DIR [--eval TASKS]``: a grid of grafts from one read of the
inputs."""

from __future__ import annotations

import click
from mergekit.options import MergeOptions, add_merge_options

from graftmerge.adapter import import_hook
from graftmerge.cli.plan import parse_values
from graftmerge.errors import GraftError

KEEP_CHOICES = ("best", "frontier", "all")  # graftmerge.pipeline.sweep_eval.KEEP (not imported: --help stays fast)
EVAL_BATCH_SIZE = 16


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
    # lazy: the graft plan and the sweep load mergekit's merge code only when the command runs, so --help stays fast
    from graftmerge.pipeline.config_files import read_graft_config
    from graftmerge.pipeline.sweep import grid, run_sweep

    import_hook.install()
    merge_options.apply_global_options()
    lambdas = parse_values(lambda_list, "--lambda")
    rhos = parse_values(rho_list, "--rho", rho=True)
    if tasks_file is not None:
        _sweep_with_eval(merge_options, config_file, lambdas, rhos, out_dir, tasks_file, tolerance, keep, eval_dtype)
        return
    if tolerance is not None or keep is not None or eval_dtype is not None:
        raise GraftError("--tolerance, --keep and --eval-dtype are about evaluated points: they need --eval TASKS.yml")
    config, source, plan = read_graft_config(config_file)
    folders = run_sweep(config, source, plan, grid(lambdas, rhos), out_dir, merge_options)
    for folder in folders:
        click.echo(f"wrote {folder}")


def _sweep_with_eval(options: MergeOptions, config_file: str, lambdas: list[float], rhos: list[float], out_dir: str,
                     tasks_file: str, tolerance: float | None, keep: str | None, eval_dtype: str | None) -> None:
    """``sweep --eval``: the task file and τ checked first, then the sweep with θpost as the evaluation model."""
    # lazy: evaluation loads transformers and the task file's data only when --eval is given
    from graftmerge.pipeline.sweep_eval import DEFAULT_TOLERANCE, check_tolerance, run_sweep_eval

    tolerance = check_tolerance(DEFAULT_TOLERANCE if tolerance is None else tolerance)
    config, source, plan, evaluation, make_judge = evaluation_setup(options, tasks_file, config_file, eval_dtype,
                                                                    "sweep --eval")
    outcome = run_sweep_eval(config, source, plan, lambdas, rhos, out_dir, options, evaluation, make_judge,
                             tolerance=tolerance, keep=keep or "best")
    _report(outcome, tolerance)


def evaluation_setup(options: MergeOptions, tasks_file: str, config_file: str, eval_dtype: str | None,
                     command: str) -> tuple:
    """(config, source, plan, Evaluation, make_judge) of an evaluating sweep or search: the tasks read and checked
    first (a task of each role), then the config, the evaluation dtype (auto: what the merge writes)."""
    # lazy: evaluation loads transformers and the task file's data only when --eval is given
    from graftmerge.evaluation import load_tasks
    from graftmerge.pipeline.config_files import read_graft_config
    from graftmerge.pipeline.sweep_eval import written_dtype

    suite = load_tasks(tasks_file)
    missing = [role for role in ("old", "new") if role not in {task.role for task in suite.tasks}]
    if missing:
        raise GraftError(f"{tasks_file}: no task has role {missing[0]}; {command} chooses by the scores of both "
                         "roles, so it needs a task of each")
    config, source, plan = read_graft_config(config_file)
    device = options.device or "cpu"
    dtype = eval_dtype or ("float32" if device == "cpu" else "bfloat16")  # `graftmerge eval`'s default
    dtype = written_dtype(config, plan.post) if dtype == "auto" else dtype
    return (config, source, plan, *eval_judge(suite, plan.post, options, dtype))


def eval_judge(suite, post: str, options: MergeOptions, dtype: str):
    """(Evaluation, make_judge) of ``sweep --eval``: ``suite`` scored on validation and test, θpost loaded from
    ``post`` (a folder) in ``dtype`` on the options' device; ``graftmerge continual`` uses it at every step."""
    # lazy: evaluation loads transformers; only when a sweep scores its points
    from graftmerge.evaluation import Evaluator, load_model_for_eval, load_tokenizer, role_scores
    from graftmerge.pipeline.sweep_eval import Evaluation, Judge

    device = options.device or "cpu"
    files = tuple(map(str, suite.inputs))  # DIR may be none of them, nor inside one (an include_path included)
    evaluation = Evaluation(files, suite.fingerprint, {"dtype": dtype, "device": device, "batch_size": EVAL_BATCH_SIZE})

    def make_judge() -> Judge:
        """The evaluator (every task checked against θpost's tokenizer) and how to load θpost's weights."""
        tokenizer = load_tokenizer(post, trust_remote_code=options.trust_remote_code)
        evaluator = Evaluator(suite, tokenizer, device=device, batch_size=EVAL_BATCH_SIZE,
                              progress=not options.quiet, splits=("validation", "test"))

        def load_model():
            """θpost's weights, as `graftmerge eval` loads a folder."""
            return load_model_for_eval(post, device=device, dtype=dtype, trust_remote_code=options.trust_remote_code)[0]

        return Judge(load_model, lambda scored, splits: evaluator.score(scored, splits),
                     lambda scores, split: role_scores(evaluator.suite, scores, split))

    return evaluation, make_judge


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
