"""Merging one tensor by ``fisher`` or ``regmean``, and running a whole such config through mergekit safely.

:func:`merge_tensor` is what the mergekit kernel calls for every weight, with the
:class:`DataAwareRun` of its merge. :func:`run_data_aware_merge` wraps mergekit's
``run_merge``: the config validated, every input opened and every cache checked against
its own model (and, for regmean, every linear weight's Gram found) before mergekit loads
a tensor; OUT built beside itself and replaced whole only when the merge succeeds.
Streaming: per tensor, one tensor per input, plus (fisher) the running sums or
(regmean) one Gram matrix and its Cholesky factor.
"""

from __future__ import annotations

import functools
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from mergekit.common import dtype_from_name

from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import Checkpoint, InMemoryCheckpoint, check_same_tensors, check_unchanged
from graftmerge.formats.fisher_cache import FisherCache, side_rank
from graftmerge.formats.output_folder import MERGE, OutputFolder, stage_reached
from graftmerge.math.finite import fits
from graftmerge.math.fisher_average import FisherAverage, weighted_average
from graftmerge.math.regmean import RegMeanSums, cholesky, clearly_positive_definite, gram_diagonal
from graftmerge.math.workspace import Workspace
from graftmerge.pipeline import card_writer  # as a module: it imports mergekit's registry, whose hook imports us
from graftmerge.pipeline.data_aware_plan import (
    DataAwareInput,
    DataAwarePlan,
    build_plan,
    open_caches,
    plan_from_merge_config,
    plan_inputs,
    regmean_layers,
)
from graftmerge.pipeline.mergekit_inputs import read_input_architecture


@dataclass(eq=False)
class DataAwareRun:
    """One fisher or regmean merge: its plan, its checked caches, and what each tensor gets.

    ``weighted``: tensor → ``"fisher"`` (every cache has its diagonal) or the factor side
    holding its input Gram (``"columns"`` or ``"rows"``, regmean); any other tensor is averaged.
    """

    plan: DataAwarePlan
    caches: list[FisherCache]
    weighted: dict[str, str]
    index: dict[Hashable, int]  # mergekit's input id → position in the plan
    models: list = field(default_factory=list)  # the opened inputs (files pinned when opened)
    out_dtype: torch.dtype | None = None
    counts: Counter = field(default_factory=Counter)  # tensors merged, by how
    solve_seconds: float = 0.0  # regmean: time in the Gram solves
    solve_flops: float = 0.0  # regmean: their floating-point operations
    _factor: tuple | None = None  # regmean: (factor keys, Cholesky of Σ G̃) of the last weight, for q/k/v sharing it
    workspace: Workspace = field(default_factory=Workspace)  # fisher: one span's cache reads and sums, reused
    span: int = 1 << 18  # fisher: elements per span (1 MiB of float32: a span's buffers stay in the CPU's cache)
    before_tensor: Callable[[], None] | None = None  # called by mergekit's task before each tensor is merged

    def check_unchanged(self) -> None:
        """GraftError when a model or cache file changed since it was opened."""
        pinned = {}
        for source in (*self.models, *self.caches):
            pinned.update(source.pinned())
        check_unchanged(pinned)

    def summary(self) -> str:
        """One line: how many tensors each rule merged (and the solves' cost, for regmean)."""
        if self.plan.method == "fisher":
            return (f"fisher: {self.counts['fisher']} tensors Fisher-weighted, {self.counts['average']} averaged "
                    "(no diagonal entry in the caches)")
        return (f"regmean: {self.counts['regmean']} linear weights solved (α = {self.plan.alpha:g}; "
                f"{self.solve_seconds:.2f} s, {self.solve_flops / 1e9:.2f} GFLOP), {self.counts['average']} "
                "other tensors averaged")


def fisher_coverage(caches: Sequence[FisherCache], labels: Sequence[str], names) -> dict[str, str]:
    """Tensors every cache has a diagonal entry for; GraftError when only some caches have one."""
    weighted = {}
    for name in names:
        has = [cache.has(name, "diagonal") for cache in caches]
        if all(has):
            weighted[name] = "fisher"
        elif any(has):
            missing = labels[has.index(False)]
            raise GraftError(f"Fisher cache {caches[has.index(False)].path} of model {missing} has no diagonal "
                             f"entry for {name!r}, which another model's cache has: estimate every cache with the "
                             "same --kind and modules (a KFAC-only weight has no diagonal: use --kind both)")
    return weighted


