"""``merge_method: graft`` for mergekit: θpost + M_ρ(Σ λ_i (θft_i − θdonor)), per tensor.

mergekit plans one task per tensor from the config's parameters and cannot hand a task an
object, so each merge's :class:`~graftmerge.pipeline.merge_run.MergeRun` is registered under an
id for as long as mergekit's ``run_merge`` runs (the parameter ``graft_run``); ``merge_group``
finds it by that id: the one lookup of per-merge state. In-memory inputs (``merge_state_dicts``)
are grafted all at once by :func:`graft_state_dict_groups`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from mergekit.merge_methods.base import (
    BasePolicy,
    GroupMergeMethod,
    InputContract,
    MergeMethodSpec,
    ParameterScope,
    ParameterSpec,
    TensorGroup,
)

from graftmerge.adapter.mergekit_compat import TensorGroupMethod
from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import InMemoryCheckpoint
from graftmerge.methods.active_runs import ActiveRuns
from graftmerge.pipeline import schedule_binding
from graftmerge.pipeline.graft import graft_in_memory, graft_tensor, run_graft_merge
from graftmerge.pipeline.graft_plan import FineTune, GraftInputs, build_plan, positional_roles
from graftmerge.pipeline.lora_inputs import InMemoryDelta
from graftmerge.pipeline.merge_run import MergeRun
from graftmerge.pipeline.schedules import Schedule

PAPER_URL = "https://arxiv.org/abs/2610.05872"
RUN_PARAMETER = "graft_run"  # the id of the merge a task belongs to, put into the config mergekit sees


# The graft merges running in this process, by id, each for exactly as long as mergekit's
# run_merge runs: per process by necessity (mergekit's tasks carry only parameters).
_ACTIVE_RUNS: ActiveRuns[MergeRun] = ActiveRuns("graft")


def find_run(run_id: str | None) -> MergeRun:
    """The run registered under ``run_id``; GraftError when there is none (a task outside a graft merge)."""
    run = _ACTIVE_RUNS.find(run_id)
    if run is None:
        raise GraftError(
            "graft ran a tensor outside a graft merge: run graft configs through mergekit's run_merge "
            "(mergekit-yaml, mergekit-multi, graftmerge merge) with graftmerge installed, or merge "
            "tensors in memory with merge_state_dicts"
        )
    return run


class GraftMergeMethod(TensorGroupMethod, GroupMergeMethod):
    """θpost + M_ρ(Σ λ_i (θft_i − θdonor)); base_model is θpost."""

    def __init__(self) -> None:
        self.spec = MergeMethodSpec(
            name="graft",
            pretty_name="Graft",
            reference_url=PAPER_URL,
            parameters=(
                ParameterSpec("role", str, ParameterScope.NON_BASE, default=""),
                ParameterSpec("weight", float, ParameterScope.NON_BASE, default=1.0),
                ParameterSpec("lambda", float, ParameterScope.SHARED, default=1.0),
                ParameterSpec("rho", float, ParameterScope.SHARED, default=0.0),
                ParameterSpec("fisher", str | None, ParameterScope.SHARED, default=None),
                ParameterSpec("rho_scope", str, ParameterScope.SHARED, default="global"),
                ParameterSpec("mask", str, ParameterScope.SHARED, default="auto"),
                ParameterSpec(RUN_PARAMETER, str | None, ParameterScope.SHARED, default=None),
            ),
            contract=InputContract(base=BasePolicy.REQUIRED, min_non_base=1),  # one role: delta is a graft
        )

    def validate_inputs(self, input_ids, base_id=None, *, group_name=None) -> None:
        """mergekit's input checks, after a one-line GraftError when the base (θpost) is missing."""
        if base_id is None or base_id not in input_ids:
            raise GraftError(
                "graft needs a base input: the post-trained model that receives the graft "
                "(`base_model:` in a config, `base=<its id>` in merge_state_dicts)"
            )
        super().validate_inputs(input_ids, base_id, group_name=group_name)

    def merge_group(self, group: TensorGroup, /, **parameters: Any) -> torch.Tensor:
        """One weight from mergekit's graph: its merge's run (by the id in the parameters), inputs sorted by role,
        graft."""
        run = find_run(parameters[RUN_PARAMETER])
        if run.before_tensor is not None:
            run.before_tensor()
        post = group.base.tensor
        donor, fine_tunes, deltas = None, [], []
        for entry in group.non_base:  # in config order, as the run's plan lists them
            role = parameters["role"][entry.id]
            if role == "donor":
                donor = entry.tensor
            elif role == "donor_ft":
                fine_tunes.append(entry.tensor)
            elif role == "delta":
                deltas.append(entry.tensor)
            else:
                raise GraftError(f"model {entry.id} has role {role!r}; roles are donor, donor_ft, delta")
        if donor is None and fine_tunes:  # base_model listed again as role donor: mergekit folds it into the base
            donor = post
        order = [entry.id for entry in group.non_base]
        per_input = {key: {"role": parameters["role"][key], "weight": parameters["weight"][key]} for key in order}
        name = group.metadata.name
        record = run.records[name]
        schedule_binding.check_handed(record.scheduled, name, parameters, per_input, order)
        if (len(fine_tunes), len(deltas)) != (len(record.lambdas), len(record.delta_lambdas)) or (
                fine_tunes and donor is None):
            raise GraftError(f"tensor {name!r}: graft was handed {len(fine_tunes)} donor_ft and {len(deltas)} delta "
                             f"tensors{'' if donor is not None else ' and no donor'}; its config has "
                             f"{len(record.lambdas)} donor_ft and {len(record.delta_lambdas)} delta inputs")
        return graft_tensor(run, name, post, donor, fine_tunes, deltas)

    def merge_in_memory(self, groups, parameters, options, input_dtypes, out_dtype):
        """In-memory inputs (``merge_state_dicts``: plain ids, not model references) are grafted all at once."""
        merged = graft_state_dict_groups(groups, parameters, input_dtypes, out_dtype)
        return tuple(t if out_dtype is None else t.to(out_dtype) for t in merged)


