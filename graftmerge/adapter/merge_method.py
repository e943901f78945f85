"""The ``graft`` merge method for mergekit: a thin adapter over :mod:`graftmerge.pipeline.graft`.

Registered by the import hook when mergekit's registry is first imported, so
the stock ``mergekit-yaml`` knows ``merge_method: graft``.

mergekit's registry module is imported at the top, safely in either order: when the
hook imports this module, the registry has already run; when this module is imported
first, its mergekit imports run the registry (the hook then finds ``register_graft``
not yet defined and skips it), and the lines at the bottom register graft.
"""

from __future__ import annotations

import functools
import sys
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

from graftmerge.errors import GraftError, one_line_click_errors
from graftmerge.formats.checkpoint import InMemoryCheckpoint
from graftmerge.hub.models import resolve_model_folder
from graftmerge.pipeline.config_files import check_yaml_documents, read_merge_config
from graftmerge.pipeline.graft import (
    graft_in_memory,
    graft_tensor,
    raise_for_cli,
    run_graft_merge,
    validated_plan,
    was_validated,
)
from graftmerge.pipeline.graft_plan import FineTune, GraftInputs, GraftPlan, positional_roles
from graftmerge.pipeline.lora_inputs import InMemoryDelta

PAPER_URL = "https://arxiv.org/abs/2610.05872"


class GraftMergeMethod(GroupMergeMethod):
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
        """One weight from mergekit's graph: sort the inputs by role, validate the plan, graft."""
        post = group.base.tensor
        donor, donor_folder, fine_tunes, fine_tune_tensors, deltas, delta_tensors = None, None, [], [], [], []
        for entry in group.non_base:
            role = parameters["role"][entry.id]
            folder = resolve_model_folder(entry.id.model.path, entry.id.model.revision)
            lora = entry.id.lora and resolve_model_folder(entry.id.lora.path, entry.id.lora.revision)
            if role == "donor":
                donor = entry.tensor
                donor_folder = folder
            elif role == "donor_ft":
                fine_tunes.append(FineTune(folder, parameters["weight"][entry.id], adapter=lora))
                fine_tune_tensors.append(entry.tensor)
            elif role == "delta":  # a LoRA folder arrives as POST+ADAPTER (graftmerge.pipeline.lora_inputs)
                deltas.append(FineTune(lora or folder, parameters["weight"][entry.id]))
                delta_tensors.append(entry.tensor)
            else:
                raise GraftError(f"model {entry.id} has role {role!r}; roles are donor, donor_ft, delta")
        post_folder = resolve_model_folder(group.base.id.model.path, group.base.id.model.revision)
        if donor is None and fine_tunes:  # base_model listed again as role donor: mergekit folds it into the base
            donor, donor_folder = post, post_folder
        if not (fine_tunes or deltas):
            raise GraftError("graft needs role delta inputs, or one role donor and at least one role donor_ft")
        plan = validated_plan(
            GraftPlan(
                post=post_folder,
                donor=donor_folder,
                fine_tunes=tuple(fine_tunes),
                deltas=tuple(deltas),
                lam=parameters["lambda"],
                rho=parameters["rho"],
                fisher=parameters["fisher"],
                rho_scope=parameters["rho_scope"],
                mask=parameters["mask"],
            )
        )
        if donor_folder == post_folder and not was_validated(plan):
            raise GraftError("graft needs role delta inputs, or one role donor and at least one role donor_ft")
        return graft_tensor(plan, group.metadata.name, post, donor, fine_tune_tensors, delta_tensors)

    def _execute(self, groups, parameters, options, *, input_dtypes, out_dtype=None):
        """Model folders (mergekit's graph) go tensor by tensor; in-memory inputs all at once.

        ``merge_state_dicts`` / ``merge_tensors`` hand over plain ids (ints, names), not
        model references: those inputs are grafted by :func:`graft_state_dict_groups`.
        """
        if all(isinstance(entry.id, ModelReference) for group in groups for entry in group.entries):
            return super()._execute(groups, parameters, options, input_dtypes=input_dtypes, out_dtype=out_dtype)
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
    for bound in parameters[1:]:
        if dict(bound["role"]) != dict(shared["role"]):
            raise GraftError("graft needs one role per input for all tensors (per-tensor roles are not supported)")
    names = [group.metadata.name or f"<tensor {index}>" for index, group in enumerate(groups)]
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
    plan = GraftPlan(
        post=f"input {first.base.id!r}",
        donor=None if donor_id is None else f"input {donor_id!r}",
        fine_tunes=tuple(FineTune(f"input {key!r}", shared["weight"][key]) for key in fine_tune_ids),
        deltas=tuple(FineTune(f"input {key!r}", shared["weight"][key]) for key in delta_ids),
        lam=shared["lambda"],
        rho=shared["rho"],
        fisher=shared["fisher"],
        rho_scope=shared["rho_scope"],
        mask=shared["mask"],
    )
    plan.check()
    inputs = GraftInputs.from_sources(
        plan,
        source(first.base.id, f"post (input {first.base.id!r})"),
        None if donor_id is None else source(donor_id, f"donor (input {donor_id!r})"),
        [source(key, f"donor_ft (input {key!r})") for key in fine_tune_ids],
        partial=True,
        deltas=[source(key, f"delta (input {key!r})", InMemoryDelta) for key in delta_ids],
    )
    return list(graft_in_memory(inputs, device=first.entries[0].tensor.device, out_dtype=out_dtype))


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


