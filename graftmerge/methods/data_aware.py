"""What ``fisher`` and ``regmean`` share as mergekit methods (each has its own module:
:mod:`graftmerge.methods.fisher`, :mod:`graftmerge.methods.regmean`).

mergekit's per-tensor tasks carry only parameters, so each merge's
:class:`~graftmerge.pipeline.data_aware_merge.DataAwareRun` is registered for as long as
mergekit's ``run_merge`` (or ``merge_state_dicts``) runs, under an id put into the
parameters (``data_aware_run``); ``merge_group`` finds its run by that id and nothing else.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from mergekit.common import ModelReference
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
from graftmerge.methods.active_runs import ActiveRuns
from graftmerge.pipeline import data_aware_merge  # as a module: importing it first imports mergekit, then us

RUN_PARAMETER = "data_aware_run"

# The fisher/regmean merges running in this process, by id, each for exactly as long as its
# mergekit call runs (the same arrangement as graft's runs: mergekit's tasks carry only parameters).
_ACTIVE_RUNS: ActiveRuns[data_aware_merge.DataAwareRun] = ActiveRuns("data-aware")


def registered_run(run: data_aware_merge.DataAwareRun) -> contextlib.AbstractContextManager[str]:
    """``run`` findable by the id this yields, until the block ends, however it ends."""
    return _ACTIVE_RUNS.registered(run, kind=run.plan.method)


def find_run(run_id: str | None, method: str) -> data_aware_merge.DataAwareRun:
    """The run registered under ``run_id``; GraftError when there is none."""
    run = _ACTIVE_RUNS.find(run_id)
    if run is None:
        raise GraftError(f"{method} ran a tensor outside a {method} merge: run its configs through mergekit's "
                         "run_merge (mergekit-yaml, graftmerge merge) with graftmerge installed, or merge state "
                         "dicts with merge_state_dicts")
    return run


def _key(input_id):
    """How a run knows an input: a config's model reference by its text, an in-memory id as given."""
    return str(input_id) if isinstance(input_id, ModelReference) else input_id


class DataAwareMergeMethod(TensorGroupMethod, GroupMergeMethod):
    """A data-aware merge of mergekit's inputs (no base), per tensor: ``fisher`` or ``regmean``."""

    def __init__(self, name: str, pretty_name: str, reference_url: str, shared: tuple[ParameterSpec, ...]) -> None:
        self.spec = MergeMethodSpec(
            name=name,
            pretty_name=pretty_name,
            reference_url=reference_url,
            parameters=(
                ParameterSpec("fisher", str | None, ParameterScope.INPUT, default=None),
                ParameterSpec("weight", float, ParameterScope.INPUT, default=1.0),
                *shared,
                ParameterSpec(RUN_PARAMETER, str | None, ParameterScope.SHARED, default=None),
            ),
            contract=InputContract(base=BasePolicy.FORBIDDEN, min_inputs=1),
        )

    def merge_group(self, group: TensorGroup, /, **parameters: Any) -> torch.Tensor:
        """One tensor from mergekit's graph: its run found by id, the inputs put in the run's order."""
        run = find_run(parameters[RUN_PARAMETER], self.spec.name)
        ordered = sorted(group.entries, key=lambda entry: run.index[_key(entry.id)])
        if len(ordered) != len(run.plan.inputs):
            raise GraftError(f"tensor {group.metadata.name!r}: {self.spec.name} was handed {len(ordered)} inputs; "
                             f"its config has {len(run.plan.inputs)}")
        if run.before_tensor is not None:
            run.before_tensor()
        return data_aware_merge.merge_tensor(run, group.metadata.name, [entry.tensor for entry in ordered])

    def merge_in_memory(self, groups, parameters, options, input_dtypes, out_dtype):
        """In-memory inputs (``merge_state_dicts``) get a run made here, then the very same per-tensor kernel."""
        if not groups:
            return ()
        run = _in_memory_run(self.spec.name, groups, parameters, input_dtypes)
        run.out_dtype = out_dtype
        with registered_run(run) as run_id:
            bound = [{**each, RUN_PARAMETER: run_id} for each in parameters]
            return self.merge_groups(groups, bound, options, input_dtypes, out_dtype)


def _in_memory_run(method: str, groups, parameters, input_dtypes) -> data_aware_merge.DataAwareRun:
    """The run of in-memory tensor groups that share their inputs' ids and parameters."""
    ids = [entry.id for entry in groups[0].entries]
    names = [group.metadata.name for group in groups]
    if any(name is None for name in names) or len(set(names)) != len(names):
        raise GraftError(f"{method} needs distinct tensor names for in-memory inputs (they key the Fisher caches)")
    for group, bound in zip(groups[1:], parameters[1:]):
        if [entry.id for entry in group.entries] != ids:
            raise GraftError(f"{method} needs the same inputs for every tensor; {group.metadata.name} has other ids")
        if bound != parameters[0]:
            raise GraftError(f"{method} takes one value per parameter for all tensors (no per-tensor values)")
    shared = {key: value for key, value in parameters[0].items()}
    if shared.pop(RUN_PARAMETER, None) is not None:
        raise GraftError(f"{method} parameter {RUN_PARAMETER} is set by graftmerge itself, not by a caller")
    tensors = {group.metadata.name: [entry.tensor for entry in group.entries] for group in groups}
    dtypes = {name: dtype or group.entries[0].tensor.dtype for name, group, dtype in zip(names, groups, input_dtypes)}
    return data_aware_merge.in_memory_run(method, ids, tensors, dtypes, shared)


def run_merge(original, merge_config, out_path: str, options, config_source=None):
    """mergekit's ``run_merge`` (``original``) for a fisher or regmean config: checked and opened first
    (:func:`~graftmerge.pipeline.data_aware_merge.run_data_aware_merge`), its run findable meanwhile."""
    def run_mergekit(run, config, out, options, config_source=None):
        return _ACTIVE_RUNS.run_merge(original, run, RUN_PARAMETER, config, out, options, config_source,
                                      kind=run.plan.method)

    return data_aware_merge.run_data_aware_merge(run_mergekit, merge_config, out_path, options, config_source,
                                                 run_parameter=RUN_PARAMETER)
