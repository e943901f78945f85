"""What a graft would mask for several ρ (and λ), without writing a model (``graftmerge plan``).

``score_pass`` is the global threshold pre-pass of :mod:`graftmerge.pipeline.threshold_pass`
generalised to a grid: each tensor's inputs are read once, Δ is formed once per λ
(through ``GraftInputs.read_delta``, the merge's own formula), scored once per λ,
and the scores feed one exact threshold search per ρ. ``plan_report`` adds a second
pass that counts, per tensor, what each ρ's mask removes, with the kernel's own
selection (``mask_from_threshold`` with tie quotas, or ``top_k_mask`` per tensor).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from graftmerge.formats.rotation_store import RotationStore
from graftmerge.math.global_threshold import GlobalThreshold
from graftmerge.math.mask_stats import MaskTally, MultiThresholdSearch, score_mass, share
from graftmerge.math.selection import mask_from_threshold, masked_count, top_k_mask
from graftmerge.pipeline import schedule_binding
from graftmerge.pipeline.graft_plan import GraftInputs, GraftPlan
from graftmerge.pipeline.lora_inputs import lora_inputs_in_mergekit, scored_delta


class ReadOnce:
    """A tensor source that keeps its last read: the λ of a grid re-read nothing.

    Callers must not modify the returned tensor in place (``read_delta`` does not).
    """

    def __init__(self, source):
        self._source = source
        self._last: tuple[tuple, torch.Tensor] | None = None

    def __getattr__(self, attribute):
        return getattr(self._source, attribute)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The source's tensor (rows), read once for consecutive requests of the same one."""
        key = (name, rows)
        if self._last is None or self._last[0] != key:
            self._last = None  # free the previous tensor before reading the next
            self._last = (key, self._source.read(name, rows))
        return self._last[1]


def _is_source(value) -> bool:
    return hasattr(value, "read") and hasattr(value, "tensors")


def shared_reads(inputs: GraftInputs) -> GraftInputs:
    """A copy of ``inputs`` whose tensor sources (post, donor, fine-tunes, ...) read each tensor once."""
    changes = {}
    for item in dataclasses.fields(inputs):
        value = getattr(inputs, item.name)
        if _is_source(value):
            changes[item.name] = ReadOnce(value)
        elif isinstance(value, list) and value and all(_is_source(v) for v in value):
            changes[item.name] = [ReadOnce(v) for v in value]
    return dataclasses.replace(inputs, **changes)


def grid_views(inputs: GraftInputs, plans: dict[Hashable, GraftPlan]) -> dict[Hashable, GraftInputs]:
    """One GraftInputs per plan, all sharing ``inputs``' sources, Fisher cache and checks."""
    shared = shared_reads(inputs)
    return {key: dataclasses.replace(shared, plan=plan) for key, plan in plans.items()}


@dataclass
class PassResult:
    """Per view: the exact global threshold for every ρ, and ``Σ s`` per ranked tensor."""

    thresholds: dict[float, GlobalThreshold]
    mass: dict[str, float] = field(default_factory=dict)


def score_pass(
    views: dict[Hashable, GraftInputs],
    rhos: Sequence[float],
    device: str = "cpu",
    progress: bool = True,
    rotations: dict[Hashable, RotationStore] | None = None,
    after_each: Callable[[], None] | None = None,
) -> dict[Hashable, PassResult]:
    """Global thresholds of every (view, ρ) from one streaming pass over the ranked tensors.

    Views differ only in λ (their Fisher and tensors are shared): each block of each
    tensor is read once, its Fisher once, and Δ scored once per view. With
    ``rotations``, each KFAC weight's Δ̃ is kept per view for a later merge.
    ``after_each`` runs after each view's scores of each block are used (a sweep
    returns freed memory there).
    """
    first = next(iter(views.values()))
    names = first.ranked_names()
    total = sum(first.direction_count(name) for name in names)
    searches = {key: MultiThresholdSearch.create(rhos, total, sharing=len(views)) for key in views}
    results = {key: PassResult(thresholds={}) for key in views}

    def scored_blocks(name: str, keep: bool):
        """(view key, scores) for each row block of ``name`` and each view; keeps Δ̃ when asked."""
        for rows in first.row_blocks(name):
            fisher = first.tensor_fisher(name, rows).to(device)
            for key, view in views.items():
                scored = scored_delta(view, name, view.read_delta(name, device, rows), fisher, rows)
                if keep and rotations is not None and rows is None and scored.rotated is not None:
                    rotations[key].save(name, scored.rotated)
                yield key, scored.scores
                del scored
                if after_each is not None:
                    after_each()

    for name in tqdm(names, desc="graft scores", disable=not progress, unit="tensor"):
        for key, scores in scored_blocks(name, keep=True):
            searches[key].add_coarse(name, scores)
            results[key].mass[name] = results[key].mass.get(name, 0.0) + score_mass(scores)
    rescore = sorted(set().union(*(search.fine_pass_names() for search in searches.values())))
    for name in tqdm(rescore, desc="graft scores: re-scoring", disable=not progress or not rescore, unit="tensor"):
        for key, scores in scored_blocks(name, keep=False):
            searches[key].add_fine(name, scores)
    for key, search in searches.items():
        results[key].thresholds = search.results()
    return results


