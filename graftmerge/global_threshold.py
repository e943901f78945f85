"""Exact global top-k threshold over a stream of score tensors, in bounded memory. Pure.

Positive float32 scores order like their int32 bit patterns, so a radix select
over the bits is exact:

1. ``coarse`` pass: histogram of the top 16 bits (sign, exponent, 7 mantissa
   bits) over every tensor; this finds the bin holding the k-th largest score.
2. ``fine`` pass, only over tensors with scores in that bin: histogram of the
   low 16 bits inside it, per tensor, which pins the exact k-th largest value
   ``t`` and how many scores equal to ``t`` each tensor must give up (ties go
   to earlier tensors in name order, earlier coordinates first).

Memory is two 32K/64K-bin histograms plus, per tensor, its non-empty bins:
it does not grow with the number of coordinates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_COARSE_BINS = 1 << 15  # positive finite float32 bit patterns >> 16 are < 0x7F81
_FINE_BINS = 1 << 16
_CHUNK = 1 << 24  # elements per bincount, bounds temporaries for huge tensors


@dataclass(frozen=True)
class GlobalThreshold:
    """Which scores to mask: ``s > threshold``, plus ``tie_quota[name]`` ties at it.

    ``threshold == 0`` means every positive score is masked (k ≥ positives).
    """

    threshold: float
    tie_quota: dict[str, int]
    k: int
    total: int
    positives: int

    def to_json(self) -> dict:
        return {
            "threshold": self.threshold,
            "tie_quota": self.tie_quota,
            "k": self.k,
            "total": self.total,
            "positives": self.positives,
        }

    @classmethod
    def from_json(cls, data: dict) -> GlobalThreshold:
        return cls(
            threshold=float(data["threshold"]),
            tie_quota={k: int(v) for k, v in data["tie_quota"].items()},
            k=int(data["k"]),
            total=int(data["total"]),
            positives=int(data["positives"]),
        )


def _positive_bits(scores: torch.Tensor):
    """Yield int32 bit patterns of the positive float32 scores, chunk by chunk."""
    flat = scores.reshape(-1)
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start : start + _CHUNK].to(torch.float32)
        positive = chunk[chunk > 0]
        yield positive.view(torch.int32)


@dataclass
class ThresholdSearch:
    """Accumulates histograms over a stream of tensors; see the module docstring.

    Usage: ``add_coarse`` every tensor; if ``needs_fine_pass()``, ``add_fine``
    every tensor in ``fine_pass_names()``; then ``result()``.
    """

    k: int
    total: int
    coarse: torch.Tensor = field(default_factory=lambda: torch.zeros(_COARSE_BINS, dtype=torch.int64))
    _tensor_bins: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _tensor_fine: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _boundary: tuple[int, int] | None = None  # (coarse bin, ties still needed in it)

    def add_coarse(self, name: str, scores: torch.Tensor) -> None:
        counts = torch.zeros(_COARSE_BINS, dtype=torch.int64)
        for bits in _positive_bits(scores):
            counts += torch.bincount((bits >> 16).to(torch.int64), minlength=_COARSE_BINS)
        self.coarse += counts
        bins = torch.nonzero(counts).squeeze(1)
        self._tensor_bins[name] = (bins, counts[bins])

    @property
    def positives(self) -> int:
        return int(self.coarse.sum())

    def needs_fine_pass(self) -> bool:
        return 0 < self.k < self.positives

    def _find_boundary(self) -> tuple[int, int]:
        if self._boundary is None:
            from_top = torch.cumsum(self.coarse.flip(0), 0)
            index_from_top = int(torch.searchsorted(from_top, self.k))  # first cum >= k
            boundary_bin = _COARSE_BINS - 1 - index_from_top
            above = int(from_top[index_from_top - 1]) if index_from_top > 0 else 0
            self._boundary = (boundary_bin, self.k - above)
        return self._boundary

    def fine_pass_names(self) -> list[str]:
        boundary_bin, _ = self._find_boundary()
        return sorted(n for n, (bins, _) in self._tensor_bins.items() if bool((bins == boundary_bin).any()))

    def add_fine(self, name: str, scores: torch.Tensor) -> None:
        boundary_bin, _ = self._find_boundary()
        counts = torch.zeros(_FINE_BINS, dtype=torch.int64)
        for bits in _positive_bits(scores):
            inside = bits[(bits >> 16) == boundary_bin]
            counts += torch.bincount((inside & 0xFFFF).to(torch.int64), minlength=_FINE_BINS)
        low = torch.nonzero(counts).squeeze(1)
        self._tensor_fine[name] = (low, counts[low])

    def result(self) -> GlobalThreshold:
        if not self.needs_fine_pass():
            # k == 0 masks nothing (threshold = +inf); k >= positives masks every positive.
            threshold = float("inf") if self.k == 0 else 0.0
            return GlobalThreshold(threshold, {}, self.k, self.total, self.positives)
        boundary_bin, needed = self._find_boundary()
        fine = torch.zeros(_FINE_BINS, dtype=torch.int64)
        for low, counts in self._tensor_fine.values():
            fine[low] += counts
        from_top = torch.cumsum(fine.flip(0), 0)
        index_from_top = int(torch.searchsorted(from_top, needed))
        low_bits = _FINE_BINS - 1 - index_from_top
        above_in_bin = int(from_top[index_from_top - 1]) if index_from_top > 0 else 0
        ties_needed = needed - above_in_bin
        bits = torch.tensor([(boundary_bin << 16) | low_bits], dtype=torch.int32)
        threshold = float(bits.view(torch.float32).item())
        tie_quota: dict[str, int] = {}
        for name in sorted(self._tensor_fine):
            if ties_needed == 0:
                break
            low, counts = self._tensor_fine[name]
            at_threshold = counts[low == low_bits]
            if at_threshold.numel():
                take = min(int(at_threshold[0]), ties_needed)
                tie_quota[name] = take
                ties_needed -= take
        return GlobalThreshold(threshold, tie_quota, self.k, self.total, self.positives)