def register_graft(registry_module: ModuleType = mergekit_registry) -> None:
    """Register ``graft`` with mergekit; a second call is a no-op.

    The import hook passes the registry module it has just run; the default is the same module.
    """
    if "graft" not in {m.spec.name for m in registry_module.registered_methods()}:
        registry_module.register(graft_merge_method)


def wrap_run_merge(merge_module) -> None:
    """Route graft configs through run_graft_merge; other methods are untouched."""
    original = getattr(merge_module, "run_merge", None)
    if original is None or getattr(original, "_graftmerge_wrapped", False):
        return  # half-imported: the import hook wraps it once mergekit.merge finishes

    def run_merge(merge_config, out_path, options, config_source=None):
        """mergekit's run_merge; graft configs go through run_graft_merge (docstring: the original's)."""
        if merge_config.merge_method != "graft":
            return original(merge_config, out_path, options=options, config_source=config_source)
        return run_graft_merge(original, merge_config, out_path, options, config_source)

    run_merge.__doc__ = original.__doc__
    run_merge._graftmerge_wrapped = True
    merge_module.run_merge = run_merge


def wrap_config_script(script_module) -> None:
    """``mergekit-yaml`` / ``mergekit-multi``: their config file is read by graftmerge's reader first.

    mergekit parses the YAML itself, where a missing file, bad YAML or an integer past
    Python's 4300-digit limit is a traceback; read first, any of them is one ``error:``
    line and exit 2 (for every merge method: mergekit could not have run such a config).
    A config that reads is then run by mergekit's own command, unchanged.
    """
    command = getattr(script_module, "main", None)
    original = getattr(command, "callback", None)
    if original is None or getattr(original, "_graftmerge_wrapped", False):
        return
    check = check_yaml_documents if script_module.__name__.endswith("multimerge") else read_merge_config

    @functools.wraps(original)
    def callback(*args, **kwargs):
        """Read the config with graftmerge's checks, then run mergekit's command (docstring: the original's)."""
        try:
            check(kwargs["config_file"])
        except GraftError as error:
            raise_for_cli(error, verbose=getattr(kwargs.get("merge_options"), "verbosity", 0) > 0)
        return original(*args, **kwargs)

    callback._graftmerge_wrapped = True
    command.callback = callback
    _one_line_usage_errors(command)


def _one_line_usage_errors(command) -> None:
    """click's usage errors of mergekit's command (missing argument, unknown option) as ``error:`` lines too."""
    make_context, invoke = command.make_context, command.invoke

    def checked_make_context(*args, **kwargs):
        """mergekit's command's context; a usage error is one ``error:`` line."""
        with one_line_click_errors():
            return make_context(*args, **kwargs)

    def checked_invoke(context):
        """mergekit's command run; click's own errors in it are one ``error:`` line."""
        with one_line_click_errors():
            return invoke(context)

    command.make_context, command.invoke = checked_make_context, checked_invoke


# Imported directly (not through the hook): register with whatever is loaded.
if "mergekit.merge_methods.registry" in sys.modules:
    register_graft(sys.modules["mergekit.merge_methods.registry"])
if "mergekit.merge" in sys.modules:
    wrap_run_merge(sys.modules["mergekit.merge"])
for _script in ("mergekit.scripts.run_yaml", "mergekit.scripts.multimerge"):
    if _script in sys.modules:
        wrap_config_script(sys.modules[_script])
