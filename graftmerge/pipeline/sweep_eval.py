"""``graftmerge sweep … --eval TASKS -o DIR``: a (λ, ρ) grid that scores itself and keeps the model it chose.

θpost is scored once (validation, and test for reference). Every grid point is then grafted
*in memory*, straight into the one evaluation model (θpost loaded once): each output weight
is planned, loaded, grafted and cast exactly as :mod:`graftmerge.pipeline.sweep` writes it for
``mergekit-yaml`` equality (mergekit's planner and ``LoadTensor`` tasks, the merge kernel, the
``SaveTensor`` cast), then copied into the model's own weight, which casts it as loading the
written folder would. So a point scores what its folder would score, and no folder is written
to score it. Points are scored on the **validation** split only and appended to
``DIR/results.jsonl`` as each finishes. The rule (:mod:`graftmerge.math.frontier`) picks a
point from validation scores; only the chosen point and the Pareto frontier are then scored on
**test**. The chosen model is written to ``DIR/best/`` by the folder-writing sweep's own code
(so it is ``mergekit-yaml``'s output of its ``mergekit_config.yml``, bit for bit), and with
``--keep`` the frontier's or every point's folder too; then ``chosen.json`` and ``frontier.png``.

Reads: the global mask's scoring pass reads the inputs once for the whole grid (as ``sweep``);
grafting reads each point's inputs again (from the page cache when they fit), because holding
every point's graft at once would cost one model per point. Memory: the evaluation model, plus
one tensor's inputs and graft at a time, whatever the grid size; the model is let go before
the folders are written.

DIR is filled in place, not staged, because it must outlive a kill: it is locked (``.DIR.lock``
beside it) while a sweep runs; results.jsonl is append-only, each line fsynced, and read back
checked (:mod:`graftmerge.formats.sweep_log`); model folders are built in this run's scratch
folder inside DIR (``.scratch.partial-PID-*``) and each published whole with :class:`OutputFolder`;
chosen.json and frontier.png are deleted before best/ is replaced and renamed into place after
it, chosen.json last. A re-run with the same config, grid, tasks and evaluation settings
resumes: finished points are read back, a torn last line is dropped and its point scored
again. Nothing is created in DIR before every input and the task file have been checked and
θpost has been scored. docs/sweeps.md has the details.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from graftmerge.errors import GraftError
from graftmerge.formats.json_file import parse_json_bytes
from graftmerge.formats.output_folder import MERGE, OutputFolder, check_not_inputs, check_replaceable, locked, recover
from graftmerge.formats.results_log import ResultsLog, read_log
from graftmerge.formats.sweep_log import FORMAT, parse_sweep_log, record_key
from graftmerge.math.frontier import choose, pareto_frontier, qualifies
from graftmerge.pipeline.frontier_plot import PlotPoint, plot_frontier
from graftmerge.pipeline.graft_plan import GraftInputs, GraftPlan, plan_inputs
from graftmerge.pipeline.mergekit_inputs import check_mergekit_inputs
from graftmerge.pipeline.sweep import FreedMemory, Grid, GridPoint, check_sweepable, grid

RESULTS, CHOSEN, PLOT, BEST = "results.jsonl", "chosen.json", "frontier.png", "best"
SCRATCH = "scratch"  # a run's scratch folder is DIR/.scratch.partial-PID-XXXXXXXX (output_folder.recover's name)
KEEP = ("best", "frontier", "all")
DEFAULT_TOLERANCE = 0.01
RULE = ("highest new-role validation score among the points whose old-role validation score is at least "
        "θpost's − τ (normalised role scores); ties: smaller λ, then smaller ρ; θpost when no point qualifies")
POST_POINT = GridPoint(0.0, 0.0)  # what best/ holds when θpost is chosen: the λ = 0 graft, θpost as a sweep writes it


@dataclass(frozen=True)
class Evaluation:
    """What scores a model, as far as DIR's header must know it: the task files, their fingerprint, the settings."""

    files: tuple[str, ...]  # the task file first, then its data files: inputs, which DIR may not be
    fingerprint: str  # of the task file and its data
    settings: dict  # anything else that changes a score (evaluation dtype, device, batch size)


@dataclass
class Judge:
    """How to load θpost as the evaluation model (the sweep overwrites its weights point by point), and the scorer.

    The model is loaded when a score is first needed and let go while the grid's scoring pass
    runs and while folders are written, so it never adds to their memory.
    """

    load_model: Callable[[], torch.nn.Module]
    score: Callable[[torch.nn.Module, tuple[str, ...]], dict[str, dict[str, float]]]  # {task: {split: raw}}
    roles: Callable[[dict, str], dict[str, float]]  # (scores, split) → {"old": x, "new": y}, normalised


