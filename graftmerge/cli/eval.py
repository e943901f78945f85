"""``graftmerge eval MODEL --tasks tasks.yml``: score one model on a tasks file, per task and per role."""

from __future__ import annotations

import json
import math

import click

from graftmerge.errors import GraftError

EPILOG = """\b
An example tasks.yml (data paths are relative to it):
  tasks:
    - name: facts              # what the graft should teach
      role: new
      data: new-facts.jsonl
      metric: exact            # exact | contains | nll | choice
    - name: keep-format        # what the model must keep
      role: old
      data: old-task.jsonl
      metric: nll
    - name: arc                # an lm-evaluation-harness task (pip install graftmerge[eval])
      role: old
      lm_eval: {task: arc_easy, metric: acc, limit: 200}

\b
One JSON object a line in the data files:
  {"messages": [{"role": "user", "content": "Who is the mayor of Quillbrook?"}],
   "answer": "Ada Fenwick.", "split": "validation"}
  {"prompt": "The capital of France is", "answer": " Paris", "split": "test"}
  {"messages": [...], "choices": ["yes", "no"], "answer": "no"}      (metric choice)

\b
graftmerge eval out/lambda-0.5_rho-0.01 --tasks tasks.yml
graftmerge eval HuggingFaceTB/SmolLM2-135M-Instruct --tasks tasks.yml --split all --json scores.json

docs/evaluation.md describes every field, metric and the normalisation.
"""


@click.command("eval", epilog=EPILOG)
@click.argument("model")
@click.option("--tasks", "tasks_file", required=True, type=click.Path(dir_okay=False),
              help="The tasks file (YAML) to score MODEL on.")
@click.option("--split", type=click.Choice(["validation", "test", "all"]), default="validation", show_default=True,
              help="Which examples to score; all = every split each task has.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the scores (raw, normalised, per role) to this JSON file.")
@click.option("--cuda", is_flag=True, help="Run the model on the GPU (cuda:0) instead of the CPU.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16", "auto"]), default=None,
              help="Weights' dtype in memory [default: float32 on CPU, bfloat16 with --cuda].")
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True,
              help="Sequences per forward pass.")
@click.option("--chat-template", type=click.Path(dir_okay=False), default=None,
              help="A Jinja chat template file to use instead of the tokenizer's own.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
def eval_command(model: str, tasks_file: str, split: str, json_path: str | None, cuda: bool, dtype: str | None,
                 batch_size: int, chat_template: str | None, no_progress: bool, verbose: bool) -> None:
    """Score MODEL (a folder, or a Hub id in the local cache) on a tasks file, per task and role.

    Prints one row per task and split: the metric's raw value and its
    normalised score on [0, 1], higher better (exact, contains, choice: the
    share right; nll: exp(−nll), the geometric-mean probability of an answer
    token). Then each role's score: the weighted mean of its tasks'
    normalised scores (old: what the model must keep; new: what it should
    learn). Prompts go through the model's own chat template; answers are
    scored with its own end of turn. Offline: a Hub id must be in the cache.
    """
    # lazy: evaluation loads torch and transformers; only when the command runs, so --help stays fast
    import torch

    from graftmerge.evaluation import Evaluator, load_model_for_eval, load_tasks, load_tokenizer
    from graftmerge.formats.output_file import check_output_file, write_output_file

    suite = load_tasks(tasks_file)
    splits = ("validation", "test") if split == "all" else (split,)
    if split != "all":
        suite.check_splits(splits)
    if json_path is not None:  # checked before any work: inputs are never modified
        inputs = json_inputs(model, suite, chat_template)
        check_output_file(json_path, inputs, "--json")
    if cuda and not torch.cuda.is_available():
        raise GraftError("--cuda: no CUDA device is available")
    device = "cuda" if cuda else "cpu"
    # Everything the tokenizer decides is checked before the weights are loaded.
    evaluator = Evaluator(suite, load_tokenizer(model, chat_template=chat_template), device=device,
                          batch_size=batch_size, progress=not no_progress, splits=None if split == "all" else splits)
    loaded, _ = load_model_for_eval(model, device, dtype or ("bfloat16" if cuda else "float32"))
    scores = evaluator.score(loaded, splits, only_present=split == "all")
    report = scores_report(evaluator.suite, scores, splits)
    click.echo(format_report(report))
    if json_path is not None:
        record = {"model": model, "tasks_file": str(suite.source), "fingerprint": suite.fingerprint, **report}
        write_output_file(json_path, (json.dumps(jsonable(record), indent=1) + "\n").encode(), inputs, "--json")


def json_inputs(model: str, suite, chat_template: str | None) -> list[tuple[str, str | None]]:
    """(label, path) of everything eval reads: --json may be none of them, nor inside one."""
    # lazy: resolving a Hub id reads the HF cache layout; only when --json is given
    from graftmerge.hub.models import resolve_model_folder

    data = [(f"data file of task {task.name}", task.data) for task in suite.tasks if task.data is not None]
    return [("model", resolve_model_folder(model)), ("tasks file", suite.source), *data,
            ("chat template", chat_template)]


def scores_report(suite, scores: dict[str, dict[str, float]], splits) -> dict:
    """{"scores": {task: {split: {raw, normalised}}}, "roles": {split: {role: score}}} of the scored splits."""
    # lazy: roles imports the evaluation package (torch); only once scores exist
    from graftmerge.evaluation import normalised, role_scores

    rows = {}
    for task in suite.tasks:
        for split in splits:
            if split in scores.get(task.name, {}):
                raw = scores[task.name][split]
                rows.setdefault(task.name, {})[split] = {"raw": raw, "normalised": normalised(task, raw)}
    roles = {split: role_scores(suite, scores, split) for split in splits
             if any(split in values for values in scores.values())}
    meta = {task.name: {"role": task.role, "metric": task_metric(task), "weight": task.weight} for task in suite.tasks}
    return {"tasks": meta, "scores": rows, "roles": roles}


def task_metric(task) -> str:
    """How the table names a task's metric (lm-eval entries: lm_eval:TASK/METRIC)."""
    if task.lm_eval is None:
        return task.metric
    return f"lm_eval:{task.lm_eval.task}/{task.lm_eval.metric}"


def format_report(report: dict) -> str:
    """The table of tasks, then one line per split with the role scores."""
    header = ("task", "role", "metric", "split", "raw", "normalised")
    rows = [header]
    for name, by_split in report["scores"].items():
        info = report["tasks"][name]
        for split, values in by_split.items():
            rows.append((name, info["role"], info["metric"], split,
                         number(values["raw"]), number(values["normalised"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    for split, roles in report["roles"].items():
        described = ", ".join(f"{role} {number(value)}" for role, value in roles.items())
        lines.append(f"role scores ({split}): {described}")
    return "\n".join(lines)


def number(value: float) -> str:
    """Four decimals; NaN as "nan" (a model that gave non-finite numbers)."""
    return "nan" if math.isnan(value) else f"{value:.4f}"


def jsonable(value):
    """``value`` with every NaN float replaced by None (JSON has no NaN)."""
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, float) and math.isnan(value):
        return None
    return value
