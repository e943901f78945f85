"""Grafting one tensor, and running a whole graft config through mergekit safely.

``graft_tensor`` is what the mergekit kernel calls for every weight.
``run_graft_merge`` wraps mergekit's ``run_merge``: it validates the whole
config and runs the global threshold pass before mergekit loads a tensor, and
builds OUT beside itself under a lock, replacing it whole only when the merge succeeds
(:mod:`graftmerge.formats.output_folder`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import click
import torch
from mergekit.common import dtype_from_name

from graftmerge.errors import GraftError, cli_error
from graftmerge.formats.output_folder import MERGE, OutputFolder, stage_reached
from graftmerge.formats.rotation_store import RotationStore
from graftmerge.math.donor_delta import donor_delta
from graftmerge.math.projection import remove_masked, remove_masked_coordinates, remove_masked_pairs
from graftmerge.math.selection import mask_from_threshold, masked_count, top_k_mask
from graftmerge.pipeline.finite_values import check_delta, check_result
from graftmerge.pipeline.graft_plan import (
    GraftInputs,
    GraftPlan,
    open_inputs,
    plan_from_merge_config,
    plan_inputs,
)
from graftmerge.pipeline.lora_inputs import lora_inputs_in_mergekit, scored_delta
from graftmerge.pipeline.mergekit_inputs import check_mergekit_inputs, post_architecture
from graftmerge.pipeline.threshold_pass import (
    check_masked_total,
    compute_global_threshold,
    forget_thresholds,
    global_threshold,
)

# Plans validated by run_graft_merge, by everything but dtype: the kernel sees
# tensors already cast and cannot read the config's dtype itself.
_VALIDATED_PLANS: dict[GraftPlan, GraftPlan] = {}


def forget_process_state() -> None:
    """Forget what earlier merges left in this process (validated plans, opened inputs,
    remembered thresholds), so the next merge starts as in a fresh process: what tests
    and long-lived callers running several merges in one process want."""
    _VALIDATED_PLANS.clear()
    open_inputs.cache_clear()
    forget_thresholds()


def _without_dtype(plan: GraftPlan) -> GraftPlan:
    return dataclasses.replace(plan, dtype=None)


def validated_plan(plan: GraftPlan) -> GraftPlan:
    """The plan run_graft_merge validated for this config (with its dtype), else ``plan``."""
    return _VALIDATED_PLANS.get(_without_dtype(plan), plan)


def was_validated(plan: GraftPlan) -> bool:
    """Whether run_graft_merge validated this plan's config (a donor equal to the post model must come from one)."""
    return _without_dtype(plan) in _VALIDATED_PLANS


def prepare(inputs: GraftInputs, device: str = "cpu", progress: bool = True, scratch: Path | None = None) -> None:
    """Everything a mask needs before the first tensor: the global threshold, or a value scan.

    With ``scratch``, a fresh threshold pass keeps there what the merge needs (each KFAC
    weight's candidate pairs or Δ̃, every kept tensor's final mask), so the merge applies
    those masks without reading the Fisher cache again.
    """
    if not inputs.plan.masked:
        return
    inputs.memo.pop("masked counts", None)  # counted afresh by this merge (``_masked``)
    if inputs.plan.rho_scope == "global":
        rotations = RotationStore(scratch) if scratch is not None else None
        global_threshold(inputs, device=device, progress=progress, rotations=rotations)
        if rotations is not None:
            inputs.memo["rotations"] = rotations
            if rotations.has_masks:  # the pass ran now (not a cached threshold)
                inputs.memo["kept_masks"] = rotations
    else:
        for name in inputs.ranked_names():
            inputs.tensor_fisher(name)  # raises on NaN, Inf or negative entries