@dataclass
class SweepOutcome:
    """What a finished ``sweep --eval`` chose and wrote."""

    folder: Path
    post: dict  # θpost's record
    chosen: GridPoint | None  # None: θpost
    chosen_test: dict | None  # the chosen point's test record (θpost's record when it is chosen)
    frontier: list[GridPoint]
    qualified: int
    failed: int
    written: list[Path]


def check_tolerance(tolerance: float) -> float:
    """τ as a float; GraftError unless it is a number in [0, 1] (role scores are normalised to [0, 1])."""
    if isinstance(tolerance, bool) or not (isinstance(tolerance, int | float) and math.isfinite(tolerance)
                                           and 0 <= tolerance <= 1):
        raise GraftError(f"--tolerance must be a number in [0, 1] (normalised role scores), got {tolerance}")
    return float(tolerance)


def check_keep(keep: str) -> str:
    """``keep`` itself; GraftError unless it is one of :data:`KEEP`."""
    if keep not in KEEP:
        raise GraftError(f"--keep must be one of {', '.join(KEEP)}, got {keep!r}")
    return keep


def written_dtype(config, post_folder: str) -> str:
    """The dtype a sweep's folders declare (mergekit: out_dtype, else dtype, else the post model's config.json)."""
    if config.out_dtype or config.dtype:
        return config.out_dtype or config.dtype
    path = Path(post_folder, "config.json")
    try:
        found = parse_json_bytes(path.read_bytes(), str(path), "model config")
    except OSError as error:
        raise GraftError(f"cannot read {path} ({error.strerror})") from error
    dtype = found.get("dtype") or found.get("torch_dtype") if isinstance(found, dict) else None
    return dtype if isinstance(dtype, str) else "float32"


def _inputs_digest(inputs: GraftInputs) -> str:
    """sha256 of every input file's path, size and modification time: a resumed sweep must read the same files."""
    digest = hashlib.sha256()
    for path, identity in sorted(inputs.pinned().items()):
        digest.update(f"{path}\0{identity[2]}\0{identity[3]}\n".encode())
    return digest.hexdigest()


def sweep_header(source: str, lambdas: list[float], rhos: list[float], inputs: GraftInputs,
                 evaluation: Evaluation) -> dict:
    """The first line of results.jsonl: everything a point's validation score depends on (τ and --keep do not)."""
    return {"kind": "header", "format": FORMAT, "config_sha256": hashlib.sha256(source.encode()).hexdigest(),
            "grid": {"lambda": [float(v) for v in lambdas], "rho": [float(v) for v in rhos]},
            "tasks_sha256": evaluation.fingerprint, "inputs_sha256": _inputs_digest(inputs),
            "settings": evaluation.settings}


def _previous_records(out: Path, header: dict, keep: str, points: list[GridPoint]) -> list[dict]:
    """The records of a sweep to resume in DIR (read back checked: formats/sweep_log); [] when DIR is new.

    DIR belongs to the user: it is taken only when it is new, empty (hidden files aside), or holds
    this sweep's log; a log without its header (empty, or torn by a kill) only when nothing else is
    there. A model folder the sweep will replace must hold only files a merge writes.
    """
    if os.path.islink(out) or (os.path.lexists(out) and not out.is_dir()):
        raise GraftError(f"output {out} exists and is not a folder (or is a link); choose another output folder")
    if not out.exists():
        return []
    results = out / RESULTS
    records = read_log(results, functools.partial(parse_sweep_log, expected=header))
    others = [entry.name for entry in out.iterdir() if entry.name != RESULTS and not entry.name.startswith(".")]
    if records is None and others:
        raise GraftError(f"output {out} already exists, is not empty and holds no {RESULTS} of a sweep to "
                         "resume; choose a new folder")
    if records == [] and others:
        raise GraftError(f"{results} holds no sweep header (it is empty or cut short) and {out} holds other files "
                         f"({others[0]!r}); a sweep takes over only a folder of its own: choose a new folder")
    names = [BEST] + ([p.folder for p in points] if keep != "best" else [])
    for name in names:
        check_replaceable(out / name, MERGE, hint="move them out of it or choose another output folder")
    for name in (CHOSEN, PLOT):
        if (out / name).is_dir() and not (out / name).is_symlink():
            raise GraftError(f"{out / name} is a folder where the sweep writes its {name}; move it out of {out} "
                             "or choose another output folder")
    return records or []


