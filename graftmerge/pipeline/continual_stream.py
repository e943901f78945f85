"""A stream file (``graftmerge continual STREAM.yml``): θ0, what it must keep, and the ordered updates.

Read with the one bounded YAML reader of every config here (:func:`load_yaml_file`: depth, size, duplicate keys), then
checked field by field: a wrong type, an unknown field, a missing step, an empty stream, a
step without tasks, a setting out of range is one GraftError naming the stream file and
the field. Paths are relative to the stream file's folder. docs/continual.md describes it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

from graftmerge.errors import GraftError
from graftmerge.pipeline.config_files import load_yaml_file
from graftmerge.pipeline.sweep_eval import DEFAULT_TOLERANCE, check_tolerance

FISHER_KINDS = ("diagonal", "kfac", "both")
DTYPES = ("float32", "bfloat16", "float16")
TOP_FIELDS = {"post", "tasks", "fisher", "grid", "tolerance", "steps", "parameters", "dtype", "out_dtype"}
FISHER_FIELDS = {"prompts", "kind", "samples_per_prompt", "max_new_tokens", "temperature", "top_p", "seed",
                 "batch_size", "sample_batch_size", "modules", "accumulate"}
UPDATE_FIELDS = {"model", "donor", "role", "weight"}
RESERVED_PARAMETERS = ("lambda", "rho", "fisher")  # the stream sets these at each step


@dataclass(frozen=True)
class FisherSettings:
    """How each step's retention Fisher is estimated (``graftmerge fisher estimate``'s options) and accumulated."""

    prompts: Path  # θ0's retention prompts (a prompts JSONL as ``fisher estimate --prompts`` reads it)
    kind: str = "diagonal"
    samples_per_prompt: int = 1
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 8
    sample_batch_size: int = 16
    modules: tuple[str, ...] = ()
    accumulate: float | None = None  # γ: F̄t = γ·F̄(t−1) + Ft; None: each step's own Fisher alone


@dataclass(frozen=True)
class Update:
    """One step's update as a graft config takes it: a fine-tune with its donor, or a delta / PEFT adapter."""

    model: Path
    donor: Path | None = None
    role: str = "donor_ft"  # donor_ft (with donor) or delta
    weight: float = 1.0


@dataclass(frozen=True)
class Step:
    """An update and the tasks that define what it teaches."""

    update: Update
    tasks: Path


@dataclass(frozen=True)
class Stream:
    """A checked stream file."""

    source: Path
    sha256: str  # of the stream file's bytes: a resumed run must read the same stream
    post: Path
    tasks: Path
    fisher: FisherSettings
    lambdas: tuple[float, ...]
    rhos: tuple[float, ...]
    steps: tuple[Step, ...]
    tolerance: float = DEFAULT_TOLERANCE
    parameters: dict = field(default_factory=dict)  # further graft parameters (mask, rho_scope, …)
    dtype: str = "float32"
    out_dtype: str | None = None

    def inputs(self) -> list[tuple[str, Path]]:
        """(label, path) of every file or folder the stream names: OUT may be none of them, nor inside one."""
        named = [("stream file", self.source), ("post model (post)", self.post), ("tasks file (tasks)", self.tasks),
                 ("Fisher prompts (fisher.prompts)", self.fisher.prompts)]
        for number, step in enumerate(self.steps, 1):
            named.append((f"step {number} update model", step.update.model))
            if step.update.donor is not None:
                named.append((f"step {number} update donor", step.update.donor))
            named.append((f"step {number} tasks file", step.tasks))
        return named


