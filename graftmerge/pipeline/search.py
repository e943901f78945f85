"""``graftmerge search CONFIG --eval TASKS -o DIR --trials N``: a multi-objective search instead of a grid.

Each trial is one point of the search space, grafted in memory into the one evaluation model and
scored on validation exactly as ``sweep --eval`` scores a grid point
(:mod:`graftmerge.pipeline.sweep_eval`: the same planner, kernel, casts and model weights), so a
trial's record is the record the sweep would write for that point. The two objectives are the
old-role and new-role validation scores, both maximised. The space: λ in a range, and, when
the config names a Fisher cache, a mask or not and ρ log-uniform in a range; with
``per_layer`` = G, λ as G anchors of a mergekit gradient over the layers (``lambda: [a1, …, aG]``),
so that every point is a config stock ``mergekit-yaml`` runs.

The study is Optuna's, in ``DIR/study.journal`` (:mod:`graftmerge.pipeline.search_study`):
trials are claimed, evaluated and told there, by this process and by any worker that joins
(``--workers K`` starts K − 1 more on this machine; ``--join`` joins from another). Killed, a
search resumes from the journal: a trial left running by a dead worker is evaluated again with
the same parameters, and the next trials are sampled from the same seed and the same finished
trials, so the results are those of an uninterrupted search. When every trial is finished, the
rule of ``sweep --eval`` chooses among them on validation; the chosen trial and the Pareto
frontier are scored on test; ``best/`` (the folder-writing sweep's output, equal to
``mergekit-yaml`` of its ``mergekit_config.yml``), ``results.jsonl`` (written whole from the
journal, in trial order), ``frontier.png`` and ``chosen.json`` (last) are written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from graftmerge.errors import GraftError
from graftmerge.formats.output_folder import MERGE, check_not_inputs, check_replaceable, locked, recover
from graftmerge.formats.results_log import read_log, record_line
from graftmerge.formats.sweep_log import SEARCH_FIELD, parse_sweep_log
from graftmerge.math.frontier import hypervolume
from graftmerge.pipeline.graft_plan import GraftInputs, GraftPlan, plan_inputs
from graftmerge.pipeline.mergekit_inputs import check_mergekit_inputs
from graftmerge.pipeline.schedules import is_schedule
from graftmerge.pipeline.search_study import JOURNAL, Dimension, Study, sample, stored_header
from graftmerge.pipeline.sweep import GridPoint
from graftmerge.pipeline.sweep_eval import (
    BEST,
    CHOSEN,
    PLOT,
    POST_POINT,
    RESULTS,
    SCRATCH,
    TEST,
    VALIDATION,
    Evaluation,
    Judge,
    _EvalSweep,
    _number,
    _replace_file,
    _write_plot,
    check_post_scores,
    check_tolerance,
    chosen_summary,
    select,
    sweep_header,
)

LAMBDA_RANGE = (0.0, 1.5)
RHO_RANGE = (1e-4, 0.1)
CLAIM_LOCK = ".search.claim.lock"
OURS = (RESULTS, CHOSEN, PLOT, BEST, JOURNAL, f"{JOURNAL}.lock")


@dataclass(frozen=True)
class SearchPoint(GridPoint):
    """A trial's point: λ and ρ as a grid point's, or (``layers``) λ as per-layer anchors (``lam``: their mean),
    and under ``rho_scope: tensor`` (``rho_layers``) ρ too (``rho``: their mean)."""

    layers: tuple[float, ...] = ()
    trial: int = -1
    rho_layers: tuple[float, ...] = ()
    config: int = 0  # which of the searched configs (their order on the command line)

    def settings(self, parameters) -> dict:
        """The config's global parameters at this point: λ (and ρ) mergekit gradients of the anchors."""
        found = super().settings(parameters)
        if self.layers:
            found["lambda"] = [float(value) for value in self.layers]
        if self.rho_layers:
            found["rho"] = [float(value) for value in self.rho_layers]
        return found

    @property
    def folder(self) -> str:
        """``trial-<n>``: a search's points are numbered."""
        return f"trial-{self.trial}"