def _number(value) -> float:
    """A score as read back (``null`` was NaN)."""
    return math.nan if value is None else float(value)


def check_post_scores(post: dict, command: str, each: str, uses_roles: str) -> None:
    """GraftError unless θpost's validation scores are numbers and give both roles: every ``each`` (point,
    trial) of ``command`` (sweep, search) is compared with them, and ``uses_roles`` says how roles are used."""
    problem = _first_nan({task: {"validation": v.get("validation")} for task, v in post["scores"].items()},
                         {"validation": post["roles"]["validation"]})
    if problem is not None:
        raise GraftError(f"θpost's evaluation gave NaN for {problem}: the rule compares every {each} with θpost, "
                         f"so the {command} cannot choose; check the task file")
    missing = [role for role in ("old", "new") if role not in post["roles"]["validation"]]
    if missing:
        raise GraftError(f"the tasks give no {missing[0]}-role score on validation; {uses_roles} old- and "
                         "new-role scores, so it needs a task of each role")


def _first_nan(scores: dict, roles: dict) -> str | None:
    """The first score that is not a number, in words; None when all are."""
    for task, splits in scores.items():
        for split, value in splits.items():
            if not math.isfinite(_number(value)):
                return f"task {task} ({split})"
    for split, values in roles.items():
        for role, value in values.items():
            if not math.isfinite(_number(value)):
                return f"the {role}-role score ({split})"
    return None


class ModelWeights:
    """mergekit's ``TensorWriter`` of one grid point, writing into the evaluation model instead of a folder.

    Each tensor, already cast as mergekit saves it, is copied into the model's weight of the same
    name, which casts it to the model's dtype as loading the folder would. Every weight of the model
    must be written once per point (tied weights count once), so nothing of an earlier point stays.
    """

    def __init__(self, model: torch.nn.Module):
        self._targets = model.state_dict(keep_vars=True)  # tied weights: one tensor under two names
        self._written: set[int] = set()

    def start(self) -> None:
        """Begin a grid point: no weight written yet."""
        self._written = set()

    def save_tensor(self, name: str, tensor: torch.Tensor, clone: bool = False) -> None:
        """Copy ``tensor`` into the model's weight ``name`` (cast to its dtype, moved to its device)."""
        target = self._targets.get(name)
        if target is None:
            raise GraftError(f"merged tensor {name} is no weight of the evaluation model (transformers renames or "
                             "drops it on loading), so sweep --eval cannot score this model in memory")
        if tuple(target.shape) != tuple(tensor.shape):
            raise GraftError(f"merged tensor {name} has shape {tuple(tensor.shape)}, the evaluation model's "
                             f"{tuple(target.shape)}; sweep --eval cannot score this model in memory")
        with torch.no_grad():
            if id(target) in self._written:  # a tied weight saved under both names: they must agree
                if not torch.equal(target, tensor.to(device=target.device, dtype=target.dtype)):
                    raise GraftError(f"merged tensor {name} differs from the weight it is tied to; sweep --eval "
                                     "cannot tell which one loading the folder would keep")
                return
            target.copy_(tensor)
        self._written.add(id(target))

    def check_complete(self) -> None:
        """GraftError naming a model weight no merged tensor wrote (loading the folder would leave it unset)."""
        missing = [name for name, target in self._targets.items() if id(target) not in self._written]
        if missing:
            raise GraftError(f"the merged model has no {missing[0]}, a weight of the evaluation model; sweep --eval "
                             "cannot score it in memory")


def _load(opened: Grid, point: GridPoint, weights: ModelWeights) -> None:
    """Graft ``point`` into the evaluation model, tensor by tensor, as the folder-writing sweep writes it."""
    weights.start()
    for name, tensor in tqdm(opened.tensors(point), total=len(opened.saves), leave=False, unit="tensor",
                             desc=f"graft λ {point.lam:g} ρ {point.rho:g}", disable=opened.options.quiet):
        weights.save_tensor(name, tensor)
    weights.check_complete()


VALIDATION, TEST = ("validation",), ("test",)


@dataclass
class _Selection:
    """The rule's verdict on the validation scores: chosen point (None: θpost), frontier, counts."""

    chosen: GridPoint | None
    frontier: list[GridPoint]
    qualified: int
    failed: list[tuple[GridPoint, str]]


