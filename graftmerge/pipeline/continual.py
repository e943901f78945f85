"""``graftmerge continual STREAM.yml -o DIR``: graft a stream of updates one after another, and measure forgetting.

At step t, on the current model θ(t−1): its retention Fisher is estimated on prompts drawn from
everything it must keep (θ0's prompts and the non-test prompts of every earlier step's tasks),
optionally accumulated with the previous step's (:mod:`graftmerge.pipeline.fisher_accumulate`);
``sweep --eval`` (:func:`run_sweep_eval`) chooses λ and ρ with old = θ0's tasks and every earlier
step's, new = this step's; its best/ becomes ``DIR/step-t/model`` = θ(t). Every model is scored
on the test split of every task, and ``DIR/matrix.json`` holds the matrix with ACC, BWT and FWT
(:mod:`graftmerge.math.forgetting`); a task-arithmetic baseline (λ = 1, ρ = 0, no Fisher) runs
the same stream beside it under ``DIR/baseline/``.

What lives in layers this one may not import (the estimator, the evaluator) comes in as
:class:`Services` (``graftmerge.cli.continual`` gives the real ones). DIR is filled in place and
locked; each phase's output is published whole (caches and model folders by rename, JSON
files replaced by rename), so a killed run resumes at the phase, and inside a sweep at the grid
point, where it stopped. docs/continual.md has the layout.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from mergekit.config import MergeConfiguration
from pydantic import ValidationError

from graftmerge.errors import GraftError
from graftmerge.formats.fisher_cache import MANIFEST_NAME
from graftmerge.formats.output_folder import check_not_inputs, locked
from graftmerge.math.forgetting import group_means, transfer
from graftmerge.pipeline.config_files import load_yaml_file, read_graft_config
from graftmerge.pipeline.continual_plot import plot_matrix
from graftmerge.pipeline.continual_stream import FisherSettings, Stream, Update
from graftmerge.pipeline.fisher_accumulate import accumulate_caches
from graftmerge.pipeline.graft_plan import GraftInputs, plan_from_merge_config
from graftmerge.pipeline.sweep import grid, run_sweep
from graftmerge.pipeline.sweep_eval import BEST, CHOSEN, Evaluation, Judge, run_sweep_eval

FORMAT = 1
HEADER, MATRIX, SCORES, TIMINGS = "continual.json", "matrix.json", "scores.json", "timings.json"
KEEP_STEPS = ("last", "all")
POST_NAME = "post"


@dataclass(frozen=True)
class TaskFile:
    """A checked tasks file as the stream needs it: task names, their weights, and every file it reads."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    files: tuple[Path, ...]
    prompts: tuple[dict, ...]  # retention prompts: the chat turns (or text) of every non-test example


@dataclass
class Services:
    """The work done by layers above this one, given by the caller (``graftmerge.cli.continual``)."""

    load_tasks: Callable[[Path], TaskFile]  # a tasks file checked (GraftError naming it)
    estimate: Callable[[Path, Path, Path, FisherSettings], None]  # (model, prompts file, cache out, settings)
    evaluation: Callable[[Path, Path], tuple[Evaluation, Callable[[], Judge]]]  # (tasks file, θpost folder)
    score: Callable[[Path, Path], dict[str, float]]  # (model, tasks file) → {task: normalised test score}
    options: object  # mergekit's MergeOptions for every merge and sweep
    progress: Callable[[str], None] = print


@dataclass
class _Run:
    """One run of a stream on a locked DIR."""

    stream: Stream
    out: Path
    services: Services
    tasks: list[TaskFile]  # θ0's, then each step's
    keep_steps: str
    baseline: bool
    steps: list[dict] = field(default_factory=list)


def check_continual(stream: Stream, out: str | Path, services: Services, keep_steps: str) -> list[TaskFile]:
    """Every check that can fail on bad input, before DIR is touched (docs/continual.md, Bad input)."""
    if keep_steps not in KEEP_STEPS:
        raise GraftError(f"--keep-steps must be one of {', '.join(KEEP_STEPS)}, got {keep_steps!r}")
    check_not_inputs(out, stream.inputs())
    tasks = [services.load_tasks(stream.tasks), *(services.load_tasks(step.tasks) for step in stream.steps)]
    owner: dict[str, str] = {}
    for number, task_file in enumerate(tasks):
        where = "θ0's tasks" if number == 0 else f"step {number}'s tasks"
        for name in task_file.names:
            if name in owner:
                raise GraftError(f"task name {name!r} is in {owner[name]} and in {where}: every task of a stream "
                                 "needs its own name (the matrix has one column per task)")
            owner[name] = where
    check_not_inputs(out, [("task data", path) for task_file in tasks for path in task_file.files])
    for number, step in enumerate(stream.steps, 1):
        _check_update(stream, step.update, number)
    return tasks


