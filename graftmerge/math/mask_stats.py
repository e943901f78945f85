"""Several ρ at once, and what a mask takes away. Pure tensor math, no IO.

A sweep or a ``graftmerge plan`` asks the same question for many ρ: which scores
does the global mask remove? The scores do not depend on ρ, so one scoring pass
feeds one exact :class:`ThresholdSearch` per ρ. The tallies below then say, per
tensor, how many directions a mask removes and how much of the Fisher-weighted
update ``Σ s`` they carry.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from graftmerge.math.global_threshold import GlobalThreshold, ThresholdSearch
from graftmerge.math.selection import masked_count

_TOTAL_SPILL = 1 << 26  # kept bit patterns over all searches (256 MB); exact at any value


@dataclass
class MultiThresholdSearch:
    """One :class:`ThresholdSearch` per positive ρ, all fed the same score stream.

    ρ = 0 needs no search (nothing is masked). The spill budget is shared, so
    memory does not grow with the number of ρ; a search that overflows asks for
    its tensors again through :meth:`fine_pass_names` (exactness never depends on it).
    """

    rhos: tuple[float, ...]
    total: int
    searches: dict[float, ThresholdSearch] = field(default_factory=dict)
    _fine_names: dict[float, set[str]] | None = None

    @classmethod
    def create(cls, rhos: Iterable[float], total: int, sharing: int = 1) -> MultiThresholdSearch:
        """A search per positive ρ over ``total`` directions, sharing one spill budget.

        ``sharing``: how many of these run side by side (one per λ of a sweep); they
        split the budget, so memory does not grow with the number of λ either.
        """
        rhos = tuple(rhos)
        positive = [rho for rho in rhos if rho > 0]
        limit = _TOTAL_SPILL // (max(1, len(positive)) * max(1, sharing))
        searches = {
            rho: ThresholdSearch(k=masked_count(rho, total), total=total, spill_limit=limit) for rho in positive
        }
        return cls(rhos=rhos, total=total, searches=searches)

    def add_coarse(self, name: str, scores: torch.Tensor) -> None:
        """Feed one tensor's (or row block's) scores to every search."""
        for search in self.searches.values():
            search.add_coarse(name, scores)

    def fine_pass_names(self) -> list[str]:
        """Tensors some search needs scored again (its kept scores overflowed); usually none."""
        if self._fine_names is None:
            self._fine_names = {rho: set(search.fine_pass_names()) for rho, search in self.searches.items()}
        return sorted(set().union(*self._fine_names.values()))

    def add_fine(self, name: str, scores: torch.Tensor) -> None:
        """Feed a re-scored tensor to the searches that asked for it."""
        self.fine_pass_names()
        for rho, search in self.searches.items():
            if name in self._fine_names[rho]:
                search.add_fine(name, scores)

    def results(self) -> dict[float, GlobalThreshold]:
        """The exact global threshold for every ρ (ρ = 0: threshold +inf, nothing masked)."""
        positives = next(iter(self.searches.values())).positives if self.searches else 0
        results = {rho: search.result() for rho, search in self.searches.items()}
        for rho in self.rhos:
            if rho not in results:
                results[rho] = GlobalThreshold(float("inf"), {}, 0, self.total, positives)
        return results


@dataclass
class MaskTally:
    """How much one mask removes from one tensor: directions and score mass (float64 sums)."""

    masked: int = 0
    masked_score: float = 0.0

    def add(self, scores: torch.Tensor, mask: torch.Tensor) -> None:
        """Count the directions ``mask`` removes and their score mass."""
        self.masked += int(mask.sum())
        self.masked_score += float(scores[mask].sum(dtype=torch.float64))


def score_mass(scores: torch.Tensor) -> float:
    """``Σ s`` of one score tensor, in float64."""
    return float(scores.sum(dtype=torch.float64))


def share(part: float, whole: float) -> float:
    """``part / whole``, 0 for an empty whole (nothing to remove)."""
    return part / whole if whole > 0 else 0.0


def pair_overlap(compact_mask: torch.Tensor, kept_rows: torch.Tensor | None, kept_columns: torch.Tensor | None,
                 full_mask: torch.Tensor) -> tuple[int, int]:
    """(|M_compact ∩ M_full|, |M_full|) in the full basis's pair space.

    ``compact_mask`` is over the kept block (K × K'); its pair (i, j) is the full
    basis's pair ``(kept_rows[i], kept_columns[j])`` (None: a side kept whole, in order).
    """
    rows = torch.arange(full_mask.shape[0]) if kept_rows is None else kept_rows
    columns = torch.arange(full_mask.shape[1]) if kept_columns is None else kept_columns
    mapped = torch.zeros_like(full_mask)
    mapped[rows[:, None], columns[None, :]] = compact_mask
    return int((mapped & full_mask).sum()), int(full_mask.sum())


def block_share(scores: torch.Tensor, kept_rows: Sequence[int] | torch.Tensor | None,
                kept_columns: Sequence[int] | torch.Tensor | None) -> tuple[float, float]:
    """(Σ s over the kept block, Σ s) for full-basis pair scores of one weight."""
    block = scores
    if kept_rows is not None:
        block = block[torch.as_tensor(kept_rows)]
    if kept_columns is not None:
        block = block[:, torch.as_tensor(kept_columns)]
    return score_mass(block), score_mass(scores)
