"""Finite values, checked cheaply where a graft computes them, and a bound for LoRA products. Pure tensors.

:func:`fits` is the graft's one test per computed tensor: one reduction (the minimum and
the maximum together) and no temporary tensor, a fraction of the cost of
``torch.isfinite(t).all()``. NaN propagates through both, ±Inf is an extreme, and casting
the two extremes to a narrower dtype says whether every value survives that cast
(rounding is monotone: what the extremes survive, everything between them survives).

:func:`product_bound` bounds, without forming it, every value a graft computes in float32
from a low-rank ``Δ = s · L @ R``: the product, its rotation ``UᵀΔV`` into orthonormal
eigenbases, and ``(UᵀL)(RV)`` before it is scaled (a LoRA pulled from the Hub is refused
when its bound is not far below float32's largest value).
"""

from __future__ import annotations

import math

import torch

FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def fits(tensor: torch.Tensor, *dtypes: torch.dtype | None) -> bool:
    """Every value of ``tensor`` finite, and finite again cast to each of ``dtypes`` (None: skipped).

    Non-floating and empty tensors fit.
    """
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    extremes = torch.stack([low, high])
    return all(bool(torch.isfinite(extremes.to(dtype)).all()) for dtype in (tensor.dtype, *dtypes) if dtype)


def all_finite(tensor: torch.Tensor) -> bool:
    """Every value finite: :func:`fits` with no cast."""
    return fits(tensor)


def largest_magnitude(tensor: torch.Tensor) -> float:
    """``max |x|`` as a Python float (NaN when any value is NaN; 0 for an empty tensor)."""
    if tensor.numel() == 0:
        return 0.0
    low, high = torch.aminmax(tensor.detach())
    if bool(torch.isnan(low)) or bool(torch.isnan(high)):
        return math.nan
    return max(abs(float(low)), abs(float(high)))


def frobenius_norm(tensor: torch.Tensor) -> float:
    """``‖tensor‖_F`` in float64, without overflow for any finite float32 values (inf for larger ones).

    Values beyond float32's range give inf, since a graft computes with them in float32.
    """
    largest = largest_magnitude(tensor)
    if not largest <= FLOAT32_MAX:
        return math.inf
    if largest == 0:
        return 0.0
    return float(torch.linalg.vector_norm(tensor.detach().to(torch.float64) / largest)) * largest


def product_bound(left: torch.Tensor, right: torch.Tensor, scale: float) -> float:
    """An upper bound on ``|x|`` for every x a graft forms from ``Δ = scale · left @ right`` in float32.

    ``max(1, |scale|) · ‖left‖_F · ‖right‖_F``: each entry of ``left @ right`` (and each partial
    sum of it) is at most ``‖left‖_F‖right‖_F`` by Cauchy–Schwarz; with orthonormal U, V,
    ``|(UᵀΔV)_ij| ≤ ‖Δ‖_F ≤ |scale| · ‖left‖_F · ‖right‖_F``, and ``(UᵀL)(RV)`` (the
    rotation before it is scaled) is bounded like ``left @ right``. inf when a factor has
    values beyond float32's range.
    """
    norms = frobenius_norm(left) * frobenius_norm(right)
    return max(1.0, abs(scale)) * norms if norms else 0.0