def regmean_coverage(plan: DataAwarePlan, caches: Sequence[FisherCache], layers: Mapping[str, str],
                     shapes: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """Linear weights every cache has a full input-side KFAC factor for; the others averaged only when
    ``regmean_fallback: average`` says so (GraftError otherwise, naming the cache and the weight)."""
    weighted = {}
    for name, side in sorted(layers.items()):
        size = shapes[name][1 if side == "columns" else 0]
        problems = [_gram_problem(cache, name, side, size) for cache in caches]
        problem = next(((item, p) for item, p in zip(plan.inputs, problems) if p), None)
        if problem is None:
            weighted[name] = side
        elif plan.fallback != "average":
            item, why = problem
            raise GraftError(f"Fisher cache {item.fisher} of model {item.label} {why} for linear weight {name!r}: "
                             "regmean needs every input's input Gram (estimate with --kind kfac or both), or set "
                             "regmean_fallback: average to average such weights")
    return weighted


def _gram_problem(cache: FisherCache, name: str, side: str, size: int) -> str | None:
    """Why ``cache`` cannot give the input Gram of ``name`` (None when it can)."""
    if not cache.has(name, "kfac"):
        return "has no KFAC entry"
    record = cache.kfac_side(name, side)
    if record["size"] != size:
        return f"has a {side} factor of size {record['size']} (the input side is {size})"
    if side_rank(record) < record["size"]:
        return f"has a truncated input factor (rank {side_rank(record)} of {record['size']}, fisher compress)"
    return None


def merge_tensor(run: DataAwareRun, name: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One tensor of ``run``: inputs in plan order, in mergekit's working dtype; the result in that dtype.

    Checked finite, also once cast to the run's ``out_dtype``: GraftError naming the tensor.
    """
    rule = run.weighted.get(name)
    work = torch.promote_types(tensors[0].dtype, torch.float32)
    with torch.no_grad():
        if rule == "fisher":
            merged = _fisher(run, name, tensors, work)
        elif rule is not None:
            merged = _regmean(run, name, tensors, rule)
        else:
            merged = weighted_average(list(tensors), run.plan.weights, work)
    run.counts["fisher" if rule == "fisher" else "regmean" if rule else "average"] += 1
    result = merged.to(tensors[0].dtype)
    if not fits(result, run.out_dtype):
        raise GraftError(f"tensor {name!r}: the {run.plan.method} merge is not finite"
                         f"{' in ' + str(run.out_dtype).removeprefix('torch.') if run.out_dtype else ''} "
                         "(check the inputs' values and their caches)")
    return result


def _fisher(run: DataAwareRun, name: str, tensors: Sequence[torch.Tensor], work: torch.dtype) -> torch.Tensor:
    """A new tensor; on the CPU computed span by span, so that every pass runs in the CPU's cache."""
    if not all(tensor.device.type == "cpu" for tensor in tensors):  # the workspace's buffers are host memory
        average = FisherAverage(run.plan.epsilon, work)
        for tensor, cache, weight in zip(tensors, run.caches, run.plan.weights):
            average.add(tensor, cache.diagonal(name).to(tensor.device), weight)
        return average.result()
    flat = [tensor.reshape(-1) for tensor in tensors]  # views of contiguous inputs
    merged = torch.empty(flat[0].numel(), dtype=tensors[0].dtype)
    with ExitStack() as stack:
        spans = [stack.enter_context(cache.diagonal_spans(name)) for cache in run.caches]
        for start in range(0, merged.numel(), run.span):
            stop = min(start + run.span, merged.numel())
            average = FisherAverage(run.plan.epsilon, work, run.workspace)
            for values, fisher, weight in zip(flat, spans, run.plan.weights):
                buffer = run.workspace.take("fisher", (stop - start,), torch.float32)
                average.add(values[start:stop], fisher.read(start, buffer), weight)
            merged[start:stop] = average.result()
    return merged.view(tensors[0].shape)


def _regmean(run: DataAwareRun, name: str, tensors: Sequence[torch.Tensor], side: str) -> torch.Tensor:
    """Wᵀ = (Σ w G̃)⁻¹ Σ w G̃ Wᵀ, input-first; Σ G̃'s Cholesky kept for the next weight with the same factors."""
    began = time.perf_counter()
    keys = tuple(cache.entries[name]["kfac"][side] for cache in run.caches)
    sums = RegMeanSums(run.plan.alpha)
    if run._factor is not None and run._factor[0] == keys:
        sums.factor = run._factor[1]
    rebuilt = sums.factor is None
    for tensor, cache, key, weight in zip(tensors, run.caches, keys, run.plan.weights):
        spectrum = cache.side_spectrum(key, name)
        if rebuilt:
            sums.add_gram(spectrum, weight)
        sums.add_product(tensor.T if side == "columns" else tensor, spectrum, weight)
        del spectrum
    solved = sums.solve(f"regmean: linear weight {name!r}")
    run._factor = (keys, sums.factor)
    run.solve_seconds += time.perf_counter() - began
    size, outputs = solved.shape
    run.solve_flops += len(tensors) * 4 * size * size * outputs + 2 * size * size * outputs
    if rebuilt:
        run.solve_flops += len(tensors) * 2 * size**3 + size**3 / 3
    return solved.T if side == "columns" else solved


def check_gram_sums(plan: DataAwarePlan, caches: Sequence[FisherCache], weighted: Mapping[str, str]) -> None:
    """Every Σ G̃ the merge will solve with is positive definite: a singular one is refused before the first
    tensor, not when its weight comes. Once per distinct set of factors (q/k/v and gate/up share theirs):
    for α < 1 usually settled from the Grams' diagonals alone (``clearly_positive_definite``); otherwise
    by summing the Grams and factoring them, one set at a time (the merge's Gram work once more)."""
    seen = set()
    for name, side in sorted(weighted.items()):
        keys = tuple(cache.entries[name]["kfac"][side] for cache in caches)
        if keys in seen:
            continue
        seen.add(keys)
        spectra = [cache.side_spectrum(key, name) for cache, key in zip(caches, keys)]
        if clearly_positive_definite([gram_diagonal(spectrum) for spectrum in spectra], plan.weights, plan.alpha):
            continue
        sums = RegMeanSums(plan.alpha)
        for spectrum, weight in zip(spectra, plan.weights):
            sums.add_gram(spectrum, weight)
        del spectra
        cholesky(sums.total, f"regmean: linear weight {name!r}")


def open_run(plan: DataAwarePlan, models: list, out_dtype: torch.dtype | None = None,
             index: dict[Hashable, int] | None = None) -> DataAwareRun:
    """Open ``plan``'s caches against its opened ``models`` and decide each tensor's rule: every check a merge
    makes before its first tensor."""
    caches = open_caches(plan, models)
    labels = [item.label for item in plan.inputs]
    names = sorted(models[0].tensors)
    if plan.method == "fisher":
        weighted = fisher_coverage(caches, labels, names)
    else:
        shapes = {name: models[0].tensors[name].shape for name in names}
        layers = regmean_layers(plan, {name: None for name in names if len(shapes[name]) == 2})
        weighted = regmean_coverage(plan, caches, layers, shapes)
        check_gram_sums(plan, caches, weighted)
    index = index if index is not None else {item.label: position for position, item in enumerate(plan.inputs)}
    return DataAwareRun(plan, caches, weighted, index, models=models, out_dtype=out_dtype)


def open_file_run(plan: DataAwarePlan, out_dtype: torch.dtype | None, allow_crimes: bool = False,
                  trust_remote_code: bool = False) -> DataAwareRun:
    """The run of a config: every model folder opened (headers), of one architecture, with the same tensors."""
    loaded = [read_input_architecture(item.label, item.folder, "an input", trust_remote_code) for item in plan.inputs]
    for other in loaded[1:]:
        if None not in (loaded[0].arch_info, other.arch_info) and other.arch_info != loaded[0].arch_info \
                and not allow_crimes:
            raise GraftError(f"model {other.label} is a {other.architecture}, but model {loaded[0].label} is a "
                             f"{loaded[0].architecture}; {plan.method} averages one architecture")
    models = [Checkpoint(item.folder, label=f"model {item.label}") for item in plan.inputs]
    check_same_tensors(models[0], models[1:])
    return open_run(plan, models, out_dtype)


def in_memory_run(method: str, ids: list[Hashable], tensors: Mapping[str, list[torch.Tensor]],
                  dtypes: Mapping[str, torch.dtype], parameters: Mapping) -> DataAwareRun:
    """The run of ``merge_state_dicts`` inputs: ``tensors`` name → one tensor per input (in ``ids`` order);
    ``parameters`` as mergekit bound them (``fisher`` and ``weight`` per input id). With no cache for any
    input, every tensor is the plain weighted average (with a warning): mergekit's contract is that a
    registered method merges state dicts given only its defaults; a cache for some inputs only is refused."""
    fisher, weight = parameters.get("fisher") or {}, parameters.get("weight") or {}
    missing = [key for key in ids if not fisher.get(key)]
    shared = {k: v for k, v in parameters.items() if k not in ("fisher", "weight") and v is not None}
    if len(missing) == len(ids):  # no data at all: every tensor is one "without a Fisher entry"
        warnings.warn(f"{method}: no input has a Fisher cache, so every tensor is the plain weighted average "
                      "(pass parameters={'fisher': {id: <cache folder>, ...}} for a data-aware merge)", stacklevel=2)
        inputs = [DataAwareInput(repr(key), None, "", float(weight.get(key, 1.0))) for key in ids]
        plan = build_plan(method, inputs, shared)
        return DataAwareRun(plan, [], {}, {key: position for position, key in enumerate(ids)})
    if missing:
        raise GraftError(f"{method}: input(s) {', '.join(map(repr, missing))} have no Fisher cache: pass "
                         "parameters={'fisher': {id: <cache folder>, ...}} with one cache per input")
    inputs = [DataAwareInput(repr(key), None, str(fisher[key]), float(weight.get(key, 1.0))) for key in ids]
    plan = build_plan(method, inputs, shared)
    models = [InMemoryCheckpoint({name: group[position] for name, group in tensors.items()}, dict(dtypes),
                                 f"input {key!r}") for position, key in enumerate(ids)]
    return open_run(plan, models, index={key: position for position, key in enumerate(ids)})


RunMergekit = Callable[..., object]  # (run, config, out_path, options=, config_source=) -> mergekit's result


def run_data_aware_merge(run_mergekit: RunMergekit, merge_config, out_path: str, options, config_source=None,
                         run_parameter: str = ""):
    """mergekit's ``run_merge`` for a fisher or regmean config: validate, open, check, then OUT replaced whole."""
    plan = plan_from_merge_config(merge_config, run_parameter)
    with OutputFolder(out_path, replace=MERGE, inputs=plan_inputs(plan)) as output:
        run = open_file_run(plan, dtype_from_name(merge_config.out_dtype), options.allow_crimes,
                            options.trust_remote_code)
        run.before_tensor = functools.partial(stage_reached, "merging")  # a test can stop the merge there
        if config_source is None:
            config_source = merge_config.to_yaml()
        result = run_mergekit(run, merge_config, str(output.staging), options=options, config_source=config_source)
        run.workspace.release()
        run.check_unchanged()
        if options.write_model_card:
            card_writer.write_merge_card(output.staging, merge_config, config_source, card_data(run))
        if not options.quiet:
            print(run.summary(), file=sys.stderr)
        return result


def card_data(run: DataAwareRun) -> card_writer.DataInputs:
    """The caches this merge read (each input's, as its config names it) and the formula it applied."""
    plan = run.plan
    caches = {item.fisher: cache.path for item, cache in zip(plan.inputs, run.caches)}
    if plan.method == "fisher":
        note = (f"θ = Σᵢ wᵢ F̂ᵢ ⊙ θᵢ / Σᵢ wᵢ F̂ᵢ with F̂ = max(F, ε), ε = {plan.epsilon:g} (Fisher merging, "
                "Matena & Raffel): each input's diagonal Fisher from its cache below; tensors with no diagonal "
                "entry averaged with the weights.")
    else:
        note = (f"W = (Σᵢ G̃ᵢ)⁻¹ Σᵢ G̃ᵢ Wᵢ per linear weight with G̃ = αG + (1 − α)diag(G), α = {plan.alpha:g} "
                "(RegMean, Jin et al.): each input's Gram from the input side of its cache's KFAC factors; "
                "every other tensor averaged with the weights.")
    return card_writer.DataInputs(caches, (note,))
