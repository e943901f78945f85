"""The graft delta Δ = Σ_i λ_i (θft_i − θdonor) + Σ_j λ_j δ_j, computed one tensor at a time.

``δ_j`` are precomputed deltas (``role: delta`` inputs, written by
``graftmerge delta extract``). Fine-tune terms come first, then delta terms, each
in config order, and every term is formed with the same operations: a delta
extracted in float32 with weight 1 therefore reproduces the fine-tune's term bit
for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def compute_dtype(working: torch.dtype) -> torch.dtype:
    """Arithmetic precision for a working dtype: float32, or float64 when inputs are float64."""
    return torch.float64 if working == torch.float64 else torch.float32


def donor_delta(
    donor: torch.Tensor | None,
    fine_tunes: Sequence[torch.Tensor],
    lambdas: Sequence[float],
    deltas: Sequence[torch.Tensor] = (),
    delta_lambdas: Sequence[float] = (),
) -> torch.Tensor:
    """Σ λ_i (ft_i − donor) + Σ λ_j δ_j in float32 (float64 when the donor or a δ is float64).

    The threshold pre-pass and the merge kernel both call this, so the two
    compute bit-identical deltas and therefore bit-identical scores. ``donor``
    may be None only when there are no fine-tunes.
    """
    if fine_tunes and donor is None:
        raise ValueError("fine-tune terms need the donor tensor")
    sources = ([donor] if donor is not None else []) + list(deltas)
    if not sources:
        raise ValueError("Δ needs at least one fine-tune or precomputed delta")
    dtype = compute_dtype(torch.float64 if any(t.dtype == torch.float64 for t in sources) else sources[0].dtype)
    donor = donor.to(dtype) if fine_tunes else None
    terms = [(fine_tune.to(dtype), lam, True) for fine_tune, lam in zip(fine_tunes, lambdas, strict=True)]
    terms += [(delta.to(dtype), lam, False) for delta, lam in zip(deltas, delta_lambdas, strict=True)]
    result = None
    for tensor, lam, minus_donor in terms:
        difference = torch.sub(tensor, donor) if minus_donor else tensor
        if result is None:
            result = torch.mul(difference, lam) if difference is tensor else difference.mul_(lam)
        else:
            result.add_(difference, alpha=lam)
    return result