def graft_state_dict_groups(groups, parameters: list[dict[str, Any]], input_dtypes,
                            out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Graft in-memory tensor groups (one per weight) that share their inputs' ids and roles.

    Each result is checked finite, also cast to ``out_dtype`` (what the caller gets).
    """
    if not groups:
        return []
    first = groups[0]
    ids = [entry.id for entry in first.entries]
    for group in groups[1:]:
        if [entry.id for entry in group.entries] != ids or group.base.id != first.base.id:
            raise GraftError(f"graft needs the same inputs for every tensor; {group.metadata.name} has other ids")
    shared = parameters[0]
    non_base = [entry.id for entry in first.non_base]
    roles = positional_roles(non_base, dict(shared["role"]))
    names = [group.metadata.name or f"<tensor {index}>" for index, group in enumerate(groups)]
    schedule = per_group_schedule(names, parameters, {key: roles[key] for key in non_base})
    if len(set(names)) != len(names):
        raise GraftError("graft needs distinct tensor names for in-memory inputs")
    dtypes = {name: dtype for name, dtype in zip(names, input_dtypes)}
    check_distinct_state_dicts(groups, [(first.base.id, "base"), *((key, roles[key]) for key in non_base)])

    def source(key, label: str, kind=InMemoryCheckpoint) -> InMemoryCheckpoint:
        """Input ``key``'s tensor of every group, as one in-memory checkpoint (or ``kind``)."""
        index = ids.index(key)
        return kind({n: g.entries[index].tensor for n, g in zip(names, groups)}, dtypes, label)

    donor_id = next((key for key in non_base if roles[key] == "donor"), None)  # None: deltas only
    fine_tune_ids = [key for key in non_base if roles[key] == "donor_ft"]
    delta_ids = [key for key in non_base if roles[key] == "delta"]  # Δ state dicts, e.g. lora_delta_state_dict
    if shared.get(RUN_PARAMETER) is not None:
        raise GraftError(f"graft parameter {RUN_PARAMETER} is set by graftmerge itself, not by a caller")
    plan = build_plan(
        f"input {first.base.id!r}",
        None if donor_id is None else f"input {donor_id!r}",
        [FineTune(f"input {key!r}", shared["weight"][key]) for key in fine_tune_ids],
        [FineTune(f"input {key!r}", shared["weight"][key]) for key in delta_ids],
        shared,
        schedule=schedule,
    )
    inputs = GraftInputs.from_sources(
        plan,
        source(first.base.id, f"post (input {first.base.id!r})"),
        None if donor_id is None else source(donor_id, f"donor (input {donor_id!r})"),
        [source(key, f"donor_ft (input {key!r})") for key in fine_tune_ids],
        partial=True,
        deltas=[source(key, f"delta (input {key!r})", InMemoryDelta) for key in delta_ids],
    )
    return list(graft_in_memory(inputs, device=first.entries[0].tensor.device, out_dtype=out_dtype))


SCHEDULED = ("lambda", "rho", "weight")  # what PerGroupValues may vary per tensor; everything else is one value


def per_group_schedule(names: list[str], parameters: list[dict[str, Any]], roles: dict) -> Schedule | None:
    """The graft's parameters per tensor when ``merge_state_dicts`` was given PerGroupValues of lambda, rho or
    weight; None when every group has the same ones. Any other parameter must be one value for all tensors."""
    shared = parameters[0]
    for bound in parameters[1:]:
        for key in sorted(set(shared) - set(SCHEDULED)):
            if dict_or_value(bound[key]) != dict_or_value(shared[key]):
                raise GraftError(f"graft parameter {key} must be one value for all tensors (only lambda, rho and "
                                 "weight may differ per tensor)")
    order = list(roles)
    entries = []
    for name, bound in zip(names, parameters):
        per_input = {key: {"role": roles[key], "weight": bound["weight"][key]} for key in order}
        entries.append((name, schedule_binding.scales_from_parameters(bound, per_input, order)))
    if len({scales for _, scales in entries}) <= 1:
        return None
    return Schedule(tuple(entries))


def dict_or_value(value):
    """A per-input mapping as a plain dict (comparable); any other value as it is."""
    return dict(value) if isinstance(value, Mapping) else value


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are one object or one view of the same memory (not merely equal values)."""
    return a is b or (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
                      and a.numel() > 0 and a.data_ptr() == b.data_ptr())


def check_distinct_state_dicts(groups, inputs: list[tuple[Any, str]]) -> None:
    """In memory, the inputs' identity is their tensors': two inputs whose every tensor is the same
    object (or the same memory) are one input given twice, refused as a folder given twice is.

    ``inputs``: (id, role) with the base first. The base again as the donor is the masked update
    (Δ = θft − θpost) and allowed; a donor_ft sharing only some tensors with the donor (a copy of
    its state dict with some weights replaced) is a real fine-tune and allowed too.
    """
    column = {key: index for index, key in enumerate(entry.id for entry in groups[0].entries)}
    for position, (key, role) in enumerate(inputs):
        for other, other_role in inputs[:position]:
            if {role, other_role} == {"base", "donor"}:
                continue
            if all(_same_storage(g.entries[column[key]].tensor, g.entries[column[other]].tensor) for g in groups):
                raise GraftError(
                    f"graft input {key!r} ({role}) and input {other!r} ({other_role}) are the same tensors "
                    "(one state dict given twice); each input is a different model (only the base may be given "
                    "again, as role donor: that masks Δ = θft − θpost)"
                )


graft_merge_method = GraftMergeMethod()


def run_merge(original, merge_config, out_path: str, options, config_source=None, use_threshold_cache=None):
    """mergekit's ``run_merge`` (``original``) for a graft config: validated, opened and pre-passed first
    (:func:`~graftmerge.pipeline.graft.run_graft_merge`), its run findable by mergekit's tasks meanwhile."""
    def run_mergekit(run: MergeRun, config, out, options, config_source=None):
        return _ACTIVE_RUNS.run_merge(original, run, RUN_PARAMETER, config, out, options, config_source)

    return run_graft_merge(run_mergekit, merge_config, out_path, options, config_source, use_threshold_cache)
