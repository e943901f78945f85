"""The KFAC eigenbases of one weight: the value type the mask math works on. Pure."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KfacFactors:
    """One weight's KFAC eigenbases, in the layout of the stored weight (rows × cols).

    ``F ≈ (V diag(D) Vᵀ) ⊗ (U diag(S) Uᵀ)``: U/S act on dim 0 (rows, the output
    side of a Linear), V/D on dim 1 (columns, the input side). ``U`` or ``V`` is
    None when that side is diagonal (identity eigenbasis), e.g. the one-hot
    vocabulary rows of an embedding.
    """

    U: torch.Tensor | None
    S: torch.Tensor
    V: torch.Tensor | None
    D: torch.Tensor
