"""A graft config's schedules resolved per tensor by mergekit's own planner, before any tensor is read.

mergekit resolves a gradient list or a ``filter:`` when it plans each tensor's merge (the
layer's position ``t``, the tensor's name), and hands the kernel the result. A global mask
needs every tensor's scaled Δ before the merge starts, so the graft asks the same planner
for the same values first: :func:`bind_schedule` plans the merge (no tensor is loaded),
reads each planned task's parameters and puts them into the plan. The kernel then checks
that mergekit hands it those very values (:func:`check_handed`).

Modules that the import hook loads while mergekit's merge methods are importing import this
module as a module (``from graftmerge.pipeline import schedule_binding``), never its names:
it may itself be the module whose import started that chain.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Mapping

# A module, not its names: this module may be imported while mergekit's merge methods are still importing
# (the import hook registers graft from inside them), so MergePlanner is looked up when a schedule is bound.
import mergekit.plan as mergekit_plan
from mergekit import merge_methods
from mergekit.architecture import get_architecture_info
from mergekit.config import ConfigReader
from mergekit.io.tasks import LoaderCache
from mergekit.parameter_resolver import resolve_parameters

from graftmerge.errors import GraftError
from graftmerge.pipeline.graft_plan import GraftPlan
from graftmerge.pipeline.schedules import Schedule, TensorScales, check_setting, filter_matches, is_schedule

GRAFT = "graft"
PLANNING_ONLY = "graftmerge-schedule-planning"  # the out path of a plan that is never executed


def scales_from_parameters(shared: Mapping, per_input: Mapping, order) -> TensorScales:
    """One tensor's TensorScales from mergekit's resolved parameters: ``shared`` (lambda, rho), and per input
    (``order``: the inputs in config order) its role and weight; the base's own entry has none."""
    weights, delta_weights = [], []
    for key in order:
        bound = per_input.get(key) or {}
        role = bound.get("role")
        if role == "donor_ft":
            weights.append(float(bound["weight"]))
        elif role == "delta":
            delta_weights.append(float(bound["weight"]))
    return TensorScales(float(shared["lambda"]), tuple(weights), tuple(delta_weights), float(shared["rho"]))


def bind_schedule(plan: GraftPlan, config, options, names=(), warn: bool = True) -> GraftPlan:
    """``plan`` with every tensor's scales as mergekit resolves them for ``config`` (the config mergekit runs:
    LoRA inputs in their mergekit view); ``plan`` itself when nothing is scheduled.

    ``names``: tensors of the inputs that mergekit plans no merge for (resolved as mergekit resolves a
    tensor outside the layers, at t = 0). A ``filter:`` that matches no tensor is warned about (``warn``).
    """
    if not plan.scheduled:
        return plan
    spec = merge_methods.get(GRAFT).spec  # registered: mergekit's planner needs it too
    LoaderCache().setup(options=options)
    arch_info = get_architecture_info(config, options)
    # mergekit's output config of a `models:` merge (no slices): the base model's own
    out_config = config.base_model.config(trust_remote_code=options.trust_remote_code)
    planner = mergekit_plan.MergePlanner(copy.deepcopy(config), arch_info, options=options, out_model_config=out_config)
    entries: dict[str, TensorScales] = {}
    # planning only: the tasks are read, never run (nothing is loaded or written)
    for save in planner.plan_to_disk(out_path=PLANNING_ONLY):
        task = getattr(save, "tensor_task", None)
        if task is None:
            continue  # the writer's finalize and tokenizer tasks
        per_input = {ref: dict(bound) for ref, bound in task.input_parameters.items()}
        entries[save.tensor_name] = scales_from_parameters(dict(task.parameters), per_input, task.model_order)
    for name in sorted(set(names) - set(entries)):
        entries[name] = _resolve_outside_layers(spec, config, name)
    if warn:
        warn_unmatched_filters(config, entries)
    bound = dataclasses.replace(plan, schedule=Schedule(tuple(sorted(entries.items()))))
    bound.check()
    return bound


def _resolve_outside_layers(spec, config, name: str) -> TensorScales:
    """The scales mergekit gives a tensor planned outside the layers (t = 0), for a tensor it does not plan."""
    reader = ConfigReader(config=config, t=0)
    order = [entry.model for entry in config.models]
    shared, per_input = resolve_parameters(spec, tensor_name=name, inputs={ref: name for ref in order},
                                           sources=reader.parameter_sources, base_model=config.base_model, t=0)
    return scales_from_parameters(shared, per_input, order)


def warn_unmatched_filters(config, entries: Mapping[str, TensorScales]) -> list[str]:
    """One ``warning:`` line on stderr per ``filter:`` of lambda, rho or a weight that matches no tensor; the
    lines."""
    settings = [(name, (config.parameters or {}).get(name)) for name in ("lambda", "rho")]
    settings += [(f"weight of {entry.model}", (entry.parameters or {}).get("weight")) for entry in config.models]
    lines = []
    for label, setting in settings:
        if setting is None or not is_schedule(setting):
            continue
        for pattern in check_setting(setting, label):
            if not filter_matches(pattern, entries):
                lines.append(f"warning: graft parameter {label}: filter {pattern!r} matches no tensor of the "
                             "model; that condition is never used")
    for line in lines:
        print(line, file=sys.stderr)
    return lines


def check_handed(bound: TensorScales | None, name: str, shared: Mapping, per_input: Mapping, order) -> None:
    """The parameters mergekit hands the kernel for ``name`` are ``bound``, those a scheduled plan was bound with
    (None: not scheduled); GraftError else."""
    if bound is None:
        return
    handed = scales_from_parameters(shared, per_input, order)
    if handed != bound:
        raise GraftError(f"tensor {name!r}: mergekit resolved the graft's schedule to {handed}, but the plan "
                         f"(and its threshold pass) used {bound}; this is a bug, please report it")

