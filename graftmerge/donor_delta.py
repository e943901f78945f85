"""The graft delta Δ = Σ_i λ_i (θft_i − θdonor), computed one tensor at a time."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def compute_dtype(working: torch.dtype) -> torch.dtype:
    """Arithmetic precision for a working dtype: float32, or float64 when inputs are float64."""
    return torch.float64 if working == torch.float64 else torch.float32


def donor_delta(
    donor: torch.Tensor, fine_tunes: Sequence[torch.Tensor], lambdas: Sequence[float]
) -> torch.Tensor:
    """Σ λ_i (ft_i − donor) in float32 (float64 for float64 inputs).

    The threshold pre-pass and the merge kernel both call this, so the two
    compute bit-identical deltas and therefore bit-identical scores.
    """
    dtype = compute_dtype(donor.dtype)
    donor = donor.to(dtype)
    delta = None
    for fine_tune, lam in zip(fine_tunes, lambdas, strict=True):
        if delta is None:
            delta = torch.sub(fine_tune.to(dtype), donor).mul_(lam)
        else:
            delta.add_(fine_tune.to(dtype) - donor, alpha=lam)
    return delta
