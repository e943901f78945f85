"""Grafting one tensor, and running a whole graft config through mergekit safely.

``graft_tensor`` is what the mergekit kernel calls for every weight, with the
:class:`~graftmerge.pipeline.merge_run.MergeRun` of its merge. ``run_graft_merge`` wraps
mergekit's ``run_merge``: it validates the whole config, opens the inputs and runs the
global threshold pass (one MergeRun) before mergekit loads a tensor, and builds OUT beside
itself under a lock, replacing it whole only when the merge succeeds
(:mod:`graftmerge.formats.output_folder`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from mergekit.common import dtype_from_name

from graftmerge.errors import GraftError
from graftmerge.formats.output_folder import MERGE, OutputFolder, stage_reached
from graftmerge.formats.rotation_store import RotationStore
from graftmerge.math.donor_delta import donor_delta
from graftmerge.math.global_threshold import GlobalThreshold
from graftmerge.math.projection import remove_masked, remove_masked_coordinates, remove_masked_pairs
from graftmerge.math.selection import mask_from_threshold, masked_count, top_k_mask
from graftmerge.pipeline import (
    merge_cards,  # as a module: it imports mergekit's registry, whose hook imports graft
    schedule_binding,
)
from graftmerge.pipeline.finite_values import check_delta, check_result
from graftmerge.pipeline.graft_plan import GraftInputs, plan_from_merge_config, plan_inputs
from graftmerge.pipeline.lora_inputs import lora_inputs_in_mergekit, scored_delta
from graftmerge.pipeline.merge_run import MergeRun
from graftmerge.pipeline.mergekit_inputs import check_mergekit_inputs, post_architecture
from graftmerge.pipeline.threshold_pass import (
    check_masked_total,
    compute_global_threshold,
    global_threshold,
    threshold_cache_enabled,
)


def prepare(run: MergeRun, device: str = "cpu", progress: bool = True, scratch: Path | None = None) -> None:
    """Everything a mask needs before the first tensor: the global threshold, or a value scan.

    With ``scratch``, a fresh threshold pass keeps there what the merge needs (each KFAC
    weight's candidate pairs or Δ̃, every kept tensor's final mask), so the merge applies
    those masks without reading the Fisher cache again.
    """
    if not run.plan.masked:
        return
    run.masked.clear()  # counted afresh by this merge (``_masked``)
    if run.plan.rho_scope == "global":
        rotations = RotationStore(scratch) if scratch is not None else None
        run.threshold, run.threshold_record = global_threshold(run.inputs, device=device, progress=progress,
                                                               rotations=rotations, use_cache=run.use_threshold_cache)
        if rotations is not None:
            run.rotations = rotations
            if rotations.has_masks:  # the pass ran now (not a cached threshold)
                run.kept_masks = rotations
    else:
        for name in run.inputs.ranked_names():
            run.inputs.tensor_fisher(name)  # raises on NaN, Inf or negative entries


def graft_tensor(
    run: MergeRun,
    name: str,
    post: torch.Tensor,
    donor: torch.Tensor | None,
    fine_tunes: Sequence[torch.Tensor],
    deltas: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """θpost + M_ρ(Δ) for one tensor of ``run``; inputs already in the working dtype, on the math device.

    ``fine_tunes`` and ``deltas`` are the ``role: donor_ft`` and ``role: delta`` tensors, in
    plan order (``donor`` is None with deltas only).
    """
    plan = run.plan
    if (len(fine_tunes), len(deltas)) != (len(plan.fine_tunes), len(plan.deltas)) or (fine_tunes and donor is None):
        raise GraftError(f"tensor {name!r}: graft was handed {len(fine_tunes)} donor_ft and {len(deltas)} delta tensors"
                         f"{'' if donor is not None else ' and no donor'}; its config has {len(plan.fine_tunes)} "
                         f"donor_ft and {len(plan.deltas)} delta inputs")
    return graft_opened(run, name, post, donor, fine_tunes, deltas)


def graft_opened(
    run: MergeRun,
    name: str,
    post: torch.Tensor,
    donor: torch.Tensor | None,
    fine_tunes: Sequence[torch.Tensor],
    deltas: Sequence[torch.Tensor] = (),
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``graft_tensor`` without the count check, for a run over inputs opened from files or from memory.

    The result is checked finite, also once cast to ``out_dtype`` (default: the run's, as
    ``run_graft_merge`` noted it from the config): GraftError naming the tensor and its culprit.
    """
    if not isinstance(run, MergeRun):
        raise TypeError(f"graft_opened takes the MergeRun of a merge (MergeRun(inputs) for opened inputs), "
                        f"not {type(run).__name__}")
    plan, inputs = run.plan, run.inputs
    delta = donor_delta(donor, fine_tunes, plan.lambdas_for(name), deltas, plan.delta_lambdas_for(name))
    if plan.masked and inputs.fisher_kind(name):
        delta = _masked(run, name, delta)
    result = delta.add_(post.to(delta.dtype)).to(post.dtype)  # θpost + Δ', in Δ's buffer
    check_result(inputs, name, result, out_dtype or run.out_dtype, [post, donor, *fine_tunes, *deltas])
    return result


def _masked(run: MergeRun, name: str, delta: torch.Tensor) -> torch.Tensor:
    inputs = run.inputs
    if run.plan.rho_scope == "tensor":
        fisher = inputs.tensor_fisher(name).to(delta.device)
        scored = scored_delta(inputs, name, delta, fisher)
        mask = top_k_mask(scored.scores, masked_count(run.plan.rho_for(name), scored.scores.numel()))
        return remove_masked(scored, mask, fisher)
    threshold = _threshold(run, str(delta.device))
    masked = _kept_mask_removed(run, name, delta)
    if masked is not None:
        run.masked[name] = masked
        return delta
    ties_left = threshold.tie_quota.get(name, 0)
    masked = 0
    kept = run.rotations
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
    run.masked[name] = masked  # summed and checked before OUT is published
    return delta


