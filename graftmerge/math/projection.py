"""Remove the masked directions from a delta (docs/math.md#the-masks). Pure tensor math.

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
    block = torch.where(_submatrix(mask, rows, columns), _submatrix(scored.rotated, rows, columns), 0)
    left = k.U.index_select(1, rows) if k.U is not None else None
    right = k.V.index_select(1, columns) if k.V is not None else None
    return _subtract_block(delta, rows, columns, block, left, right)


def _submatrix(matrix: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``matrix[rows][:, columns]`` (index_select: a third of advanced indexing's time for columns)."""
    return matrix.index_select(0, rows).index_select(1, columns)


def _subtract_block(
    delta: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, block: torch.Tensor,
    left: torch.Tensor | None, right: torch.Tensor | None,
) -> torch.Tensor:
    """``Δ −= U[:, rows] · block · V[:, columns]ᵀ`` (``left``, ``right`` those columns; None: identity side)."""
    left = left.to(delta.dtype) if left is not None else None
    right = right.to(delta.dtype) if right is not None else None
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


def remove_masked_coordinates(delta: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Diagonal mask given by its flat positions: ``remove_masked``'s zeros, in Δ's own (contiguous) buffer."""
    delta.view(-1).index_fill_(0, positions.to(delta.device), 0)
    return delta


@dataclass(frozen=True)
class CandidatePairs:
    """The KFAC pairs of one weight that the mask may still select, and what removing them needs.

    Kept by the threshold pass (the scores at or above its running bound when the weight
    was scored), so the merge removes the final mask, a subset, without reading the
    factors or rotating Δ again. ``left``/``right`` are the columns ``rows``/``columns``
    of U/V (None: identity side).
    """

    shape: tuple[int, int]
    positions: torch.Tensor  # flat positions in Δ̃, int64, ascending
    values: torch.Tensor  # Δ̃ at them
    rows: torch.Tensor  # rows of Δ̃ holding a candidate, ascending
    columns: torch.Tensor
    left: torch.Tensor | None
    right: torch.Tensor | None


def candidate_pairs(rotated: torch.Tensor, positions: torch.Tensor, factors: KfacFactors) -> CandidatePairs:
    """The pairs of Δ̃ = ``rotated`` at ``positions``, with the eigenvector columns they touch."""
    positions = positions.to(rotated.device)
    width = rotated.shape[1]
    rows = torch.unique(torch.div(positions, width, rounding_mode="floor"))
    columns = torch.unique(positions % width)
    return CandidatePairs(
        shape=tuple(rotated.shape), positions=positions, values=rotated.reshape(-1)[positions], rows=rows,
        columns=columns, left=factors.U.index_select(1, rows) if factors.U is not None else None,
        right=factors.V.index_select(1, columns) if factors.V is not None else None,
    )


def remove_masked_pairs(delta: torch.Tensor, pairs: CandidatePairs, masked: torch.Tensor) -> torch.Tensor:
    """``remove_masked`` for the pairs at flat positions ``masked`` (a subset of ``pairs.positions``), bit for bit."""
    if masked.numel() == 0:
        return delta
    masked = masked.to(pairs.positions.device)
    width = pairs.shape[1]
    mask_rows, mask_columns = torch.div(masked, width, rounding_mode="floor"), masked % width
    rows, columns = torch.unique(mask_rows), torch.unique(mask_columns)
    block = torch.zeros(rows.numel(), columns.numel(), dtype=pairs.values.dtype, device=pairs.values.device)
    block[torch.searchsorted(rows, mask_rows), torch.searchsorted(columns, mask_columns)] = (
        pairs.values[torch.searchsorted(pairs.positions, masked)])
    left = pairs.left.index_select(1, torch.searchsorted(pairs.rows, rows)) if pairs.left is not None else None
    right = pairs.right.index_select(1, torch.searchsorted(pairs.columns, columns)) if pairs.right is not None else None
    return _subtract_block(delta, rows, columns, block, left, right)