@dataclass(frozen=True)
class Space:
    """What is searched: λ's range, ρ's (None: no mask, the config has no Fisher cache), per-layer anchors."""

    lam: tuple[float, float] = LAMBDA_RANGE
    rho: tuple[float, float] | None = RHO_RANGE
    per_layer: int = 0
    rho_per_layer: bool = False  # ρ as anchors too (per_layer with rho_scope: tensor)
    configs: int = 1  # several configs: one categorical choice among them

    def dimensions(self) -> list[Dimension]:
        """The Optuna dimensions: lambda (or lambda_0 … lambda_{G−1}), masked and rho when ρ is searched."""
        names = [f"lambda_{i}" for i in range(self.per_layer)] if self.per_layer else ["lambda"]
        found = [Dimension(name, *self.lam) for name in names]
        if self.rho is not None:
            names = [f"rho_{i}" for i in range(self.per_layer)] if self.rho_per_layer else ["rho"]
            found += [Dimension("masked", choice=True), *(Dimension(name, *self.rho, log=True) for name in names)]
        if self.configs > 1:
            found.append(Dimension("config", choices=tuple(range(self.configs))))
        return found

    def point(self, params: dict, trial: int) -> SearchPoint:
        """The point of a trial's parameters (ρ = 0 when not masked)."""
        masked = self.rho is not None and params["masked"]
        rho = float(params["rho"]) if masked and not self.rho_per_layer else 0.0
        rhos = tuple(float(params[f"rho_{i}"]) for i in range(self.per_layer)) if masked and self.rho_per_layer else ()
        config = int(params.get("config", 0))
        if self.per_layer:
            layers = tuple(float(params[f"lambda_{i}"]) for i in range(self.per_layer))
            return SearchPoint(sum(layers) / len(layers), sum(rhos) / len(rhos) if rhos else rho, layers, trial, rhos,
                               config)
        return SearchPoint(float(params["lambda"]), rho, (), trial, (), config)

    def params(self, lam: float | list[float], rho: float | list[float], config: int = 0) -> dict:
        """A trial's parameters for λ and ρ (one value each, or anchors) and the config; GraftError when outside
        the space."""
        if not 0 <= config < self.configs:
            raise GraftError(f"a warm-start point is of config {config}, but {self.configs} config(s) are searched")
        chosen = {"config": config} if self.configs > 1 else {}
        anchors = lam if isinstance(lam, list) else [lam] * max(self.per_layer, 1)
        if self.per_layer and len(anchors) != self.per_layer:
            raise GraftError(f"a warm-start point has {len(anchors)} per-layer λ anchors, the search {self.per_layer}")
        if not all(self.lam[0] <= value <= self.lam[1] for value in anchors):
            raise GraftError(f"a warm-start point's λ {lam} is outside the searched range {list(self.lam)}; widen "
                             "--lambda-range or leave it out")
        found = ({f"lambda_{i}": float(v) for i, v in enumerate(anchors)} if self.per_layer
                 else {"lambda": float(anchors[0])})
        rhos = rho if isinstance(rho, list) else [rho] * (self.per_layer if self.rho_per_layer else 1)
        if self.rho is None:
            if any(rhos):
                raise GraftError(f"a warm-start point has ρ {rho}, but the search masks nothing (--rho-range none)")
            return {**found, **chosen}
        if any(rhos) and not all(self.rho[0] <= value <= self.rho[1] for value in rhos):
            raise GraftError(f"a warm-start point's ρ {rho} is outside the searched range {list(self.rho)}; widen "
                             "--rho-range or leave it out")
        if len(rhos) != (self.per_layer if self.rho_per_layer else 1):
            raise GraftError(f"a warm-start point has {len(rhos)} ρ anchors, the search "
                             f"{self.per_layer if self.rho_per_layer else 1}")
        names = [f"rho_{i}" for i in range(len(rhos))] if self.rho_per_layer else ["rho"]
        return {**found, "masked": bool(any(rhos)),
                **{name: float(value) if any(rhos) else float(self.rho[0]) for name, value in zip(names, rhos)},
                **chosen}

    def corners(self) -> list[dict]:
        """The grid's corners: each end of λ's range (its middle instead of λ = 0, which is θpost, scored
        already), without a mask and at ρ's top (of each config)."""
        rhos = [0.0] if self.rho is None else [0.0, self.rho[1]]
        low, high = self.lam
        lams = list(dict.fromkeys([low if low > 0 else (low + high) / 2, high]))
        return [self.params(lam, rho, config) for config in range(self.configs) for lam in lams for rho in rhos]