def _threshold(run: MergeRun, device: str) -> GlobalThreshold:
    """The run's global threshold; found now (once) for a run nobody prepared."""
    if run.threshold is None:
        run.threshold, run.threshold_record = global_threshold(run.inputs, device=device, progress=False,
                                                               use_cache=run.use_threshold_cache)
    return run.threshold


def _kept_mask_removed(run: MergeRun, name: str, delta: torch.Tensor) -> int | None:
    """Remove the mask the threshold pass kept for ``name`` from ``delta``, in place: how many directions it
    masked; None if it kept none."""
    kept = run.kept_masks
    positions = kept.masked_positions(name) if kept is not None else None
    if positions is None:
        return None
    if run.inputs.fisher_kind(name) != "kfac":
        check_delta(run.inputs, name, delta)  # zeroing a masked coordinate must not hide a NaN or Inf there
        remove_masked_coordinates(delta, positions)
        return positions.numel()
    pairs = kept.load_pairs(name, delta.device)
    if pairs is None:
        return None
    remove_masked_pairs(delta, pairs, positions)
    return positions.numel()


def graft_in_memory(inputs: GraftInputs | MergeRun, device: torch.device | str = "cpu",
                    out_dtype: torch.dtype | None = None) -> Iterator[torch.Tensor]:
    """Graft every tensor of in-memory inputs, in ``inputs.post`` order (each checked finite in ``out_dtype`` too).

    The whole model is in memory here, so the global threshold is computed from
    the given tensors themselves (no pre-pass over files, nothing cached on disk),
    unless ``inputs`` is a run that already has one. Given GraftInputs, the merge's
    run is made here and lives as long as the iteration.
    """
    run = inputs if isinstance(inputs, MergeRun) else MergeRun(inputs)
    plan = run.plan
    if plan.masked and plan.rho_scope == "global" and run.threshold is None:
        with torch.no_grad():
            run.threshold = compute_global_threshold(run.inputs, device=str(device), progress=False)
    for name in run.inputs.post.tensors:
        with torch.no_grad() if plan.masked else contextlib.nullcontext():
            yield graft_opened(
                run,
                name,
                run.inputs.post.read(name),
                run.inputs.donor.read(name) if run.inputs.donor is not None else None,
                [fine_tune.read(name) for fine_tune in run.inputs.fine_tunes],
                [delta.read(name) for delta in run.inputs.deltas],
                out_dtype=out_dtype,
            )


RunMergekit = Callable[..., object]  # (run, config, out_path, options=, config_source=) -> mergekit's result


def run_graft_merge(run_mergekit: RunMergekit, merge_config, out_path: str, options, config_source=None,
                    use_threshold_cache: bool | None = None):
    """mergekit's ``run_merge`` for a graft config: lock OUT, validate, open, pre-pass, then OUT replaced whole.

    The merge's :class:`MergeRun` is born here, once the config is validated and its inputs
    opened, and dies when this returns. ``run_mergekit(run, config, out_path, options=,
    config_source=)`` runs mergekit on the config it is given, for ``run`` (the adapter
    makes ``run`` findable by mergekit's per-tensor tasks for that long). OUT may be
    replaced only when it is empty or holds nothing but files a merge writes. A bad input
    raises GraftError (the command line says it in one line: :mod:`graftmerge.cli`).
    ``use_threshold_cache`` None: the user's setting (:func:`threshold_cache_enabled`).
    """
    plan = plan_from_merge_config(merge_config)  # reads configs only; OUT may be none of its inputs
    with OutputFolder(out_path, replace=MERGE, inputs=plan_inputs(plan)) as output:
        loaded = check_mergekit_inputs(merge_config, options.allow_crimes, options.trust_remote_code)
        run = MergeRun(GraftInputs.open(plan), out_dtype=dtype_from_name(merge_config.out_dtype),
                       use_threshold_cache=threshold_cache_enabled() if use_threshold_cache is None
                       else use_threshold_cache,
                       before_tensor=functools.partial(stage_reached, "merging"))  # a test can stop it here
        # staging has OUT's basename: mergekit names the model card after it
        with lora_inputs_in_mergekit(merge_config, run.inputs) as config, post_architecture(loaded):
            # schedules resolved per tensor by mergekit's planner, before the threshold pass needs them
            run.inputs.plan = schedule_binding.bind_schedule(plan, config, options, names=run.inputs.post.tensors)
            prepare(run, device=options.device or "cpu", progress=not options.quiet,
                    scratch=output.scratch / "kfac-rotations")
            if config is not merge_config and config_source is None:
                config_source = merge_config.to_yaml()  # the card shows the config as written
            run.inputs.check_unchanged()  # the pass read what was validated
            result = run_mergekit(run, config, str(output.staging), options=options, config_source=config_source)
        _check_before_publish(run)
        if options.write_model_card:  # graftmerge's card replaces mergekit's: the model tree, the cache and the mask
            merge_cards.write_merge_card(output.staging, merge_config, config_source, merge_cards.graft_card_data(run))
        return result


def _check_before_publish(run: MergeRun) -> None:
    """What the merge wrote came from the inputs as validated and scored, masked as the threshold said; else
    GraftError (OUT is then left as it was)."""
    if run.threshold is not None:
        check_masked_total(run.inputs, run.threshold, run.masked, run.threshold_record)
    run.inputs.check_unchanged()