class _Fields:
    """Reads one mapping of the stream file, each failure one GraftError naming the file and the field."""

    def __init__(self, path: Path, mapping, where: str, allowed: set[str]):
        self.path, self.where = path, where
        if not isinstance(mapping, dict):
            self.fail(where or "the file", "must be a mapping")
        unknown = sorted(set(map(str, mapping)) - allowed)
        if unknown:
            self.fail(f"{where}{unknown[0]}" if where else unknown[0], "is not a field of a stream file "
                      f"here (allowed: {', '.join(sorted(allowed))})")
        self.mapping = mapping

    def fail(self, name: str, problem: str):
        """Raise the one-line error."""
        raise GraftError(f"{self.path}: {name} {problem} (docs/continual.md describes the stream file)")

    def path_field(self, name: str, required: bool = True) -> Path | None:
        """A path relative to the stream file's folder."""
        value = self.mapping.get(name)
        if value is None and not required:
            return None
        if not isinstance(value, str) or not value:
            self.fail(self.where + name, "must be a path (text)")
        return (self.path.parent / value).absolute()

    def number(self, name: str, default, kind=float, low=None, high=None):
        """A number (an int when ``kind`` is int) in [low, high], or ``default`` when absent."""
        value = self.mapping.get(name, default)
        if value is None:
            return None
        ok = not isinstance(value, bool) and isinstance(value, int if kind is int else int | float)
        if not ok or not math.isfinite(value) or (low is not None and value < low) or \
                (high is not None and value > high):
            bounds = f" in [{low}, {high if high is not None else '∞'})" if low is not None else ""
            self.fail(self.where + name, f"must be {'an integer' if kind is int else 'a number'}{bounds}, "
                      f"got {value!r}")
        return kind(value)


def read_stream(path: str | Path) -> Stream:
    """The checked stream file at ``path`` (module doc); GraftError for anything it cannot use."""
    path = Path(path).absolute()
    if not path.is_file():
        raise GraftError(f"stream file {path} does not exist" if not path.exists() else f"{path} is not a file")
    data = load_yaml_file(str(path), "stream file")[0]
    top = _Fields(path, data, "", TOP_FIELDS)
    for name in ("post", "tasks", "fisher", "grid", "steps"):
        if top.mapping.get(name) is None:
            top.fail(name, "is missing")
    try:
        tolerance = check_tolerance(top.mapping.get("tolerance", DEFAULT_TOLERANCE))
    except GraftError:
        top.fail("tolerance", f"must be a number in [0, 1] (normalised role scores), got "
                 f"{top.mapping.get('tolerance')!r}")
    lambdas, rhos = _grid(path, top.mapping["grid"])
    return Stream(source=path, sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                  post=top.path_field("post"), tasks=top.path_field("tasks"),
                  fisher=_fisher(path, top.mapping["fisher"]), lambdas=lambdas, rhos=rhos,
                  steps=_steps(path, top.mapping["steps"]), tolerance=tolerance,
                  parameters=_parameters(top), dtype=_dtype(top, "dtype") or "float32",
                  out_dtype=_dtype(top, "out_dtype"))


def _dtype(top: _Fields, name: str) -> str | None:
    """``dtype`` / ``out_dtype``: one of :data:`DTYPES`, or None when absent."""
    value = top.mapping.get(name)
    if value is not None and value not in DTYPES:
        top.fail(name, f"must be one of {', '.join(DTYPES)}, got {value!r}")
    return value


def _parameters(top: _Fields) -> dict:
    """Further graft parameters for every step's config (mergekit checks them with the config)."""
    parameters = top.mapping.get("parameters") or {}
    if not isinstance(parameters, dict):
        top.fail("parameters", "must be a mapping of graft parameters (mask, rho_scope, …)")
    reserved = [name for name in RESERVED_PARAMETERS if name in parameters]
    if reserved:
        top.fail(f"parameters.{reserved[0]}", "is set by the stream at each step (grid: and the step's Fisher); "
                 "remove it")
    return dict(parameters)