@dataclass
class SearchRequest:
    """One search: its budget, seed, τ, warm start and who runs it."""

    trials: int
    seed: int = 0
    tolerance: float = 0.01
    warm_start: str = "corners"  # "corners", "none" or a previous results.jsonl
    workers: int = 1
    join: bool = False
    startup: int | None = None  # random trials before TPE models the frontier (default: a third of the budget)


@dataclass
class SearchOutcome:
    """What a finished search chose and wrote."""

    folder: Path
    post: dict
    chosen: SearchPoint | None
    chosen_test: dict | None
    frontier: list[SearchPoint]
    trials: int
    hypervolume: float
    written: list[Path]


def check_request(request: SearchRequest, space: Space) -> None:
    """GraftError for a budget, range, worker count or per-layer count no search can run."""
    if isinstance(request.trials, bool) or not isinstance(request.trials, int) or request.trials < 1:
        raise GraftError(f"--trials must be at least 1, got {request.trials}")
    if request.workers < 1:
        raise GraftError(f"--workers must be at least 1, got {request.workers}")
    low, high = space.lam
    if not (0 <= low <= high) or not all(map(_finite, space.lam)):
        raise GraftError(f"--lambda-range must be two numbers 0 ≤ low ≤ high, got {low},{high} (λ < 0 would "
                         "subtract the update)")
    if space.rho is not None:
        low, high = space.rho
        if not (0 < low <= high < 1) or not all(map(_finite, space.rho)):
            raise GraftError(f"--rho-range must be two numbers 0 < low ≤ high < 1 (ρ is log-uniform; a trial may "
                             f"also have no mask), got {low},{high}")
    check_tolerance(request.tolerance)


def _finite(value: float) -> bool:
    """Whether ``value`` is a finite number."""
    return value == value and abs(value) != float("inf")


def check_config(config, plan: GraftPlan, space: Space) -> None:
    """GraftError for a config whose λ or ρ the search cannot set, or more per-layer anchors than layers."""
    parameters = config.parameters or {}
    if space.per_layer and is_schedule(parameters.get("lambda")):
        raise GraftError("--per-layer searches λ as a per-layer schedule, but the config already fixes one "
                         "(`lambda:` is a list or a filter); give it one number, or search without --per-layer")
    if is_schedule(parameters.get("rho")):
        raise GraftError("the search sets ρ, but the config fixes a per-layer schedule of it (`rho:` is a list or "
                         "a filter); give it one number")
    if space.rho is not None and not plan.fisher:
        raise GraftError("the config names no Fisher cache (`fisher:`), so no mask can be searched; add one, or "
                         "pass --rho-range none")
    if space.per_layer:
        layers = _layer_count(plan.post)
        if space.per_layer > layers:
            raise GraftError(f"--per-layer {space.per_layer} is more anchors than {plan.post} has layers "
                             f"({layers}); give at most {layers}")


