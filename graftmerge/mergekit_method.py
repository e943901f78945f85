"""The ``graft`` merge method for mergekit: a thin adapter over :mod:`graftmerge.graft`.

Registered by the import hook when mergekit's registry is first imported, so
the stock ``mergekit-yaml`` knows ``merge_method: graft``.
"""

from __future__ import annotations

import sys
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

from graftmerge.errors import GraftError
from graftmerge.graft import graft_tensor, run_graft_merge, validated_plan
from graftmerge.graft_plan import FineTune, GraftPlan, resolve_model_folder

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
            contract=InputContract(base=BasePolicy.REQUIRED, min_non_base=2),
        )

    def merge_group(self, group: TensorGroup, /, **parameters: Any) -> torch.Tensor:
        post = group.base.tensor
        donor, fine_tunes, fine_tune_tensors = None, [], []
        for entry in group.non_base:
            role = parameters["role"][entry.id]
            folder = resolve_model_folder(entry.id.model.path, entry.id.model.revision)
            if role == "donor":
                donor = entry.tensor
                donor_folder = folder
            elif role == "donor_ft":
                fine_tunes.append(FineTune(folder, parameters["weight"][entry.id]))
                fine_tune_tensors.append(entry.tensor)
            else:
                raise GraftError(f"model {entry.id} has role {role!r}; roles are donor, donor_ft")
        if donor is None or not fine_tunes:
            raise GraftError("graft needs one model with role donor and at least one with role donor_ft")
        plan = validated_plan(
            GraftPlan(
                post=resolve_model_folder(group.base.id.model.path, group.base.id.model.revision),
                donor=donor_folder,
                fine_tunes=tuple(fine_tunes),
                lam=parameters["lambda"],
                rho=parameters["rho"],
                fisher=parameters["fisher"],
                rho_scope=parameters["rho_scope"],
                mask=parameters["mask"],
            )
        )
        return graft_tensor(plan, group.metadata.name, post, donor, fine_tune_tensors)


graft_merge_method = GraftMergeMethod()


def register_graft(registry_module=None) -> None:
    """Register ``graft`` with mergekit; a second call is a no-op."""
    if registry_module is None:
        from mergekit.merge_methods import registry as registry_module
    if "graft" not in {m.spec.name for m in registry_module.registered_methods()}:
        registry_module.register(graft_merge_method)


def wrap_run_merge(merge_module) -> None:
    """Route graft configs through run_graft_merge; other methods are untouched."""
    original = getattr(merge_module, "run_merge", None)
    if original is None or getattr(original, "_graftmerge_wrapped", False):
        return  # half-imported: the import hook wraps it once mergekit.merge finishes

    def run_merge(merge_config, out_path, options, config_source=None):
        if merge_config.merge_method != "graft":
            return original(merge_config, out_path, options=options, config_source=config_source)
        return run_graft_merge(original, merge_config, out_path, options, config_source)

    run_merge.__doc__ = original.__doc__
    run_merge._graftmerge_wrapped = True
    merge_module.run_merge = run_merge


# Imported directly (not through the hook): register with whatever is loaded.
if "mergekit.merge_methods.registry" in sys.modules:
    register_graft(sys.modules["mergekit.merge_methods.registry"])
if "mergekit.merge" in sys.modules:
    wrap_run_merge(sys.modules["mergekit.merge"])