@dataclass
class TensorPlan:
    """One ranked tensor under every ρ: directions, score mass, and what each mask removes."""

    name: str
    kind: str
    directions: int
    mass: float
    tallies: dict[float, MaskTally]


@dataclass
class RhoPlan:
    """One ρ over the whole model: threshold (global scope), k, masked count, share of Σ s removed."""

    rho: float
    threshold: float | None
    k: int
    masked: int
    removed_share: float


@dataclass
class PlanReport:
    """What ``graftmerge plan`` reports: the plan, its directions D and Σ s, per tensor and per ρ."""

    plan: GraftPlan
    directions: int
    mass: float
    tensors: list[TensorPlan]
    rhos: list[RhoPlan]


def tensor_masks(
    inputs: GraftInputs,
    name: str,
    rhos: Sequence[float],
    thresholds: dict[float, GlobalThreshold] | None,
    device: str = "cpu",
    rotations: RotationStore | None = None,
):
    """Per row block of ``name``: (rows, scores, {ρ: mask}), selected exactly as the merge kernel selects.

    Global scope (``thresholds`` given): ``mask_from_threshold`` with each ρ's tie
    quota, over the same row blocks as the kernel. Tensor scope: ``top_k_mask``.
    """
    if thresholds is None:
        scores = scored_delta(
            inputs, name, inputs.read_delta(name, device), inputs.tensor_fisher(name).to(device)
        ).scores
        yield None, scores, {rho: top_k_mask(scores, masked_count(rho, scores.numel())) for rho in rhos}
        return
    ties = {rho: thresholds[rho].tie_quota.get(name, 0) for rho in rhos}
    for rows in inputs.row_blocks(name):
        fisher = inputs.tensor_fisher(name, rows).to(device)
        rotated = rotations.load(name, device) if rotations is not None and rows is None else None
        delta = inputs.read_delta(name, device, rows) if rotated is None else None
        scores = scored_delta(inputs, name, delta, fisher, rows, rotated).scores
        masks = {}
        for rho in rhos:
            threshold = thresholds[rho].threshold
            masks[rho] = mask_from_threshold(scores, threshold, ties[rho])
            if ties[rho]:
                ties[rho] -= min(ties[rho], int((scores == threshold).sum()))
        yield rows, scores, masks


