"""``merge_method: fisher`` for mergekit: Σ_i w_i F_i ⊙ θ_i / Σ_i w_i F_i per tensor (Matena & Raffel)."""

from __future__ import annotations

from mergekit.merge_methods.base import ParameterScope, ParameterSpec

from graftmerge.methods.data_aware import DataAwareMergeMethod
from graftmerge.pipeline.data_aware_plan import DEFAULT_EPSILON

fisher_merge_method = DataAwareMergeMethod(
    "fisher", "Fisher merging", "https://arxiv.org/abs/2111.09832",
    (ParameterSpec("epsilon", float, ParameterScope.SHARED, default=DEFAULT_EPSILON),),
)
