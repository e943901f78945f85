"""``graftmerge continual STREAM.yml -o DIR``: graft a stream of updates one after another and measure forgetting."""

from __future__ import annotations

from pathlib import Path

import click
from mergekit.options import MergeOptions, add_merge_options

from graftmerge.adapter import import_hook

EPILOG = """\b
An example STREAM.yml (paths relative to it; docs/continual.md has every field):
  post: ./post                      # θ0
  tasks: old-tasks.yml              # what θ0 must keep
  fisher: {prompts: prompts.jsonl, kind: diagonal, samples_per_prompt: 1, max_new_tokens: 24}
  grid: {lambda: [0.5, 1], rho: [0, 0.01]}
  tolerance: 0.01
  steps:
    - update: {donor: ./base, model: ./ft-1}    # a donor and its fine-tune
      tasks: step1-tasks.yml                    # what this step teaches
    - update: {model: ./lora-2, role: delta}    # or a delta folder / PEFT adapter
      tasks: step2-tasks.yml

\b
graftmerge continual stream.yml -o runs/stream
graftmerge continual stream.yml -o runs/stream --keep-steps all --no-baseline
"""


@click.command("continual", epilog=EPILOG)
@click.argument("stream_file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(file_okay=False),
              help="New (or empty) folder, or the folder of a killed run of the same stream to resume.")
@click.option("--keep-steps", type=click.Choice(["last", "all"]), default="last", show_default=True,
              help="last: once a step is done, the previous step's model and Fisher caches are removed (its "
                   "config, choice and scores stay); all: every step's model and caches stay.")
@click.option("--no-baseline", is_flag=True,
              help="Skip the task-arithmetic baseline (λ = 1, ρ = 0 at every step, no Fisher).")
@add_merge_options
def continual(merge_options: MergeOptions, stream_file: str, out_dir: str, keep_steps: str,
              no_baseline: bool) -> None:
    """Graft a stream of updates one after another, re-estimating the Fisher and re-choosing λ, ρ at each step.

    At step t, on the current model θ(t−1): its retention Fisher is
    estimated on prompts of everything it must keep (θ0's prompts and the
    non-test prompts of every earlier step's tasks), accumulated with the
    previous step's when fisher.accumulate is set; sweep --eval chooses λ
    and ρ (old = θ0's tasks and every earlier step's, new = this step's;
    the rule and τ of sweep --eval); the chosen model is DIR/step-t/model.
    Every model is scored on the test split of every task: DIR/matrix.json
    (the matrix, ACC, BWT, FWT, θ0 retention, each step's choice and
    timings) and DIR/matrix.png. A task-arithmetic baseline runs the same
    stream under DIR/baseline/. Run it again to resume a killed run.
    """
    # lazy: the pipeline, the estimator and the evaluator load torch; only when the command runs
    from graftmerge.pipeline.continual import run_continual
    from graftmerge.pipeline.continual_stream import read_stream

    import_hook.install()
    merge_options.apply_global_options()
    stream = read_stream(stream_file)
    services = real_services(merge_options, stream.dtype)
    matrix = run_continual(stream, out_dir, services, keep_steps=keep_steps, baseline=not no_baseline)
    _report(matrix, Path(out_dir))


def real_services(options: MergeOptions, weights_dtype: str, progress=None):
    """The estimator, the evaluator and ``sweep --eval``'s judge, as :class:`Services` of the pipeline."""
    # lazy: the estimator and the evaluator load torch and transformers; only when the command runs
    from graftmerge.api import EVAL_BATCH_SIZE, eval_judge
    from graftmerge.estimate.run import EstimateSettings, estimate_fisher
    from graftmerge.evaluation import Evaluator, load_model_for_eval, load_tasks, load_tokenizer
    from graftmerge.evaluation.roles import normalised
    from graftmerge.pipeline.continual import Services, TaskFile

    device = options.device or "cpu"
    dtype = "float32" if device == "cpu" else "bfloat16"  # `graftmerge eval`'s default, as sweep --eval's

    def read_tasks(path: Path) -> TaskFile:
        """The tasks file checked by the evaluator's reader; its names, weights, files and non-test prompts."""
        suite = load_tasks(path)
        prompts = [{"messages": list(example.messages)} if example.messages else {"prompt": example.prompt}
                   for task in suite.tasks for example in task.examples if example.split != "test"]
        return TaskFile(tuple(t.name for t in suite.tasks), tuple(t.weight for t in suite.tasks),
                        tuple(map(Path, suite.inputs)), tuple(prompts))

    def estimate(model: Path, prompts: Path, out: Path, fisher) -> None:
        """``graftmerge fisher estimate MODEL --prompts PROMPTS -o OUT`` with the stream's settings."""
        estimate_fisher(EstimateSettings(
            model=model, output=out, kind=fisher.kind, prompts=prompts, samples_per_prompt=fisher.samples_per_prompt,
            sample_batch_size=fisher.sample_batch_size, max_new_tokens=fisher.max_new_tokens,
            temperature=fisher.temperature, top_p=fisher.top_p, seed=fisher.seed, modules=fisher.modules,
            batch_size=fisher.batch_size, dtype=weights_dtype, device=device, progress=not options.quiet,
            trust_remote_code=options.trust_remote_code))

    def score(model: Path, tasks_file: Path) -> dict[str, float]:
        """``graftmerge eval MODEL --tasks TASKS --split test``'s normalised score per task."""
        suite = load_tasks(tasks_file)
        tokenizer = load_tokenizer(model, trust_remote_code=options.trust_remote_code)
        evaluator = Evaluator(suite, tokenizer, device=device, batch_size=EVAL_BATCH_SIZE,
                              progress=not options.quiet, splits=("test",))
        loaded = load_model_for_eval(model, device=device, dtype=dtype, trust_remote_code=options.trust_remote_code)[0]
        raw = evaluator.score(loaded, ("test",))
        return {task.name: normalised(task, raw[task.name]["test"]) for task in evaluator.suite.tasks}

    return Services(read_tasks, estimate, lambda tasks, post: eval_judge(load_tasks(tasks), str(post), options, dtype),
                    score, options, progress or (lambda line: None if options.quiet else click.echo(line)))


def _report(matrix: dict, out: Path) -> None:
    """ACC, BWT, FWT of the graft and the baseline; θ0 retention; where the outputs are."""
    def line(name: str, table: dict) -> str:
        number = lambda v: "n/a" if v is None else f"{v:+.4f}"  # noqa: E731
        return (f"{name}: ACC {table['average_accuracy']:.4f}, BWT {number(table['bwt'])}, FWT {number(table['fwt'])}"
                f"; θ0 retention {' → '.join(f'{v:.3f}' for v in table['post_retention'])}")

    for step in matrix["steps"]:
        if step["kept_previous"]:
            click.echo(f"step {step['step']}: no grid point kept the old-role score within τ; θ({step['step']}) is "
                       f"θ({step['step'] - 1}), kept")
    click.echo(line("continual graft", matrix))
    if "baseline" in matrix:
        click.echo(line("task-arithmetic baseline", matrix["baseline"]))
    click.echo(f"wrote {out / 'matrix.json'}, {out / 'matrix.png'}; final model {out / matrix['steps'][-1]['model']}")