def graft_tensor(
    plan: GraftPlan,
    name: str,
    post: torch.Tensor,
    donor: torch.Tensor | None,
    fine_tunes: Sequence[torch.Tensor],
    deltas: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """θpost + M_ρ(Δ) for one tensor; inputs already in the working dtype, on the math device.

    ``deltas`` are the ``role: delta`` tensors, in plan order (``donor`` is None with deltas only).
    """
    return graft_opened(open_inputs(plan), name, post, donor, fine_tunes, deltas)


def graft_opened(
    inputs: GraftInputs,
    name: str,
    post: torch.Tensor,
    donor: torch.Tensor | None,
    fine_tunes: Sequence[torch.Tensor],
    deltas: Sequence[torch.Tensor] = (),
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``graft_tensor`` for inputs already opened (from files or from memory).

    The result is checked finite, also once cast to ``out_dtype`` (default: the one
    ``run_graft_merge`` noted from the config): GraftError naming the tensor and its culprit.
    """
    stage_reached("merging")
    delta = donor_delta(donor, fine_tunes, inputs.plan.lambdas, deltas, inputs.plan.delta_lambdas)
    if inputs.plan.masked and inputs.fisher_kind(name):
        delta = _masked(inputs, name, delta)
    result = delta.add_(post.to(delta.dtype)).to(post.dtype)  # θpost + Δ', in Δ's buffer
    check_result(inputs, name, result, out_dtype or inputs.memo.get("out_dtype"), [post, donor, *fine_tunes, *deltas])
    return result


def _masked(inputs: GraftInputs, name: str, delta: torch.Tensor) -> torch.Tensor:
    plan = inputs.plan
    if plan.rho_scope == "tensor":
        fisher = inputs.tensor_fisher(name).to(delta.device)
        scored = scored_delta(inputs, name, delta, fisher)
        mask = top_k_mask(scored.scores, masked_count(plan.rho, scored.scores.numel()))
        return remove_masked(scored, mask, fisher)
    threshold = inputs.memo.get("global_threshold") or global_threshold(
        inputs, device=str(delta.device), progress=False
    )
    inputs.memo["global threshold used"] = threshold
    masked = _kept_mask_removed(inputs, name, delta)
    if masked is not None:
        inputs.memo.setdefault("masked counts", {})[name] = masked
        return delta
    ties_left = threshold.tie_quota.get(name, 0)
    masked = 0
    kept = inputs.memo.get("rotations")
    # The same row blocks as the threshold pass: identical scores, and a huge
    # embedding never needs a full-size score tensor.
    for rows in inputs.row_blocks(name):
        part = delta if rows is None else delta[rows[0] : rows[1]]
        fisher = inputs.tensor_fisher(name, rows).to(delta.device)
        rotated = kept.load(name, delta.device) if kept is not None and rows is None else None
        scored = scored_delta(inputs, name, part, fisher, rows, rotated)
        mask = mask_from_threshold(scored.scores, threshold.threshold, ties_left)
        masked += int(mask.sum())
        if ties_left:
            ties_left -= min(ties_left, int((scored.scores == threshold.threshold).sum()))
        remove_masked(scored, mask, fisher)  # in place: ``part`` is a view of ``delta``
        del scored, mask, fisher
    inputs.memo.setdefault("masked counts", {})[name] = masked  # summed and checked before OUT is published
    return delta


def _kept_mask_removed(inputs: GraftInputs, name: str, delta: torch.Tensor) -> int | None:
    """Remove the mask the threshold pass kept for ``name`` from ``delta``, in place: how many directions it
    masked; None if it kept none."""
    kept = inputs.memo.get("kept_masks")
    positions = kept.masked_positions(name) if kept is not None else None
    if positions is None:
        return None
    if inputs.fisher_kind(name) != "kfac":
        check_delta(inputs, name, delta)  # zeroing a masked coordinate must not hide a NaN or Inf there
        remove_masked_coordinates(delta, positions)
        return positions.numel()
    pairs = kept.load_pairs(name, delta.device)
    if pairs is None:
        return None
    remove_masked_pairs(delta, pairs, positions)
    return positions.numel()


def graft_in_memory(inputs: GraftInputs, device: torch.device | str = "cpu",
                    out_dtype: torch.dtype | None = None) -> Iterator[torch.Tensor]:
    """Graft every tensor of in-memory inputs, in ``inputs.post`` order (each checked finite in ``out_dtype`` too).

    The whole model is in memory here, so the global threshold is computed from
    the given tensors themselves (no pre-pass over files, nothing cached on disk).
    """
    plan = inputs.plan
    if plan.masked and plan.rho_scope == "global":
        with torch.no_grad():
            inputs.memo["global_threshold"] = compute_global_threshold(inputs, device=str(device), progress=False)
    for name in inputs.post.tensors:
        with torch.no_grad() if plan.masked else contextlib.nullcontext():
            yield graft_opened(
                inputs,
                name,
                inputs.post.read(name),
                inputs.donor.read(name) if inputs.donor is not None else None,
                [fine_tune.read(name) for fine_tune in inputs.fine_tunes],
                [delta.read(name) for delta in inputs.deltas],
                out_dtype=out_dtype,
            )


def run_graft_merge(run_merge: Callable, merge_config, out_path: str, options, config_source=None):
    """mergekit's ``run_merge`` for a graft config: lock OUT, validate, pre-pass, then OUT replaced whole.

    OUT may be replaced only when it is empty or holds nothing but files a merge writes.
    """
    try:
        plan = plan_from_merge_config(merge_config)  # reads configs only; OUT may be none of its inputs
        with OutputFolder(out_path, replace=MERGE, inputs=plan_inputs(plan)) as output:
            loaded = check_mergekit_inputs(merge_config, options.allow_crimes, options.trust_remote_code)
            inputs = open_inputs(plan)
            _VALIDATED_PLANS[_without_dtype(plan)] = plan
            inputs.memo["out_dtype"] = dtype_from_name(merge_config.out_dtype)  # the kernel checks the cast too
            try:
                prepare(inputs, device=options.device or "cpu", progress=not options.quiet,
                        scratch=output.scratch / "kfac-rotations")
                # staging has OUT's basename: mergekit names the model card after it
                with lora_inputs_in_mergekit(merge_config, inputs) as config, post_architecture(loaded):
                    if config is not merge_config and config_source is None:
                        config_source = merge_config.to_yaml()  # the card shows the config as written
                    inputs.check_unchanged()  # the pass read what was validated
                    result = run_merge(config, str(output.staging), options=options, config_source=config_source)
                _check_before_publish(inputs)
                return result
            finally:
                inputs.memo.pop("rotations", None)  # its files go with the staging folder
                inputs.memo.pop("kept_masks", None)
                inputs.memo.pop("out_dtype", None)
    except GraftError as error:
        raise_for_cli(error, verbose=options.verbosity > 0)


def _check_before_publish(inputs: GraftInputs) -> None:
    """What the merge wrote came from the inputs as validated and scored, masked as the threshold said; else
    GraftError (OUT is then left as it was)."""
    threshold = inputs.memo.pop("global threshold used", None)
    if threshold is not None:
        check_masked_total(inputs, threshold)
    inputs.memo.pop("masked counts", None)
    inputs.check_unchanged()


def raise_for_cli(error: GraftError, verbose: bool):
    """Inside a click command, a one-line ``error:`` and exit 2; with ``-v``, the traceback."""
    if not verbose and click.get_current_context(silent=True) is not None:
        raise cli_error(error) from None
    raise error
