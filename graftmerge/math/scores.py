"""Sensitivity scores of a delta under a retention Fisher (docs/math.md#the-masks). Pure tensor math.

Every direction k of Δ gets ``s_k = (Fisher eigenvalue along k) · (Δ along k)²``.
Diagonal: directions are coordinates. KFAC: directions are the pairs ``u_i v_jᵀ``
of the row-side (U, σ) and column-side (V, d) eigenbases, ``Δ̃ = Uᵀ Δ V``.
"""

from __future__ import annotations

import torch


def diagonal_scores(fisher: torch.Tensor, delta: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``s = F ⊙ Δ²`` (same shape as Δ); ``in_place``: in Δ's own buffer (same bits, one allocation fewer)."""
    return torch.square(delta, out=delta if in_place else None).mul_(fisher.to(delta.dtype))


def kfac_rotate(delta: torch.Tensor, U: torch.Tensor | None, V: torch.Tensor | None) -> torch.Tensor:
    """``Δ̃ = Uᵀ Δ V``; a None side is the identity basis."""
    rotated = delta if U is None else U.T.to(delta.dtype) @ delta
    return rotated if V is None else rotated @ V.to(delta.dtype)


def kfac_scores(rotated: torch.Tensor, S: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """``s_ij = σ_i d_j Δ̃_ij²`` for ``rotated = Δ̃`` (d_out × d_in)."""
    return torch.square(rotated).mul_(S.to(rotated.dtype)[:, None]).mul_(D.to(rotated.dtype)[None, :])
