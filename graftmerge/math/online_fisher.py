"""Online accumulation of retention Fishers, as online EWC sums its penalties (Schwarz et al., 2018).

After step t the Fisher that protects everything learned so far is F̄t = γ·F̄(t−1) + Ft:
Ft is the Fisher of the model the step started from (estimated on prompts of everything it
must keep), γ ∈ [0, 1] the decay (1: a plain sum, every step counts alike; 0: only the newest
Fisher). Only diagonals add up: a sum of Kronecker products is not a Kronecker product.
"""

from __future__ import annotations

import math

import torch


def check_decay(decay: float) -> float:
    """γ as a float; ValueError unless it is a number in [0, 1]."""
    if isinstance(decay, bool) or not isinstance(decay, int | float) or not math.isfinite(decay) \
            or not 0 <= decay <= 1:
        raise ValueError(f"the decay must be a number in [0, 1], got {decay!r}")
    return float(decay)


def accumulate_diagonal(previous: torch.Tensor, current: torch.Tensor, decay: float) -> torch.Tensor:
    """γ·previous + current, summed in float64 and returned in ``current``'s dtype (shapes must agree)."""
    if previous.shape != current.shape:
        raise ValueError(f"diagonals of shapes {tuple(previous.shape)} and {tuple(current.shape)} cannot be added")
    total = previous.to(torch.float64).mul_(check_decay(decay)).add_(current.to(torch.float64))
    return total.to(current.dtype)