def _grid(path: Path, grid) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(λ values, ρ values) of ``grid: {lambda: [...], rho: [...]}``: finite numbers, ρ in [0, 1)."""
    fields = _Fields(path, grid, "grid.", {"lambda", "rho"})
    values = {}
    for name in ("lambda", "rho"):
        items = fields.mapping.get(name)
        numbers = isinstance(items, list) and items and all(
            not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v) for v in items)
        if not numbers or (name == "rho" and not all(0 <= v < 1 for v in items)):
            fields.fail(f"grid.{name}", "must be a non-empty list of numbers" + (" in [0, 1)" if name == "rho" else "")
                        + f", got {items!r}")
        values[name] = tuple(float(v) for v in items)
    return values["lambda"], values["rho"]


def _fisher(path: Path, fisher) -> FisherSettings:
    """The ``fisher:`` mapping: prompts (required) and the estimator's options, checked as it checks them."""
    fields = _Fields(path, fisher, "fisher.", FISHER_FIELDS)
    kind = fields.mapping.get("kind", "diagonal")
    if kind not in FISHER_KINDS:
        fields.fail("fisher.kind", f"must be one of {', '.join(FISHER_KINDS)}, got {kind!r}")
    modules = fields.mapping.get("modules", [])
    if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
        fields.fail("fisher.modules", "must be a list of parameter-name globs")
    settings = FisherSettings(
        prompts=fields.path_field("prompts"), kind=kind,
        samples_per_prompt=fields.number("samples_per_prompt", 1, int, 1),
        max_new_tokens=fields.number("max_new_tokens", 256, int, 1),
        temperature=fields.number("temperature", 1.0), top_p=fields.number("top_p", 1.0),
        seed=fields.number("seed", 0, int, 0), batch_size=fields.number("batch_size", 8, int, 1),
        sample_batch_size=fields.number("sample_batch_size", 16, int, 1), modules=tuple(modules),
        accumulate=fields.number("accumulate", None, float, 0, 1))
    if settings.temperature <= 0 or not 0 < settings.top_p <= 1:
        fields.fail("fisher.temperature / fisher.top_p", "must be > 0 and in (0, 1]: the Fisher needs samples")
    if settings.accumulate is not None and kind != "diagonal":
        fields.fail("fisher.accumulate", f"needs fisher.kind diagonal (got {kind}): only diagonals add up, a sum of "
                    "Kronecker products is not one")
    return settings


def _steps(path: Path, steps) -> tuple[Step, ...]:
    """The ``steps:`` list: each an update and its tasks file."""
    if not isinstance(steps, list):
        raise GraftError(f"{path}: steps must be a list of steps (update: and tasks:)")
    if not steps:
        raise GraftError(f"{path}: the stream is empty (steps: has no step); give at least one update")
    read = []
    for number, step in enumerate(steps, 1):
        fields = _Fields(path, step, f"steps[{number}].", {"update", "tasks"})
        if fields.mapping.get("tasks") is None:
            fields.fail(f"steps[{number}].tasks", "is missing: every step needs the tasks that define what it teaches")
        read.append(Step(_update(path, fields.mapping.get("update"), number), fields.path_field("tasks")))
    return tuple(read)


def _update(path: Path, update, number: int) -> Update:
    """``update: {model: FT, donor: BASE}`` (a fine-tune and its donor) or ``{model: D, role: delta}``."""
    where = f"steps[{number}].update."
    if update is None:
        raise GraftError(f"{path}: steps[{number}].update is missing (docs/continual.md describes the stream file)")
    fields = _Fields(path, update, where, UPDATE_FIELDS)
    donor = fields.path_field("donor", required=False)
    role = fields.mapping.get("role", "donor_ft" if donor is not None else "delta")
    if role not in ("donor_ft", "delta"):
        fields.fail(where + "role", f"must be donor_ft (with donor:) or delta, got {role!r}")
    if (role == "donor_ft") != (donor is not None):
        fields.fail(where + "donor", "is needed with role donor_ft and not allowed with role delta")
    return Update(fields.path_field("model"), donor, role, fields.number("weight", 1.0))
