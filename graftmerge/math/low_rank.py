"""Low-rank deltas: the KFAC rotation of one without forming it densely, and a truncated SVD. Pure tensor math.

For ``Δ = c · L R`` (L: d_out × r, R: r × d_in; a LoRA's B and A, or Aᵀ and Bᵀ for a
transposed layer) the rotation into the KFAC eigenbases is

    Δ̃ = Uᵀ Δ V = c · (Uᵀ L)(R V)

which costs ``2r(d_out² + d_in² + d_out·d_in)`` flops instead of the dense
``2·d_out·d_in·(d_out + d_in)``: about ``(d_out + d_in) / (3r)`` times less for square
weights (≈ 43× for d = 2048, r = 16). It equals the dense rotation up to float
rounding (not bit for bit), so a graft uses one form or the other for a given weight,
never both.

:func:`truncated_svd` goes the other way (``graftmerge delta extract --rank``): a dense Δ
to the factors of its best rank-k approximation, with the share of Δ they keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def low_rank_rotate(
    left: torch.Tensor, right: torch.Tensor, scale: float, U: torch.Tensor | None, V: torch.Tensor | None
) -> torch.Tensor:
    """``Δ̃ = Uᵀ (scale · left @ right) V`` as ``scale · (Uᵀ left)(right V)``; a None side is the identity."""
    rotated_left = left if U is None else U.T.to(left.dtype) @ left
    rotated_right = right if V is None else right @ V.to(right.dtype)
    return (rotated_left @ rotated_right).mul_(scale)


@dataclass(frozen=True)
class TruncatedSvd:
    """``Δ_k = left @ right``, the best rank-k approximation of Δ, and how much of Δ it keeps.

    ``left = U_k·√S_k`` (m × k), ``right = √S_k·V_kᵀ`` (k × n): the singular values split
    evenly, so neither factor dwarfs the other (a LoRA's B and A, ready to train on).
    Sizes are squared Frobenius norms, ``‖Δ‖²_F = Σ σ_i²`` and ``‖Δ_k‖²_F = Σ_{i≤k} σ_i²``
    (float64 sums of the singular values): they add up over tensors, and by Eckart–Young
    ``‖Δ − Δ_k‖²_F = ‖Δ‖²_F − ‖Δ_k‖²_F``.
    """

    left: torch.Tensor
    right: torch.Tensor
    norm_sq: float  # ‖Δ‖²_F
    kept_norm_sq: float  # ‖Δ_k‖²_F

    @property
    def kept_share(self) -> float:
        """``‖Δ_k‖²_F / ‖Δ‖²_F`` (1 for Δ = 0): the share of the squared Frobenius norm kept."""
        return self.kept_norm_sq / self.norm_sq if self.norm_sq > 0 else 1.0


def truncated_svd(matrix: torch.Tensor, rank: int) -> TruncatedSvd:
    """The rank-``min(rank, m, n)`` truncated SVD of a 2-D ``matrix``, in its own dtype; exact at full rank.

    At ``k = min(m, n)`` the kept share is exactly 1 (the same singular values are summed).
    """
    if matrix.dim() != 2 or rank <= 0:
        raise ValueError(f"truncated_svd needs a matrix and a positive rank, got {tuple(matrix.shape)}, {rank}")
    U, S, Vh = torch.linalg.svd(matrix, full_matrices=False)
    k = min(rank, S.numel())
    root = S[:k].sqrt()
    squares = S.to(torch.float64).square()
    return TruncatedSvd(
        left=(U[:, :k] * root).contiguous(),
        right=(root[:, None] * Vh[:k]).contiguous(),
        norm_sq=float(squares.sum()),
        kept_norm_sq=float(squares[:k].sum()) if k < S.numel() else float(squares.sum()),
    )