def _check_update(stream: Stream, update: Update, number: int) -> None:
    """The step's update grafted onto θ0 as a config would take it: architecture and shapes checked, nothing read."""
    try:
        merge_config = MergeConfiguration.model_validate(_graft_config(stream, stream.post, update, None, 1.0, 0.0))
        GraftInputs.open(plan_from_merge_config(merge_config))
    except GraftError as error:
        raise GraftError(f"step {number}'s update does not fit θ0 ({stream.post}): {error}") from None
    except ValidationError as error:
        raise GraftError(f"step {number}'s update is no valid graft input ({str(error).splitlines()[0]})") from None


def _graft_config(stream: Stream, base: Path, update: Update, fisher: Path | None, lam: float, rho: float) -> dict:
    """The graft config of one step: ``base`` (θ(t−1)) as base_model, the update's models, λ, ρ and the Fisher."""
    models = []
    if update.donor is not None:
        models.append({"model": str(update.donor), "parameters": {"role": "donor"}})
    models.append({"model": str(update.model), "parameters": {"role": update.role, "weight": update.weight}})
    parameters = {**stream.parameters, "lambda": lam, "rho": rho}
    if fisher is not None:
        parameters["fisher"] = str(fisher)
    config = {"merge_method": "graft", "base_model": str(base), "models": models, "parameters": parameters,
              "dtype": stream.dtype}
    if stream.out_dtype:
        config["out_dtype"] = stream.out_dtype
    return config


def run_continual(stream: Stream, out_dir: str | Path, services: Services, *, keep_steps: str = "last",
                  baseline: bool = True) -> dict:
    """Run (or resume) the stream into ``out_dir`` (module doc); returns matrix.json's content."""
    tasks = check_continual(stream, out_dir, services, keep_steps)
    header = {"kind": "graftmerge continual", "format": FORMAT, "stream_sha256": stream.sha256,
              "baseline": baseline, "keep_steps": keep_steps}
    with locked(out_dir) as out:
        _check_header(out, header)
        out.mkdir(exist_ok=True)
        if not (out / HEADER).exists():
            _write_json(out / HEADER, {**header, "stream": str(stream.source)})
        run = _Run(stream, out, services, tasks, keep_steps, baseline)
        _write_tasks(run, out / "tasks.yml", len(tasks), new_from=1)
        _scores(run, stream.post, out / POST_NAME)
        current = stream.post
        for number in range(1, len(stream.steps) + 1):
            current = _continual_step(run, number, current)
        if baseline:
            current = stream.post
            for number in range(1, len(stream.steps) + 1):
                current = _baseline_step(run, number, current)
        matrix = _matrix(run)
        _write_json(out / MATRIX, matrix)
        plot_matrix(out / "matrix.png", matrix)
    return matrix


def _check_header(out: Path, header: dict) -> None:
    """DIR is new, empty, or this stream's run to resume (same stream file bytes and settings)."""
    if os.path.islink(out) or (os.path.lexists(out) and not out.is_dir()):
        raise GraftError(f"output {out} exists and is not a folder (or is a link); choose another output folder")
    if not out.exists() or not any(not entry.name.startswith(".") for entry in out.iterdir()):
        return
    if not (out / HEADER).is_file():
        raise GraftError(f"output {out} already exists, is not empty and holds no {HEADER} of a continual run to "
                         "resume; choose a new folder")
    found = load_yaml_file(str(out / HEADER), "continual run header")[0]
    for key, value in header.items():
        if not isinstance(found, dict) or found.get(key) != value:
            raise GraftError(f"{out / HEADER} is another run's ({key} differs: the stream file changed, or "
                             "--keep-steps / --no-baseline); give the same stream and options to resume it, or "
                             "choose another output folder")


