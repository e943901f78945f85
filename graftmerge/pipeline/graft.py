"""Grafting one tensor of a merge, and running a whole graft config through mergekit safely.

Before the first tensor, :func:`tensor_records` resolves each tensor's record (λ, ρ, the Fisher
entry, the threshold, the kept masks); :func:`graft_tensor` hands a tensor's record and inputs
to the kernel (:mod:`graftmerge.pipeline.graft_kernel`). ``run_graft_merge`` wraps
mergekit's ``run_merge``: it validates the whole config, opens the inputs and runs the
global threshold pass (one MergeRun) before mergekit loads a tensor, and builds OUT beside
itself under a lock, replacing it whole only when the merge succeeds
(:mod:`graftmerge.formats.output_folder`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from mergekit.common import dtype_from_name

from graftmerge.formats.output_folder import MERGE, OutputFolder, stage_reached
from graftmerge.formats.rotation_store import RotationStore
from graftmerge.pipeline import (
    card_writer,  # as a module: it imports mergekit's registry, whose hook imports graft
    graft_kernel,
    schedule_binding,
)
from graftmerge.pipeline.finite_values import nonfinite_error
from graftmerge.pipeline.graft_kernel import TensorRecord
from graftmerge.pipeline.graft_plan import GraftInputs, plan_from_merge_config, plan_inputs
from graftmerge.pipeline.lora_inputs import lora_inputs_in_mergekit
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
        run.records = tensor_records(run)
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
    run.records = tensor_records(run)


def tensor_records(run: MergeRun) -> dict[str, TensorRecord]:
    """Every tensor's :class:`TensorRecord`, resolved from the run once its threshold is known (found now, once,
    for a global mask nobody prepared)."""
    plan, inputs = run.plan, run.inputs
    if plan.masked and plan.rho_scope == "global" and run.threshold is None:
        run.threshold, run.threshold_record = global_threshold(inputs, progress=False,
                                                               use_cache=run.use_threshold_cache)
    lone_adapter = (not inputs.fine_tunes and len(inputs.deltas) == 1
                    and hasattr(inputs.deltas[0], "low_rank_factors"))
    records = {}
    for name in inputs.post.tensors:
        scales = plan.scales(name)
        record = TensorRecord(name, tuple(scales.lam * w for w in scales.weights),
                              tuple(scales.lam * w for w in scales.delta_weights), out_dtype=run.out_dtype,
                              scheduled=scales if plan.scheduled else None)
        kind = inputs.fisher_kind(name) if plan.masked else None
        if kind is not None:
            lora = (functools.partial(inputs.deltas[0].low_rank_factors, name)
                    if lone_adapter and inputs.working_dtype(name) != torch.float64 else None)
            scoped = plan.rho_scope == "tensor"
            record = dataclasses.replace(
                record, kind=kind, fisher=inputs.fisher, rows=tuple(inputs.row_blocks(name)),
                rho=scales.rho if scoped else None, lora_factors=lora, kept_masks=run.kept_masks,
                rotations=run.rotations, threshold=0.0 if scoped else run.threshold.threshold,
                ties=0 if scoped else run.threshold.tie_quota.get(name, 0))
        records[name] = record
    return records


def graft_tensor(run: MergeRun, name: str, post: torch.Tensor, donor: torch.Tensor | None,
                 fine_tunes: Sequence[torch.Tensor], deltas: Sequence[torch.Tensor] = (),
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """θpost + M_ρ(Δ) for one tensor of ``run``, by the kernel from its record; inputs already in the working
    dtype, on the math device (``donor`` None with deltas only).

    The result is checked finite, also once cast to ``out_dtype`` (default: the run's): GraftError naming the
    tensor and its culprit. The directions its global mask removed are counted into the run.
    """
    if run.records is None:
        run.records = tensor_records(run)
    try:
        result, masked = graft_kernel.graft(run.records[name], post, donor, fine_tunes, deltas, out_dtype)
    except graft_kernel.NonFinite as found:
        given = [post, donor, *fine_tunes, *deltas] if found.stage == "result" else None
        raise nonfinite_error(run.inputs, name, found.rows, stage=found.stage, given=given, rotated=found.rotated,
                              out_dtype=found.out_dtype, result=found.result) from None
    if masked is not None:
        run.masked[name] = masked  # summed and checked before OUT is published
    return result


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
    run.records = tensor_records(run)
    for name in run.inputs.post.tensors:
        with torch.no_grad() if plan.masked else contextlib.nullcontext():
            yield graft_tensor(
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
            card_writer.write_merge_card(output.staging, merge_config, config_source, card_writer.graft_card_data(run))
        return result


def _check_before_publish(run: MergeRun) -> None:
    """What the merge wrote came from the inputs as validated and scored, masked as the threshold said; else
    GraftError (OUT is then left as it was)."""
    if run.threshold is not None:
        check_masked_total(run.inputs, run.threshold, run.masked, run.threshold_record)
    run.inputs.check_unchanged()
