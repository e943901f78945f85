"""The user's three jobs as plain Python functions: merge a config, estimate a Fisher cache, sweep a grid.

Each does what its command does (``graftmerge merge``, ``graftmerge fisher estimate``,
``graftmerge sweep``), through the same code, without printing: bad input raises
:class:`~graftmerge.errors.GraftError` with the command's one-line message, and nothing is
half-written. Exported from ``graftmerge`` (docs/python-api.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import mergekit.merge
from mergekit.options import MergeOptions
from pydantic import ValidationError

from graftmerge.adapter import registration
from graftmerge.errors import GraftError
from graftmerge.estimate import run as estimate_run
from graftmerge.evaluation import Evaluator, load_model_for_eval, load_tasks, load_tokenizer, role_scores
from graftmerge.hub.models import localize_models
from graftmerge.pipeline.config_files import read_graft_config, read_merge_config
from graftmerge.pipeline.sweep import grid, run_sweep
from graftmerge.pipeline.sweep_eval import (
    DEFAULT_TOLERANCE,
    Evaluation,
    Judge,
    SweepOutcome,
    check_tolerance,
    run_sweep_eval,
    written_dtype,
)

PathLike = str | os.PathLike
EVAL_BATCH_SIZE = 16  # what `graftmerge sweep --eval` scores with
KINDS = ("diagonal", "kfac", "both")  # `graftmerge fisher estimate --kind`
# EstimateSettings fields the function's own arguments (or nobody) set
_ESTIMATE_OWN = {"model", "output", "prompts", "rollouts", "kind", "fsdp", "dry_run", "extra"}


def merge(config: PathLike, out: PathLike, *, options: MergeOptions | Mapping[str, Any] | None = None) -> Path:
    """Run a merge config (``graft`` or any mergekit method) and write the model to ``out``; returns ``out``.

    The same as ``graftmerge merge CONFIG OUT`` and ``mergekit-yaml``: a graft config is checked
    completely and its global threshold found before a tensor is merged. ``options``: mergekit's
    ``MergeOptions``, or a dict of its fields (``{"cuda": True, "out_shard_size": "2G"}``).
    """
    merge_options = _merge_options(options)
    merge_options.apply_global_options()
    parsed, source = read_merge_config(os.fspath(config))
    _ensure_registered()
    mergekit.merge.run_merge(localize_models(parsed), os.fspath(out), options=merge_options, config_source=source)
    return Path(out)


def estimate_fisher(model: PathLike, out: PathLike, *, prompts: PathLike | Iterable[Mapping] | None = None,
                    rollouts: PathLike | Iterable[Mapping] | None = None, kind: str = "diagonal",
                    **settings: Any) -> Path:
    """Estimate ``model``'s retention Fisher into the cache folder ``out``; returns ``out``.

    Exactly one of ``prompts`` (the model samples its own replies: ``prompt``, ``prompt_ids`` or
    ``messages`` records) and ``rollouts`` (finished sequences: ``prompt_ids`` + ``completion_ids``,
    ``prompt`` + ``completion`` or ``messages``), each a JSONL file or the records themselves.
    ``kind``: ``diagonal``, ``kfac`` or ``both``. ``settings``: the other options of
    ``graftmerge fisher estimate`` by their Python names (``samples_per_prompt``,
    ``max_new_tokens``, ``modules``, ``batch_size``, ``overwrite``, ``progress``, ...).
    """
    if kind not in KINDS:
        raise GraftError(f"estimate_fisher: kind must be one of {', '.join(KINDS)}, not {kind!r}")
    fields = {field.name for field in dataclasses.fields(estimate_run.EstimateSettings)} - _ESTIMATE_OWN
    unknown = sorted(set(settings) - fields)
    if unknown:
        raise GraftError(f"estimate_fisher: unknown setting {unknown[0]!r}; the settings are "
                         f"{', '.join(sorted(fields))}")
    if "modules" in settings:
        settings["modules"] = tuple(settings["modules"])
    with tempfile.TemporaryDirectory(prefix="graftmerge-records-") as scratch:
        written = estimate_run.estimate_fisher(estimate_run.EstimateSettings(
            model=Path(model), output=Path(out), kind=kind, prompts=_jsonl(prompts, Path(scratch), "prompts"),
            rollouts=_jsonl(rollouts, Path(scratch), "rollouts"), **settings))
    return Path(written) if written is not None else Path(out)


def sweep(config: PathLike, out: PathLike, *, lambdas: Sequence[float], rhos: Sequence[float],
          eval: PathLike | None = None, tolerance: float | None = None, keep: str | None = None,
          eval_dtype: str | None = None, options: MergeOptions | Mapping[str, Any] | None = None,
          ) -> list[Path] | SweepOutcome:
    """Graft the graft config ``config`` once per (λ, ρ) of ``lambdas`` × ``rhos``, reading the inputs once.

    Without ``eval``: one model folder per point under ``out`` (``lambda-<λ>_rho-<ρ>``); returns
    their paths. With ``eval`` (a tasks file): every point is grafted in memory and scored on
    validation, and the rule's choice (the best new-role score whose old-role score is within
    ``tolerance`` of θpost's) is written to ``out/best/`` with ``chosen.json``, ``frontier.png``
    and ``results.jsonl``; returns the outcome (``chosen``, ``frontier``, ``post``, ``chosen_test``).
    The same as ``graftmerge sweep`` (docs/sweeps.md).
    """
    merge_options = _merge_options(options)
    merge_options.apply_global_options()
    lambdas, rhos = grid_values(lambdas, "lambdas"), grid_values(rhos, "rhos", rho=True)
    _ensure_registered()
    if eval is not None:
        return _sweep_with_eval(merge_options, os.fspath(config), lambdas, rhos, os.fspath(out), os.fspath(eval),
                                tolerance, keep, eval_dtype)
    if tolerance is not None or keep is not None or eval_dtype is not None:
        raise GraftError("tolerance, keep and eval_dtype are about evaluated points: they need eval=TASKS.yml")
    parsed, source, plan = read_graft_config(os.fspath(config))
    return run_sweep(parsed, source, plan, grid(lambdas, rhos), os.fspath(out), merge_options)


def grid_values(values: Sequence[float], name: str, *, rho: bool = False) -> list[float]:
    """The numbers of one grid axis as floats; GraftError for none, a repeat, a non-finite value, ρ outside [0, 1)."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence) or not values:
        raise GraftError(f"{name} needs a non-empty list of numbers, got {values!r}")
    checked: list[float] = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise GraftError(f"{name}: {value!r} is not a finite number")
        if rho and not 0 <= value < 1:
            raise GraftError(f"{name}: rho must be in [0, 1), got {value}")
        if float(value) in checked:
            raise GraftError(f"{name}: {value} is listed twice")
        checked.append(float(value))
    return checked