def select(points: list[GridPoint], validation: dict[GridPoint, dict], post: dict, tolerance: float) -> _Selection:
    """Apply the rule and find the Pareto frontier, from validation role scores only (failed points left out)."""
    ok = [p for p in points if "error" not in validation[p]]
    old = [_number(validation[p]["roles"]["validation"]["old"]) for p in ok]
    new = [_number(validation[p]["roles"]["validation"]["new"]) for p in ok]
    post_old = _number(post["roles"]["validation"]["old"])
    index = choose(old, new, [p.lam for p in ok], [p.rho for p in ok], post_old, tolerance)
    qualified = sum(qualifies(score, post_old, tolerance) for score in old)
    failed = [(p, validation[p]["error"]) for p in points if "error" in validation[p]]
    return _Selection(None if index is None else ok[index], [ok[i] for i in pareto_frontier(old, new)],
                      qualified, failed)


class _EvalSweep:
    """One run on a locked DIR: scores records (grafting points into the evaluation model) and writes outputs."""

    def __init__(self, config, source: str, plan: GraftPlan, plans: dict[GridPoint, GraftPlan], out: Path, options,
                 inputs: GraftInputs, loaded, judge: Judge, read: list):
        self.config, self.source, self.plan, self.plans, self.out = config, source, plan, plans, out
        self.options, self.inputs, self.loaded, self.judge, self.read = options, inputs, loaded, judge, read
        self._stack = contextlib.ExitStack()
        self._grid: Grid | None = None
        self._scratch: Path | None = None
        self._weights: ModelWeights | None = None
        self._loaded: GridPoint | None = None  # the point whose graft the evaluation model holds
        self._model: torch.nn.Module | None = None

    def _opened(self) -> Grid:
        """The grid, opened (scoring pass included) the first time a point is grafted or written.

        θpost's own point (λ = 0, ρ = 0) is among its points: best/ holds it when θpost is chosen.
        """
        if self._grid is None:
            self.release_model()  # the scoring pass runs without it: their memory does not add up
            self._scratch = Path(tempfile.mkdtemp(prefix=f".{SCRATCH}.partial-{os.getpid()}-", dir=self.out))
            self._stack.callback(shutil.rmtree, self._scratch, True)
            plans = {**self.plans, POST_POINT: next(iter(self.plans.values())).at_point(0.0, 0.0)}
            self._grid = self._stack.enter_context(Grid.open(self.config, self.source, self.inputs, plans,
                                                             self.loaded, self.options, self._scratch))
        return self._grid

    def scored(self, splits: tuple[str, ...], point: GridPoint | None = None) -> dict:
        """The record of θpost (``point`` None) or of ``point`` grafted into the model, scored on ``splits``.

        ``seconds``: grafting the point into the model and scoring it.
        """
        fields = {"kind": "post"} if point is None else {"kind": "point", "lambda": point.lam, "rho": point.rho}
        grid = self._opened() if point is not None else None  # its scoring pass is the grid's, not this point's
        start = time.perf_counter()
        if grid is not None and point != self._loaded:  # the model may hold it still (scoring changes no weight)
            self._weights = self._weights or ModelWeights(self._evaluation_model())
            self._loaded = None
            _load(grid, point, self._weights)
            self._loaded = point
        scores = self.judge.score(self._evaluation_model(), splits)
        roles = {split: self.judge.roles(scores, split) for split in splits}
        record = {**fields, "splits": list(splits), "scores": scores, "roles": roles}
        problem = _first_nan(scores, roles)
        if problem is not None:
            record["error"] = f"evaluation gave NaN for {problem}"
        record["seconds"] = round(time.perf_counter() - start, 3)
        return record

    def records(self, log: ResultsLog, done: dict, points: list[GridPoint], splits: tuple[str, ...],
                what: str) -> dict[GridPoint, dict]:
        """Each point's record on ``splits``: read back when finished, else scored now and appended to the log."""
        found = {p: done.get(("point", p.lam, p.rho, splits, None, None)) for p in points}
        todo = [p for p in points if found[p] is None]
        with tqdm(total=len(points), initial=len(points) - len(todo), desc=what, unit="point",
                  disable=self.options.quiet or not points) as progress:
            for point in todo:
                found[point] = self.scored(splits, point)
                log.append(found[point])
                progress.update()
        return found

    def _evaluation_model(self) -> torch.nn.Module:
        """θpost loaded for evaluation (again, after the scoring pass), or whichever point it holds now."""
        if self._model is None:
            self._model = self.judge.load_model()
        return self._model

    def release_model(self) -> None:
        """Let the evaluation model go, its memory given back (the scoring pass and the writing run without it)."""
        self._weights = self._loaded = self._model = None
        gc.collect()
        FreedMemory().step()

    @property
    def scratch(self) -> Path:
        """This run's scratch folder inside DIR (made when the grid is opened; removed by :meth:`close`)."""
        self._opened()
        return self._scratch

    def close(self) -> None:
        """Close the grid (its scratch folder goes) and let the evaluation model go."""
        self._stack.close()
        self._grid = None
        self.release_model()

    def write_models(self, best: GridPoint, kept: list[GridPoint]) -> list[Path]:
        """best/ and the kept points' folders, written by the folder-writing sweep, each published whole.

        They are written together into the scratch folder (one read of the inputs for all of them,
        with the grid's own thresholds), then each is moved into its own :class:`OutputFolder`
        staging and published (an older folder of that name is replaced). When best/ is also a
        kept point, its files are hard links to that folder's (no second copy on disk).
        """
        grid = self._opened()
        self.release_model()
        build = self._scratch / "models"
        build.mkdir()
        grid.write(list(dict.fromkeys([best, *kept])), build, self._scratch / "spill")
        written = []
        for name, point in [(BEST, best), *((p.folder, p) for p in kept)]:
            with OutputFolder(self.out / name, replace=MERGE, inputs=self.read,
                              hint="move them out of it or choose another output folder") as output:
                if name == BEST and best in kept:
                    _link_files(build / point.folder, output.staging)
                else:
                    os.rename(build / point.folder, output.staging)  # onto the empty staging folder
            written.append(self.out / name)
        return written


