"""``merge_method: regmean`` for mergekit: (Σ_i w_i G̃_i)⁻¹ Σ_i w_i G̃_i W_i per linear weight (Jin et al.)."""

from __future__ import annotations

from mergekit.merge_methods.base import ParameterScope, ParameterSpec

from graftmerge.methods.data_aware import DataAwareMergeMethod
from graftmerge.pipeline.data_aware_plan import DEFAULT_ALPHA

regmean_merge_method = DataAwareMergeMethod(
    "regmean", "RegMean", "https://arxiv.org/abs/2212.09849",
    (ParameterSpec("alpha", float, ParameterScope.SHARED, default=DEFAULT_ALPHA),
     ParameterSpec("regmean_fallback", str, ParameterScope.SHARED, default="error"),
     ParameterSpec("model_config", str | None, ParameterScope.SHARED, default=None)),
)
