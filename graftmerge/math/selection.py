"""Exact top-k selection of scores: per tensor, or from a global threshold. Pure tensor math.

The mask removes the ``⌈ρ·D⌉`` largest scores. Ties at the threshold are
broken by position: earlier coordinates first (tensors in name order for the
global scope). A score of 0 is never selected; nor is one below float32's
smallest normal number (``SMALLEST_SCORE``), which counts as 0.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

SMALLEST_SCORE = torch.finfo(torch.float32).tiny


def masked_count(rho: float, total: int) -> int:
    """``⌈ρ·D⌉`` with ρ read as the decimal it prints as (0.01 × 300 is 3, not 4)."""
    return math.ceil(Fraction(repr(float(rho))) * total)


def mask_from_threshold(scores: torch.Tensor, threshold: float, tie_quota: int) -> torch.Tensor:
    """Select ``scores > threshold`` plus the first ``tie_quota`` scores equal to it.

    ``threshold <= 0`` selects every positive score (there were fewer than k).
    """
    if threshold < SMALLEST_SCORE:
        return scores >= SMALLEST_SCORE
    mask = scores > threshold
    if tie_quota > 0:
        ties = torch.nonzero((scores == threshold).reshape(-1)).squeeze(1)[:tie_quota]
        mask.view(-1)[ties] = True
    return mask


def top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Exact mask of the ``k`` largest positive scores of one tensor, ties by position."""
    flat = scores.reshape(-1)
    if k <= 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    if k >= flat.numel():
        return scores >= SMALLEST_SCORE
    threshold = torch.kthvalue(flat, flat.numel() - k + 1).values.item()
    if threshold < SMALLEST_SCORE:
        return scores >= SMALLEST_SCORE
    above = int((flat > threshold).sum())
    return mask_from_threshold(scores, threshold, k - above)