def _layer_count(post: str) -> int:
    """The post model's number of layers (config.json's num_hidden_layers)."""
    try:
        found = json.loads(Path(post, "config.json").read_text(encoding="utf-8"))
        return int(found["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise GraftError(f"cannot read the number of layers of {post} (config.json: {error}); --per-layer needs "
                         "it") from None


def search_header(sources: list[str], inputs: list[GraftInputs], evaluation: Evaluation, space: Space,
                  request: SearchRequest, warm: list[dict]) -> dict:
    """What the study is for: the sweep header's fields (config, tasks, inputs, settings; of several configs,
    one digest of theirs) and the search's own (space, seed, sampler, warm start). Neither the budget nor τ: a
    search may be resumed with more trials."""
    headers = [sweep_header(source, [], [], found, evaluation) for source, found in zip(sources, inputs, strict=True)]
    header = headers[0]
    for field in ("config_sha256", "inputs_sha256"):
        if len(headers) > 1:
            header[field] = hashlib.sha256("\0".join(h[field] for h in headers).encode()).hexdigest()
    header[SEARCH_FIELD] = {
        "lambda_range": list(space.lam), "rho_range": None if space.rho is None else list(space.rho),
        "per_layer": space.per_layer, "rho_per_layer": space.rho_per_layer, "configs": space.configs,
        "seed": request.seed, "warm_start": warm,
        "sampler": "optuna TPESampler (multivariate, multi-objective)", "startup": _startup(request),
    }
    return header


def _startup(request: SearchRequest) -> int:
    """Trials sampled at random before TPE models the trade-off (warm-start trials count among them)."""
    return request.startup if request.startup is not None else max(2, request.trials // 3)


def warm_start_params(warm_start: str, space: Space) -> list[dict]:
    """The parameters of the first trials: the grid's corners, none, or a previous results.jsonl's points."""
    if warm_start == "corners":
        return space.corners()
    if warm_start == "none":
        return []
    path = Path(warm_start)
    try:
        first = path.read_bytes().split(b"\n", 1)[0]
        header = json.loads(first)
    except (OSError, ValueError) as error:
        raise GraftError(f"--warm-start {path}: not a results.jsonl of a sweep or search ({error}); give one, "
                         "'corners' or 'none'") from None
    if not isinstance(header, dict) or header.get("kind") != "header":
        raise GraftError(f"--warm-start {path}: the first line is not a sweep's header; give a results.jsonl")
    records = read_log(path, functools.partial(parse_sweep_log, expected=header)) or []
    found = []
    for record in records[1:]:
        if record["kind"] == "point" and record["splits"] == ["validation"] and "error" not in record:
            params = space.params(record.get("layers") or record["lambda"], record.get("rho_layers") or record["rho"],
                                  record.get("config", 0))
            if params not in found:
                found.append(params)
    return found


def check_folder(out: Path, header: dict, join: bool) -> None:
    """DIR is new, empty, or holds this very search (GraftError naming what differs); best/ is replaceable."""
    if os.path.islink(out) or (os.path.lexists(out) and not out.is_dir()):
        raise GraftError(f"output {out} exists and is not a folder (or is a link); choose another output folder")
    stored = stored_header(out) if out.is_dir() else None
    if stored is None:
        if join:
            raise GraftError(f"{out} holds no search to join; start `graftmerge search` there without --join first")
        others = [e.name for e in out.iterdir() if not e.name.startswith(".")] if out.is_dir() else []
        if others:
            raise GraftError(f"output {out} already exists, is not empty and holds no search to resume "
                             f"({others[0]!r}); choose a new folder")
        return
    for field in (*[f for f in header if f != SEARCH_FIELD], SEARCH_FIELD):
        if stored.get(field) != header[field]:
            raise GraftError(f"{out} holds a search of another {_FIELD_WORDS.get(field, field)}; give the same "
                             "config, tasks, settings, ranges, seed and warm start to resume it, or choose "
                             "another output folder")
    check_replaceable(out / BEST, MERGE, hint="move them out of it or choose another output folder")


_FIELD_WORDS = {"config_sha256": "config", "tasks_sha256": "task file or task data",
                "inputs_sha256": "set of input files (a model or Fisher file changed since)",
                "settings": "evaluation settings", SEARCH_FIELD: "search space, seed or warm start"}


class _TrialSweep(_EvalSweep):
    """The sweep machinery for one trial: the evaluation model is kept between trials (the runner holds it), so
    letting it go is only forgetting it here (no garbage collection per trial: it costs more than a small
    model's trial)."""

    def release_model(self) -> None:
        """Forget the evaluation model (the runner keeps it loaded for the next trial)."""
        self._weights = self._loaded = self._model = None


class _Runner:
    """Scores points of one config in memory (the sweep's machinery), the evaluation model loaded once."""

    def __init__(self, config, source: str, plan: GraftPlan, inputs: GraftInputs, loaded, judge: Judge,
                 read: list, out: Path, options):
        self.config, self.source, self.plan, self.inputs, self.loaded = config, source, plan, inputs, loaded
        self.read, self.out, self.options, self.judge = read, out, options, judge

    def sweep(self, points: list[GridPoint]) -> _EvalSweep:
        """The sweep machinery opened for ``points`` (their global thresholds found in one scoring pass)."""
        plans = {point: point_plan(self.plan, point) for point in points}
        return _TrialSweep(self.config, self.source, self.plan, plans, self.out, self.options, self.inputs,
                           self.loaded, self.judge, self.read)

    def score(self, point: GridPoint | None, splits: tuple[str, ...], sweep: _EvalSweep | None = None) -> dict:
        """The record of ``point`` (None: θpost) on ``splits``, with the trial's number and anchors; scored in
        ``sweep`` when given (it must hold the point), else in one opened for it."""
        own = sweep is None
        sweep = self.sweep([point or POST_POINT]) if own else sweep
        try:
            record = sweep.scored(splits, point)
        finally:
            if own:
                sweep.close()
        if isinstance(point, SearchPoint):
            record["trial"] = point.trial
            if point.layers:
                record["layers"] = list(point.layers)
            if point.rho_layers:
                record["rho_layers"] = list(point.rho_layers)

        return record


class _Runners:
    """One runner per searched config, sharing one evaluation model; each point goes to its config's runner."""

    def __init__(self, runners: list[_Runner]):
        self.runners, self.out = runners, runners[0].out

    def _of(self, point: GridPoint | None) -> _Runner:
        """The runner of ``point``'s config (θpost and its λ = 0 point: the first config's)."""
        return self.runners[getattr(point, "config", 0)]

    def sweep(self, points: list[GridPoint]) -> _EvalSweep:
        """The sweep machinery opened for ``points``, all of one config."""
        return self._of(points[0]).sweep(points)

    def score(self, point: GridPoint | None, splits: tuple[str, ...], sweep: _EvalSweep | None = None) -> dict:
        """The record of ``point`` (None: θpost), with its config's index when several are searched."""
        record = self._of(point).score(point, splits, sweep)
        if len(self.runners) > 1 and isinstance(point, SearchPoint):
            record["config"] = point.config
        return record


def point_plan(plan: GraftPlan, point: GridPoint) -> GraftPlan:
    """The plan at ``point``: its λ and ρ, λ scheduled (bound per tensor by mergekit) for per-layer anchors."""
    found = plan.at_point(point.lam, point.rho)
    if isinstance(point, SearchPoint) and point.layers:
        scheduled = ("lambda", *(("rho",) if point.rho_layers else ()))
        found = dataclasses.replace(found, scheduled=(*scheduled, *[s for s in found.scheduled if s not in scheduled]))
    else:
        found.check()
    return found


def _owner() -> str:
    """``host:pid`` of this worker."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _orphaned(owner: str | None) -> bool:
    """Whether a running trial's worker is gone: a dead process of this host (another host's: never known)."""
    host, _, pid = (owner or ":").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return owner is None
    if int(pid) == os.getpid():
        return True  # this process's own trial from before a restart in the same pid cannot be running now
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@contextlib.contextmanager
def _claim_lock(out: Path):
    """One worker at a time claims a trial (a POSIX lock on DIR/.search.claim.lock, shared folders included)."""
    with open(out / CLAIM_LOCK, "a+b") as handle:
        fcntl.lockf(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(handle, fcntl.LOCK_UN)


def _next_trial(study: Study, space: Space, request: SearchRequest) -> tuple[int, dict] | None:
    """(number, parameters) of the trial to evaluate now: an orphaned one again, else a new one; None when the
    budget is claimed."""
    trials = study.trials()
    for trial in trials:
        if trial.state == "running" and _orphaned(trial.owner):
            study.take_over(trial.number, _owner())
            return trial.number, trial.params
    if len(trials) >= request.trials:
        return None
    number = len(trials)
    search = study.header[SEARCH_FIELD]
    warm = search["warm_start"]
    if number < len(warm):
        params = warm[number]
    else:
        finished = [t for t in trials if t.state == "complete"]
        params = sample(space.dimensions(), finished, request.seed, number, search["startup"])
    claimed = study.claim(params, space.dimensions(), _owner())
    if claimed != number:
        raise GraftError(f"trial {claimed} was claimed where {number} was expected: another program writes "
                         f"{JOURNAL} without the claim lock")
    return number, params


def work(study: Study, runner: _Runners, space: Space, request: SearchRequest,
         progress: Callable[[dict], None] | None = None) -> int:
    """Claim, evaluate and tell trials until the budget is claimed; how many this worker evaluated."""
    done = 0
    while True:
        with _claim_lock(runner.out):
            claimed = _next_trial(study, space, request)
        if claimed is None:
            return done
        number, params = claimed
        record = runner.score(space.point(params, number), VALIDATION)
        roles = record["roles"]["validation"]
        values = None if "error" in record else (_number(roles.get("old")), _number(roles.get("new")))
        study.finish(number, record, values)
        done += 1
        if progress is not None:
            progress(record)


def run_search(config, source: str, plan: GraftPlan, space: Space, request: SearchRequest, out_dir: str, options,
               evaluation: Evaluation, make_judge: Callable[[], Judge], worker_command: list[str] | None = None,
               progress: Callable[[dict], None] | None = None, others: tuple = ()) -> SearchOutcome | None:
    """Run (or resume, or join) a search (module doc); None for a joining worker, which writes no outputs.

    Every check that can fail on bad input runs before DIR is touched or anything is scored.
    ``worker_command``: the command that starts one more worker (``--join``), for ``request.workers`` > 1.
    ``others``: more (config, source, plan) searched as one categorical choice with the first.
    """
    entries = [(config, source, plan), *others]
    check_request(request, space)
    space = _checked_space(entries, space)
    warm = warm_start_params(request.warm_start, space)
    tasks = [("task file" if i == 0 else "task data", file) for i, file in enumerate(evaluation.files)]
    if request.warm_start not in ("corners", "none"):
        tasks.append(("warm-start results", request.warm_start))
    read = [*(item for _, _, entry_plan in entries for item in plan_inputs(entry_plan)), *tasks]
    check_not_inputs(out_dir, read)
    loaded = [check_mergekit_inputs(entry[0], options.allow_crimes, options.trust_remote_code) for entry in entries]
    inputs = [GraftInputs.open(entry[2].at_point(space.lam[-1], (space.rho or (0.0, 0.0))[1])) for entry in entries]
    header = search_header([entry[1] for entry in entries], inputs, evaluation, space, request, warm)
    lock = contextlib.nullcontext(Path(out_dir).resolve()) if request.join else locked(out_dir)
    with lock as out:
        check_folder(out, header, request.join)
        judge = make_judge()
        judge = dataclasses.replace(judge, load_model=functools.cache(judge.load_model))  # each point overwrites it
        runner = _Runners([_Runner(*entry, entry_inputs, entry_loaded, judge, read, out, options)
                           for entry, entry_inputs, entry_loaded in zip(entries, inputs, loaded, strict=True)])
        if request.join:
            work(Study(out), runner, space, request, progress)
            return None
        study = _started(runner, out, header)
        workers = [_spawn(worker_command) for _ in range(request.workers - 1)] if request.workers > 1 else []
        try:
            _until_finished(study, runner, space, request, progress)
        finally:
            for worker in workers:
                worker.wait()
        _until_finished(study, runner, space, request, progress)  # trials of a worker that died
        return _finish(study, runner, space, request)


def _checked_space(entries: list[tuple], space: Space) -> Space:
    """The space for these configs (ρ anchors under rho_scope: tensor, the config choice); GraftError for a
    config the search cannot run, or configs of different post models or ρ scopes."""
    for config, _, plan in entries:
        check_config(config, plan, space)
        plan.at_point(space.lam[0], 0.0).check()
        if config.tokenizer is not None or config.tokenizer_source is not None:
            raise GraftError("search does not support `tokenizer:` / `tokenizer_source:` (neither does sweep)")
    first = entries[0][2]
    for _, _, plan in entries[1:]:
        if Path(plan.post).resolve() != Path(first.post).resolve():
            raise GraftError(f"the searched configs graft onto different models ({first.post}, {plan.post}); "
                             "θpost is the bar every trial is held to, so they must share base_model")
        if plan.rho_scope != first.rho_scope:
            raise GraftError(f"the searched configs have different rho_scope ({first.rho_scope}, {plan.rho_scope}); "
                             "give them the same")
    return dataclasses.replace(space, configs=len(entries),
                               rho_per_layer=bool(space.per_layer and space.rho and first.rho_scope == "tensor"))


def _started(runner: _Runners, out: Path, header: dict) -> Study:
    """The study in DIR, θpost scored and stored in it (once: a resumed search reads it back)."""
    existing = stored_header(out) if out.is_dir() else None
    post = Study(out).attribute("post") if existing is not None else None
    if post is None:
        post = runner.score(None, VALIDATION + TEST)
        check_post_scores(post, "search", "trial", "the search maximises")
    out.mkdir(exist_ok=True)
    recover(out / SCRATCH)  # the scratch folders of killed runs
    study = Study(out, header)
    if study.attribute("post") is None:
        study.set_attribute("post", post)
    return study


def _spawn(command: list[str] | None):
    """One more local worker (``graftmerge search … --join``)."""
    if not command:
        raise GraftError("--workers needs the command that starts a worker; run graftmerge search from the CLI")
    return subprocess.Popen(command)


def _until_finished(study: Study, runner: _Runners, space: Space, request: SearchRequest, progress) -> None:
    """Work until every claimed trial is finished (waiting on other live workers' trials)."""
    while True:
        work(study, runner, space, request, progress)
        running = [t for t in study.trials() if t.state == "running"]
        if not running:
            return
        time.sleep(1.0)


def _finish(study: Study, runner: _Runners, space: Space, request: SearchRequest) -> SearchOutcome:
    """The rule on validation, test scores of the chosen trial and the frontier, then DIR's outputs."""
    trials = [t for t in study.trials() if t.record is not None][: max(request.trials, 0) or None]
    post = study.attribute("post")
    points = [space.point(t.params, t.number) for t in trials]
    validation = {point: trial.record for point, trial in zip(points, trials, strict=True)}
    selection = select(points, validation, post, request.tolerance)
    wanted = list(dict.fromkeys(selection.frontier + ([selection.chosen] if selection.chosen else [])))
    best, out = selection.chosen or POST_POINT, runner.out
    # one scoring pass for every point of a (λ, ρ) search; a per-layer trial's schedule is its own, so alone
    together = not space.per_layer and len({getattr(p, "config", 0) for p in [*wanted, best]}) == 1
    sweep = runner.sweep([*wanted, best]) if together else None
    try:
        tests = {}
        for point in wanted:
            key = f"test-{point.trial}"
            tests[point] = study.attribute(key) or runner.score(point, TEST, sweep)
            study.set_attribute(key, tests[point])
        for name in (CHOSEN, PLOT):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(out / name)
        sweep = sweep or runner.sweep([best])
        written = sweep.write_models(best, [])
        ok = [p for p in points if "error" not in validation[p]]
        volume = hypervolume([_number(validation[p]["roles"]["validation"]["old"]) for p in ok],
                             [_number(validation[p]["roles"]["validation"]["new"]) for p in ok])
        _replace_file(out / RESULTS, _results_log(study.header, post, points, validation, tests), sweep.scratch)
        _write_plot(out, sweep.scratch, points, validation, post, selection, request.tolerance)
        summary = _summary(selection, post, validation, tests, request, written, len(points), volume,
                           space.configs)
        _replace_file(out / CHOSEN, (json.dumps(summary, indent=2, ensure_ascii=False) + "\n").encode(),
                      sweep.scratch)  # last: chosen.json present means every folder it names is in place
    finally:
        if sweep is not None:
            sweep.close()
    chosen_test = post if selection.chosen is None else tests[selection.chosen]
    return SearchOutcome(out, post, selection.chosen, chosen_test, selection.frontier, len(points), volume, written)


def _results_log(header: dict, post: dict, points: list[SearchPoint], validation: dict, tests: dict) -> bytes:
    """results.jsonl whole: the header (its grid: the values the trials took), θpost, each trial on validation
    in trial order, then the test records in trial order."""
    records = [validation[p] for p in points] + [tests[p] for p in sorted(tests, key=lambda p: p.trial)]
    grid = {"lambda": sorted({r["lambda"] for r in records}), "rho": sorted({r["rho"] for r in records})}
    lines = [{**header, "grid": grid}, post, *records]
    return b"".join(record_line(line) for line in lines)


def _summary(selection, post: dict, validation: dict, tests: dict, request: SearchRequest, written: list[Path],
             total: int, volume: float, configs: int = 1) -> dict:
    """chosen.json: the sweep's summary, each point with its trial number (and per-layer anchors), the search's
    budget and the validation frontier's hypervolume."""
    summary = chosen_summary(selection, post, validation, tests, request.tolerance, "best", written, total)
    described = lambda p: {"trial": p.trial, **({"layers": list(p.layers)} if p.layers else {}),  # noqa: E731
                           **({"rho_layers": list(p.rho_layers)} if p.rho_layers else {}),
                           **({"config": p.config} if configs > 1 else {})}
    if selection.chosen is not None:
        summary["chosen"].update(described(selection.chosen))
        summary["best"].update(described(selection.chosen))
    for entry, point in zip(summary["frontier"], selection.frontier, strict=True):
        entry.update(described(point))
    summary["trials"] = total
    summary["hypervolume"] = volume
    summary["hypervolume_reference"] = [0.0, 0.0]
    return summary
