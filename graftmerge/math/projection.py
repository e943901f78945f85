"""Remove the masked directions from a delta (SPEC §2). Pure tensor math.

Written as "Δ minus the masked part" so an empty mask returns Δ exactly and a
basis holding only the leading eigenvectors still projects correctly.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from graftmerge.math.kfac import KfacFactors
from graftmerge.math.scores import diagonal_scores, kfac_rotate, kfac_scores

# How often each weight was rotated into its KFAC eigenbasis (Δ̃ = Uᵀ Δ V) in this
# process: the benchmark reports it per weight per merge.
KFAC_ROTATIONS: Counter[tuple[int, ...]] = Counter()  # by weight shape


@dataclass(frozen=True)
class TensorFisher:
    """The Fisher information one tensor is masked with: a diagonal, or KFAC factors."""

    diagonal: torch.Tensor | None = None
    kfac: KfacFactors | None = None

    def to(self, device: torch.device | str) -> TensorFisher:
        """The same Fisher with its tensors on ``device``."""
        if self.kfac is not None:
            k = self.kfac
            move = lambda t: None if t is None else t.to(device)  # noqa: E731
            return TensorFisher(kfac=KfacFactors(move(k.U), move(k.S), move(k.V), move(k.D)))
        return TensorFisher(diagonal=self.diagonal.to(device))


@dataclass(frozen=True)
class ScoredDelta:
    """A delta with its ranking scores (float32) in the basis the mask acts on."""

    delta: torch.Tensor
    scores: torch.Tensor
    rotated: torch.Tensor | None  # Δ̃ for KFAC, None for diagonal


def score_delta(delta: torch.Tensor, fisher: TensorFisher, rotated: torch.Tensor | None = None) -> ScoredDelta:
    """Scores of every direction of ``delta``: coordinates, or KFAC pairs ``u_i v_jᵀ``.

    ``rotated`` is Δ̃ when already known (kept from the threshold pass).
    """
    if fisher.kfac is not None:
        k = fisher.kfac
        if rotated is None:
            rotated = kfac_rotate(delta, k.U, k.V)
            KFAC_ROTATIONS[tuple(delta.shape)] += 1
        scores = kfac_scores(rotated, k.S, k.D).to(torch.float32)
        return ScoredDelta(delta, scores, rotated)
    return ScoredDelta(delta, diagonal_scores(fisher.diagonal, delta).to(torch.float32), None)


def remove_masked(scored: ScoredDelta, mask: torch.Tensor, fisher: TensorFisher) -> torch.Tensor:
    """``Δ' = Δ − (masked part)``: zeroed coordinates, or ``U (1_S ⊙ Δ̃) Vᵀ`` for KFAC.

    Works in Δ's own buffer (the caller hands over ``scored.delta``).
    """
    delta = scored.delta
    if not bool(mask.any()):
        return delta
    if fisher.kfac is None:
        return delta.masked_fill_(mask, 0)
    k = fisher.kfac
    # Only rows/columns of Δ̃ holding a masked pair contribute: restrict the
    # back-rotation to them (exact; at small ρ the masked pairs crowd into the
    # leading eigen-directions, so this is a fraction of the full matmuls).
    rows = torch.nonzero(mask.any(dim=1)).squeeze(1)
    columns = torch.nonzero(mask.any(dim=0)).squeeze(1)
    block = scored.rotated[rows][:, columns] * mask[rows][:, columns]
    left = k.U[:, rows].to(delta.dtype) if k.U is not None else None
    right = k.V[:, columns].to(delta.dtype) if k.V is not None else None
    if left is not None and right is not None:
        return delta.sub_(left @ block @ right.T)
    masked_part = torch.zeros_like(delta)
    if left is None and right is None:
        masked_part[rows[:, None], columns[None, :]] = block
    elif left is None:  # diagonal row side (embedding vocabulary): rows stay rows
        masked_part[rows] = block @ right.T
    else:
        masked_part[:, columns] = left @ block
    return delta.sub_(masked_part)