def _write_json(path: Path, data) -> None:
    """``path`` written whole: a temporary file beside it, fsynced, renamed over it."""
    _write_bytes(path, (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode())


def _write_bytes(path: Path, data: bytes) -> None:
    """``path`` written whole (temporary file, fsync, rename)."""
    temporary = path.parent / f".{path.name}.tmp-{os.getpid()}"
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _read_json(path: Path) -> dict | None:
    """A JSON file this run wrote (None when absent)."""
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _write_tasks(run: _Run, path: Path, count: int, new_from: int) -> None:
    """A tasks file of the first ``count`` task files (θ0's, steps 1 …): role old before ``new_from``, new from it.

    Each entry is the user's, with its role set and its data path made absolute.
    """
    entries = []
    for index, source in enumerate([run.stream.tasks, *(step.tasks for step in run.stream.steps)][:count]):
        document = load_yaml_file(str(source), "tasks file")[0]
        for entry in document["tasks"]:
            entry = {**entry, "role": "old" if index < new_from else "new"}
            if isinstance(entry.get("data"), str):
                entry["data"] = str((source.parent / entry["data"]).absolute())
            spec = entry.get("lm_eval")
            if isinstance(spec, dict) and isinstance(spec.get("include_path"), str):
                entry["lm_eval"] = {**spec, "include_path": str((source.parent / spec["include_path"]).absolute())}
            entries.append(entry)
    _write_bytes(path, yaml.safe_dump({"tasks": entries}, sort_keys=False, allow_unicode=True).encode())


def _scores(run: _Run, model: Path, folder: Path) -> dict:
    """``folder/scores.json``: ``model``'s normalised test score on every task of the stream (scored once)."""
    found = _read_json(folder / SCORES)
    if found is not None:
        return found
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    scores = run.services.score(model, run.out / "tasks.yml")
    record = {"model": str(model), "test": scores, "seconds": round(time.perf_counter() - start, 3)}
    _write_json(folder / SCORES, record)
    return record


def _timings(folder: Path, phase: str, seconds: float) -> None:
    """Add one phase's wall time to ``folder/timings.json`` (the run that finished the phase measured it)."""
    found = _read_json(folder / TIMINGS) or {}
    _write_json(folder / TIMINGS, {**found, phase: round(seconds, 3)})


def _continual_step(run: _Run, number: int, current: Path) -> Path:
    """Step ``number`` on θ(t−1) = ``current``: Fisher, sweep, θ(t) published as step-t/model, scored."""
    step = run.out / f"step-{number}"
    model = step / "model"
    step.mkdir(exist_ok=True)
    if not model.is_dir():
        run.services.progress(f"step {number}: retention Fisher of {current}")
        fisher = _step_fisher(run, number, current, step)
        config_file = step / "graft.yml"
        config = _graft_config(run.stream, current, run.stream.steps[number - 1].update, fisher, 1.0, 0.0)
        _write_bytes(config_file, yaml.safe_dump(config, sort_keys=False).encode())
        _write_tasks(run, step / "tasks.yml", number + 1, new_from=number)
        run.services.progress(f"step {number}: sweep --eval over {len(run.stream.lambdas) * len(run.stream.rhos)} "
                              "grid points")
        start = time.perf_counter()
        config, source, plan = read_graft_config(str(config_file))
        evaluation, make_judge = run.services.evaluation(step / "tasks.yml", current)
        run_sweep_eval(config, source, plan, list(run.stream.lambdas), list(run.stream.rhos), str(step / "sweep"),
                       run.services.options, evaluation, make_judge, tolerance=run.stream.tolerance, keep="best")
        _timings(step, "sweep", time.perf_counter() - start)
        os.rename(step / "sweep" / BEST, model)  # θ(t) appears whole, as the sweep wrote it
    chosen = _read_json(step / "sweep" / CHOSEN)["chosen"]
    run.services.progress(f"step {number}: " + (f"chose λ {chosen['lambda']:g}, ρ {chosen['rho']:g}" if chosen else
                          "no grid point kept θ(t−1)'s old-role score within τ: θ(t) is θ(t−1) (kept)"))
    _scores(run, model, step)
    if run.keep_steps == "last" and number > 1:
        _remove_step(run.out / f"step-{number - 1}")
    return model


def _remove_step(step: Path) -> None:
    """--keep-steps last: an earlier step's model and Fisher caches go once the next step is done (its files stay)."""
    for name in ("model", "fisher", "fisher-accumulated"):
        if (step / name).is_dir():
            shutil.rmtree(step / name)


def _step_fisher(run: _Run, number: int, current: Path, step: Path) -> Path:
    """θ(t−1)'s retention Fisher (step-t/fisher), accumulated with the last step's when the stream asks."""
    settings = run.stream.fisher
    fresh = step / "fisher"
    if not (fresh / MANIFEST_NAME).is_file():
        prompts = step / "prompts.jsonl"
        lines = run.stream.fisher.prompts.read_bytes().rstrip(b"\n") + b"\n"
        for task_file in run.tasks[1:number]:
            lines += b"".join((json.dumps(record) + "\n").encode() for record in task_file.prompts)
        _write_bytes(prompts, lines)
        start = time.perf_counter()
        run.services.estimate(current, prompts, fresh, settings)
        _timings(step, "estimate", time.perf_counter() - start)
    if settings.accumulate is None or number == 1:
        return fresh
    previous = run.out / f"step-{number - 1}"
    older = previous / "fisher-accumulated" if number > 2 else previous / "fisher"
    accumulated = step / "fisher-accumulated"
    if not (accumulated / MANIFEST_NAME).is_file():
        start = time.perf_counter()
        accumulate_caches(older, fresh, accumulated, settings.accumulate, progress=False)
        _timings(step, "accumulate", time.perf_counter() - start)
    return accumulated


def _baseline_step(run: _Run, number: int, current: Path) -> Path:
    """The task-arithmetic baseline's step: θb(t) = θb(t−1) + Δt (λ = 1, ρ = 0, no Fisher), written and scored."""
    step = run.out / "baseline" / f"step-{number}"
    model = step / "model"
    step.mkdir(parents=True, exist_ok=True)
    if not model.is_dir():
        point = grid([1.0], [0.0])[0]
        build = step / "build"
        if not (build / point.folder).is_dir():
            if build.is_dir():
                shutil.rmtree(build)
            config_file = step / "graft.yml"
            config = _graft_config(run.stream, current, run.stream.steps[number - 1].update, None, 1.0, 0.0)
            _write_bytes(config_file, yaml.safe_dump(config, sort_keys=False).encode())
            run.services.progress(f"baseline step {number}: task arithmetic (λ 1, ρ 0)")
            start = time.perf_counter()
            config, source, plan = read_graft_config(str(config_file))
            run_sweep(config, source, plan, [point], str(build), run.services.options)
            _timings(step, "merge", time.perf_counter() - start)
        os.rename(build / point.folder, model)
        build.rmdir()
    _scores(run, model, step)
    if run.keep_steps == "last" and number > 1:
        _remove_step(run.out / "baseline" / f"step-{number - 1}")
    return model


def _table(run: _Run, folders: list[Path]) -> dict:
    """models, test matrix, step matrix, ACC/BWT/FWT and θ0 retention of the models scored in ``folders``."""
    names = [name for task_file in run.tasks for name in task_file.names]
    weights = [weight for task_file in run.tasks for weight in task_file.weights]
    columns, start = [], 0
    for task_file in run.tasks:
        columns.append(list(range(start, start + len(task_file.names))))
        start += len(task_file.names)
    test = [[float(_read_json(folder / SCORES)["test"][name]) for name in names] for folder in folders]
    steps = [group_means(row, columns[1:], weights) for row in test]
    metrics = transfer(steps)
    return {"models": [POST_NAME, *(f"step-{n}" for n in range(1, len(folders)))], "test": test,
            "step_matrix": steps, "average_accuracy": metrics.average_accuracy, "bwt": metrics.bwt,
            "fwt": metrics.fwt, "post_retention": [group_means(row, columns[:1], weights)[0] for row in test]}


def _matrix(run: _Run) -> dict:
    """matrix.json: the tasks, the continual graft's table, each step's choice and timings, the baseline's table."""
    count = len(run.stream.steps)
    folders = [run.out / POST_NAME, *(run.out / f"step-{n}" for n in range(1, count + 1))]
    steps = []
    for number in range(1, count + 1):
        chosen = _read_json(run.out / f"step-{number}" / "sweep" / CHOSEN)
        timings = _read_json(run.out / f"step-{number}" / TIMINGS) or {}
        evaluation = _read_json(run.out / f"step-{number}" / SCORES)["seconds"]
        steps.append({"step": number, "chosen": chosen["chosen"], "kept_previous": chosen["chosen"] is None,
                      "model": f"step-{number}/model", "config": f"step-{number}/model/mergekit_config.yml",
                      "seconds": {**timings, "evaluation": evaluation}})
    matrix = {"format": FORMAT, "stream": str(run.stream.source),
              "tasks": [name for task_file in run.tasks for name in task_file.names],
              "task_groups": {POST_NAME: list(run.tasks[0].names),
                              **{f"step-{n}": list(run.tasks[n].names) for n in range(1, count + 1)}},
              **_table(run, folders), "steps": steps,
              "definitions": "R[i][j] (step_matrix) = weighted mean of model i's normalised test scores on step j's "
                             "tasks; ACC = mean_j R[T][j]; BWT = mean_{j<T} (R[T][j] − R[j][j]); "
                             "FWT = mean_{j≥2} (R[j−1][j] − R[0][j]) (Lopez-Paz & Ranzato 2017, θ0 as R[0])"}
    if run.baseline:
        base = [run.out / POST_NAME, *(run.out / "baseline" / f"step-{n}" for n in range(1, count + 1))]
        matrix["baseline"] = {"method": "task arithmetic: λ 1, ρ 0 at every step, no Fisher", **_table(run, base)}
    return matrix
