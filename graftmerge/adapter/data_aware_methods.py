"""The ``fisher`` and ``regmean`` merge methods for mergekit: thin adapters over
:mod:`graftmerge.pipeline.data_aware_merge`, registered and wired exactly as ``graft`` is
(:mod:`graftmerge.adapter.merge_method`).

mergekit's per-tensor tasks carry only parameters, so each merge's
:class:`~graftmerge.pipeline.data_aware_merge.DataAwareRun` is registered for as long as
mergekit's ``run_merge`` (or ``merge_state_dicts``) runs, under an id put into the
parameters (``data_aware_run``); ``merge_group`` finds its run by that id and nothing else.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from mergekit.common import ModelReference
from mergekit.merge_methods import registry as mergekit_registry
from mergekit.merge_methods.base import (
    BasePolicy,
    GroupMergeMethod,
    InputContract,
    MergeMethodSpec,
    ParameterScope,
    ParameterSpec,
    TensorGroup,
)

from graftmerge.adapter.active_runs import ActiveRuns
from graftmerge.errors import GraftError
from graftmerge.pipeline import data_aware_merge  # as a module: importing it first imports mergekit, then us
from graftmerge.pipeline.data_aware_plan import DEFAULT_ALPHA, DEFAULT_EPSILON, METHODS

RUN_PARAMETER = "data_aware_run"
REFERENCES = {"fisher": "https://arxiv.org/abs/2111.09832", "regmean": "https://arxiv.org/abs/2212.09849"}

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


class DataAwareMergeMethod(GroupMergeMethod):
    """Σ_i w_i F_i ⊙ θ_i / Σ_i w_i F_i (``fisher``) or (Σ_i w_i G̃_i)⁻¹ Σ_i w_i G̃_i W_i (``regmean``), per tensor."""

    def __init__(self, method: str) -> None:
        shared = ((ParameterSpec("epsilon", float, ParameterScope.SHARED, default=DEFAULT_EPSILON),)
                  if method == "fisher" else
                  (ParameterSpec("alpha", float, ParameterScope.SHARED, default=DEFAULT_ALPHA),
                   ParameterSpec("regmean_fallback", str, ParameterScope.SHARED, default="error"),
                   ParameterSpec("model_config", str | None, ParameterScope.SHARED, default=None)))
        self.spec = MergeMethodSpec(
            name=method,
            pretty_name="Fisher merging" if method == "fisher" else "RegMean",
            reference_url=REFERENCES[method],
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
        return data_aware_merge.merge_tensor(run, group.metadata.name, [entry.tensor for entry in ordered])

    def _execute(self, groups, parameters, options, *, input_dtypes, out_dtype=None):
        """Model folders (mergekit's graph) run with the run their merge registered; in-memory inputs
        (``merge_state_dicts``) get a run made here, then the very same per-tensor kernel."""
        if all(isinstance(entry.id, ModelReference) for group in groups for entry in group.entries):
            return super()._execute(groups, parameters, options, input_dtypes=input_dtypes, out_dtype=out_dtype)
        if not groups:
            return ()
        run = _in_memory_run(self.spec.name, groups, parameters, input_dtypes)
        run.out_dtype = out_dtype
        with registered_run(run) as run_id:
            bound = [{**each, RUN_PARAMETER: run_id} for each in parameters]
            return super()._execute(groups, bound, options, input_dtypes=input_dtypes, out_dtype=out_dtype)


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


data_aware_methods = {method: DataAwareMergeMethod(method) for method in METHODS}


def register_data_aware(registry_module: ModuleType = mergekit_registry) -> None:
    """Register ``fisher`` and ``regmean`` with mergekit; a second call is a no-op."""
    known = {m.spec.name for m in registry_module.registered_methods()}
    for name, method in data_aware_methods.items():
        if name not in known:
            registry_module.register(method)


def run_mergekit(original: Callable, run: data_aware_merge.DataAwareRun, config, out_path: str, options,
                 config_source=None):
    """mergekit's own ``run_merge`` on ``config`` for ``run``, findable by its tasks meanwhile."""
    return _ACTIVE_RUNS.run_merge(original, run, RUN_PARAMETER, config, out_path, options, config_source,
                                  kind=run.plan.method)


def wrap_run_merge(merge_module) -> None:
    """Route fisher and regmean configs through run_data_aware_merge; other methods are untouched."""
    original = getattr(merge_module, "run_merge", None)
    if original is None or getattr(merge_module, "_graftmerge_data_aware", False):
        return  # half-imported (the hook wraps it once mergekit.merge finishes), or wrapped already

    def run_merge(merge_config, out_path, options, config_source=None):
        """mergekit's run_merge; fisher and regmean configs checked first (docstring: the original's)."""
        if merge_config.merge_method not in METHODS:
            return original(merge_config, out_path, options=options, config_source=config_source)
        return data_aware_merge.run_data_aware_merge(functools.partial(run_mergekit, original), merge_config,
                                                     out_path, options, config_source, run_parameter=RUN_PARAMETER)

    run_merge.__doc__ = original.__doc__
    run_merge._graftmerge_wrapped = getattr(original, "_graftmerge_wrapped", False)  # graft's own mark, kept
    merge_module.run_merge = run_merge
    merge_module._graftmerge_data_aware = True  # on the module: graft may wrap this wrapper in turn


# Imported directly (not through the hook): register with whatever is loaded.
if "mergekit.merge_methods.registry" in sys.modules:
    register_data_aware(sys.modules["mergekit.merge_methods.registry"])
if "mergekit.merge" in sys.modules:
    wrap_run_merge(sys.modules["mergekit.merge"])