def plan_report(inputs: GraftInputs, rhos: Sequence[float], device: str = "cpu", progress: bool = True) -> PlanReport:
    """Thresholds, masked fractions and removed score shares for every ρ (nothing written).

    ``inputs`` must be opened with a masked plan (a Fisher cache); its ρ is ignored.
    Global scope: one scoring pass for all ρ (KFAC Δ̃ kept in a temporary folder),
    then a counting pass. Tensor scope: one pass.
    """
    names = inputs.ranked_names()
    tallies = {name: {rho: MaskTally() for rho in rhos} for name in names}
    mass: dict[str, float] = {name: 0.0 for name in names}
    thresholds: dict[float, GlobalThreshold] | None = None
    scratch = Path(tempfile.mkdtemp(prefix="graftmerge-plan-"))
    try:
        store = None
        if inputs.plan.rho_scope == "global":
            store = RotationStore(scratch)
            result = score_pass({0: inputs}, rhos, device, progress, rotations={0: store})[0]
            thresholds = result.thresholds
        for name in tqdm(names, desc="graft plan: counting", disable=not progress, unit="tensor"):
            for _, scores, masks in tensor_masks(inputs, name, rhos, thresholds, device, store):
                if thresholds is None:
                    mass[name] += score_mass(scores)
                for rho, mask in masks.items():
                    tallies[name][rho].add(scores, mask)
        if thresholds is not None:
            mass = result.mass
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    tensors = [
        TensorPlan(name, inputs.fisher_kind(name), inputs.direction_count(name), mass[name], tallies[name])
        for name in names
    ]
    directions = sum(t.directions for t in tensors)
    total_mass = sum(t.mass for t in tensors)
    summaries = []
    for rho in rhos:
        masked = sum(t.tallies[rho].masked for t in tensors)
        removed = sum(t.tallies[rho].masked_score for t in tensors)
        threshold = thresholds[rho].threshold if thresholds else None
        k = thresholds[rho].k if thresholds else sum(masked_count(rho, t.directions) for t in tensors)
        summaries.append(RhoPlan(rho, threshold, k, masked, share(removed, total_mass)))
    return PlanReport(inputs.plan, directions, total_mass, tensors, summaries)


def bind_report_schedule(inputs: GraftInputs, config, options) -> GraftInputs:
    """``inputs`` with their plan's schedules resolved per tensor by mergekit's planner, as a merge of ``config``
    resolves them (LoRA inputs in their mergekit view meanwhile)."""
    with lora_inputs_in_mergekit(config, inputs) as view:
        inputs.plan = schedule_binding.bind_schedule(inputs.plan, view, options, names=inputs.post.tensors)
    return inputs


def format_report(report: PlanReport) -> str:
    """A compact text report: one line per ρ, then one row per tensor (masked % / removed %)."""
    plan = report.plan
    lam = "scheduled" if "lambda" in plan.scheduled else f"{plan.lam:g}"
    lines = [
        f"graft plan: {len(report.tensors)} ranked tensors, D = {report.directions:,} directions, "
        f"Σ s = {report.mass:.4g}  (lambda {lam}, rho_scope {plan.rho_scope}, mask {plan.mask})",
    ]
    if plan.scheduled:
        lines.append(f"per-layer schedules: {', '.join(plan.scheduled)} (each tensor scored with its own scales; "
                     "the rho below replace the config's)")
    lines.append("")
    for summary in report.rhos:
        threshold = "per tensor" if summary.threshold is None else f"{summary.threshold:.6g}"
        threshold = "none" if summary.k == 0 else threshold
        lines.append(
            f"rho {summary.rho:<8g} threshold {threshold:<12}  k = {summary.k:,}  masked {summary.masked:,} "
            f"({100 * share(summary.masked, report.directions):.3f}% of D)  removes "
            f"{100 * summary.removed_share:.2f}% of Σ s"
        )
    width = max([len("tensor")] + [len(t.name) for t in report.tensors])
    header = f"\n{'tensor':<{width}}  {'kind':<8} {'D':>10}  " + "  ".join(
        f"{'rho ' + format(s.rho, 'g'):>17}" for s in report.rhos
    )
    lines += [
        header,
        f"{'':<{width}}  {'':<8} {'':>10}  " + "  ".join(f"{'masked% removed%':>17}" for _ in report.rhos),
    ]
    for t in report.tensors:
        cells = [
            f"{100 * share(t.tallies[s.rho].masked, t.directions):8.3f} "
            f"{100 * share(t.tallies[s.rho].masked_score, t.mass):8.2f}"
            for s in report.rhos
        ]
        lines.append(f"{t.name:<{width}}  {t.kind:<8} {t.directions:>10,}  " + "  ".join(cells))
    return "\n".join(lines)


def report_json(report: PlanReport) -> dict:
    """The report as plain data (``graftmerge plan --json``)."""
    return {
        "directions": report.directions,
        "score_mass": report.mass,
        "rhos": [dataclasses.asdict(s) for s in report.rhos],
        "tensors": [
            {
                "name": t.name,
                "kind": t.kind,
                "directions": t.directions,
                "score_mass": t.mass,
                "masked": {repr(rho): tally.masked for rho, tally in t.tallies.items()},
                "masked_score": {repr(rho): tally.masked_score for rho, tally in t.tallies.items()},
            }
            for t in report.tensors
        ],
    }