def _link_files(source: Path, target: Path) -> None:
    """Hard-link every file of the flat folder ``source`` into ``target`` (copied where links fail)."""
    for file in sorted(source.iterdir()):
        try:
            os.link(file, target / file.name)
        except OSError:
            shutil.copy2(file, target / file.name)


def _replace_file(path: Path, data: bytes, scratch: Path) -> None:
    """Write ``path`` whole: a temporary file in the scratch folder (inside DIR), fsynced, then renamed over it."""
    temporary = scratch / path.name
    with open(temporary, "xb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def _merged(*records: dict | None) -> dict:
    """Scores and role scores of several records of one model (validation, test) as one."""
    scores: dict = {}
    roles: dict = {}
    for record in records:
        if record is None:
            continue
        for task, values in record["scores"].items():
            scores.setdefault(task, {}).update(values)
        roles.update(record["roles"])
    return {"scores": scores, "roles": roles}


def chosen_summary(selection: _Selection, post: dict, validation: dict, tests: dict, tolerance: float, keep: str,
                   written: list[Path], total: int) -> dict:
    """chosen.json: the rule, τ, the chosen point and θpost with their validation and test scores, the frontier."""
    chosen = selection.chosen
    best = POST_POINT if chosen is None else chosen
    holds = (f"the graft at λ {chosen.lam:g}, ρ {chosen.rho:g}" if chosen is not None else
             "θpost as the sweep writes it: the λ = 0, ρ = 0 graft (θpost's tensors cast to out_dtype), "
             "since no point's old-role score was within τ of θpost's")
    point = lambda p: {"lambda": p.lam, "rho": p.rho}  # noqa: E731
    return {
        "rule": RULE, "tolerance": tolerance, "keep": keep,
        "chosen": None if chosen is None else point(chosen),
        "best": {"folder": BEST, **point(best), "holds": holds, "config": f"{BEST}/mergekit_config.yml"},
        "points": total, "qualified": selection.qualified,
        "failed": [{**point(p), "error": error} for p, error in selection.failed],
        "post": _merged(post),
        "chosen_scores": _merged(post) if chosen is None else _merged(validation[chosen], tests.get(chosen)),
        "frontier": [{**point(p), **_merged(validation[p], tests.get(p))} for p in selection.frontier],
        "written": [path.name for path in written],
    }


def run_sweep_eval(config, source: str, plan: GraftPlan, lambdas: list[float], rhos: list[float], out_dir: str,
                   options, evaluation: Evaluation, make_judge: Callable[[], Judge], *,
                   tolerance: float = DEFAULT_TOLERANCE, keep: str = "best") -> SweepOutcome:
    """Score the grid, choose, write DIR (see the module doc). ``make_judge`` loads θpost and the evaluator.

    Every check that can fail on bad input runs before DIR is touched: τ, ``keep``, the config
    and its inputs, DIR (none of the inputs; a results.jsonl there must be this sweep's),
    ``make_judge`` (the caller's task checks) and θpost's validation scores.
    """
    tolerance, keep = check_tolerance(tolerance), check_keep(keep)
    points = grid(lambdas, rhos)
    plans = check_sweepable(config, points, plan)
    tasks = [("task file" if i == 0 else "task data", file) for i, file in enumerate(evaluation.files)]
    read = [*plan_inputs(plan), *tasks]
    check_not_inputs(out_dir, read)  # before anything else: DIR may be none of the inputs
    loaded = check_mergekit_inputs(config, options.allow_crimes, options.trust_remote_code)
    masked = [p for p in plans.values() if p.masked]
    inputs = GraftInputs.open(masked[0] if masked else plans[points[0]])
    header = sweep_header(source, lambdas, rhos, inputs, evaluation)
    with locked(out_dir) as out:
        records = _previous_records(out, header, keep, points)
        sweep = _EvalSweep(config, source, plan, plans, out, options, inputs, loaded, make_judge(), read)
        try:
            return _run(sweep, points, header, records, tolerance, keep)
        finally:
            sweep.close()


def _run(sweep: _EvalSweep, points: list[GridPoint], header: dict, records: list[dict], tolerance: float,
         keep: str) -> SweepOutcome:
    """θpost, the points on validation, the rule, the tests, the folders, chosen.json and the plot."""
    done = {record_key(record): record for record in records[1:]}
    post = done.get(("post", None, None, VALIDATION + TEST, None, None)) or sweep.scored(VALIDATION + TEST)
    check_post_scores(post, "sweep", "point", "the rule compares")
    sweep.out.mkdir(exist_ok=True)
    recover(sweep.out / SCRATCH)  # the scratch folders of killed runs of this sweep, and only those
    with ResultsLog(sweep.out / RESULTS, functools.partial(parse_sweep_log, expected=header)) as log:
        if not log.records:
            log.append(header)
        if record_key(post) not in done:
            log.append(post)
        validation = sweep.records(log, done, points, VALIDATION, "sweep --eval: validation")
        selection = select(points, validation, post, tolerance)
        wanted = list(dict.fromkeys(selection.frontier + ([selection.chosen] if selection.chosen else [])))
        wanted.sort(key=lambda p: p != points[-1])  # the model holds the last point still: scored without a graft
        tests = sweep.records(log, done, wanted, TEST, "sweep --eval: test (frontier and chosen)")
    kept = {"best": [], "frontier": selection.frontier, "all": points}[keep]
    for name in (CHOSEN, PLOT):  # they describe best/: gone before it is replaced, written again after it
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sweep.out / name)
    written = sweep.write_models(selection.chosen or POST_POINT, kept)
    summary = chosen_summary(selection, post, validation, tests, tolerance, keep, written, len(points))
    _write_plot(sweep.out, sweep.scratch, points, validation, post, selection, tolerance)
    _replace_file(sweep.out / CHOSEN, (json.dumps(summary, indent=2, ensure_ascii=False) + "\n").encode(),
                  sweep.scratch)  # last: chosen.json present means every folder it names is in place
    chosen_test = post if selection.chosen is None else tests[selection.chosen]
    return SweepOutcome(sweep.out, post, selection.chosen, chosen_test, selection.frontier, selection.qualified,
                        len(selection.failed), written)


def _write_plot(out: Path, scratch: Path, points: list[GridPoint], validation: dict, post: dict,
                selection: _Selection, tolerance: float) -> None:
    """frontier.png from the validation role scores (failed points counted, not drawn), replaced whole."""
    ok = [p for p in points if "error" not in validation[p]]
    drawn = [PlotPoint(p.lam, p.rho, _number(validation[p]["roles"]["validation"]["old"]),
                       _number(validation[p]["roles"]["validation"]["new"])) for p in ok]
    roles = post["roles"]["validation"]
    temporary = scratch / PLOT
    plot_frontier(temporary, drawn, (_number(roles["old"]), _number(roles["new"])),
                  [ok.index(p) for p in selection.frontier],
                  None if selection.chosen is None else ok.index(selection.chosen), tolerance,
                  failed=len(selection.failed))
    os.replace(temporary, out / PLOT)