def _sweep_with_eval(options: MergeOptions, config_file: str, lambdas: list[float], rhos: list[float], out_dir: str,
                     tasks_file: str, tolerance: float | None, keep: str | None,
                     eval_dtype: str | None) -> SweepOutcome:
    """``sweep --eval``: the task file and τ checked first, then the sweep with θpost as the evaluation model."""
    tolerance = check_tolerance(DEFAULT_TOLERANCE if tolerance is None else tolerance)
    config, source, plan, evaluation, make_judge = evaluation_setup(options, tasks_file, config_file, eval_dtype,
                                                                    "sweep --eval")
    return run_sweep_eval(config, source, plan, lambdas, rhos, out_dir, options, evaluation, make_judge,
                          tolerance=tolerance, keep=keep or "best")


def evaluation_setup(options: MergeOptions, tasks_file: str, config_file: str, eval_dtype: str | None,
                     command: str) -> tuple:
    """(config, source, plan, Evaluation, make_judge) of an evaluating sweep or search: the tasks read and checked
    first (a task of each role), then the config, the evaluation dtype (auto: what the merge writes)."""
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


def eval_judge(suite, post: str, options: MergeOptions, dtype: str) -> tuple[Evaluation, Callable[[], Judge]]:
    """(Evaluation, make_judge) of ``sweep --eval``: ``suite`` scored on validation and test, θpost loaded from
    ``post`` (a folder) in ``dtype`` on the options' device; ``graftmerge continual`` uses it at every step."""
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


def _merge_options(options: MergeOptions | Mapping[str, Any] | None) -> MergeOptions:
    """mergekit's options from a MergeOptions, a dict of its fields, or nothing (its defaults)."""
    if isinstance(options, MergeOptions):
        return options
    if options is not None and not isinstance(options, Mapping):
        raise GraftError("options must be a mergekit MergeOptions or a dict of its fields, got "
                         f"{type(options).__name__}")
    try:
        return MergeOptions.model_validate(dict(options or {}))
    except ValidationError as error:
        problem = error.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        raise GraftError(f"options: {where}: {problem['msg']}") from None


def _ensure_registered() -> None:
    """graft, fisher and regmean known to mergekit and run_merge wrapped, with or without graftmerge_hook.pth."""
    registration.register_methods()
    registration.wrap_run_merge(mergekit.merge)


def _jsonl(records: PathLike | Iterable[Mapping] | None, scratch: Path, name: str) -> Path | None:
    """A JSONL file's path as given, or records written to one in ``scratch`` (None stays None)."""
    if records is None or isinstance(records, str | os.PathLike):
        return None if records is None else Path(records)
    if isinstance(records, Mapping | bytes):
        raise GraftError(f"{name} must be a JSONL file's path or a list of records (dicts), got one "
                         f"{type(records).__name__}")
    lines = []
    for number, record in enumerate(records, 1):
        if not isinstance(record, Mapping):
            raise GraftError(f"{name}: record {number} is a {type(record).__name__}, not a dict")
        lines.append(json.dumps(dict(record)))
    path = scratch / f"{name}.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path
