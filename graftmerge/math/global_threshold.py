"""Exact global top-k threshold over a stream of score tensors, in bounded memory. Pure.

Positive float32 scores order like their int32 bit patterns, so a radix select
over the bits is exact:

1. ``coarse`` pass: histogram of the top 16 bits (sign, exponent, 7 mantissa
   bits) over every tensor; this finds the bin holding the k-th largest score.
2. ``fine`` step, only over scores in that bin: histogram of the low 16 bits
   inside it, per tensor, which pins the exact k-th largest value ``t`` and
   how many scores equal to ``t`` each tensor must give up (ties go to earlier
   tensors in name order, earlier coordinates first). Its input is kept from
   step 1 (see ``ThresholdSearch``), so tensors are normally scored once.

Memory is two 32K/64K-bin histograms, per tensor its non-empty bins, and the
kept bit patterns, capped by ``spill_limit``: past the cap, the overflowing
tensors are scored a second time instead. Scores below float32's smallest
normal number count as zero (never masked), so bins of exponent 0 are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_COARSE_BINS = 1 << 15  # non-negative float32 bit patterns >> 16 are < 0x8000
_FINE_BINS = 1 << 16
_FIRST_NORMAL_BIN = 0x0080  # bits of the smallest normal float32 (0x00800000) >> 16
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
        """The threshold as JSON-ready values (``from_json`` reads them back)."""
        return {
            "threshold": self.threshold,
            "tie_quota": self.tie_quota,
            "k": self.k,
            "total": self.total,
            "positives": self.positives,
        }

    @classmethod
    def from_json(cls, data: dict) -> GlobalThreshold:
        """The threshold ``to_json`` wrote, with its numbers' types restored."""
        return cls(
            threshold=float(data["threshold"]),
            tie_quota={k: int(v) for k, v in data["tie_quota"].items()},
            k=int(data["k"]),
            total=int(data["total"]),
            positives=int(data["positives"]),
        )


def _bit_chunks(scores: torch.Tensor):
    """Int32 views of the (non-negative, float32) scores' bit patterns, chunk by chunk."""
    if scores.dtype != torch.float32:
        scores = scores.to(torch.float32)
    flat = scores.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    bits = flat.view(torch.int32)
    for start in range(0, bits.numel(), _CHUNK):
        yield bits[start : start + _CHUNK]


def _bin_of_kth_largest(histogram: torch.Tensor, k: int) -> tuple[int, int]:
    """(bin holding the k-th largest entry, number of entries in the bins above it)."""
    from_top = torch.cumsum(histogram.flip(0), 0)
    index_from_top = int(torch.searchsorted(from_top, k))  # first cumulative count >= k
    above = int(from_top[index_from_top - 1]) if index_from_top > 0 else 0
    return histogram.numel() - 1 - index_from_top, above


@dataclass
class ThresholdSearch:
    """Accumulates histograms over a stream of tensors; see the module docstring.

    Usage: ``add_coarse`` every tensor (or each row block of it); then
    ``add_fine`` every tensor in ``fine_pass_names()`` (usually none); then
    ``result()``.

    The fine pass is usually answered from memory: while streaming, the k-th
    largest score seen so far only grows, so its bin is a lower bound on the
    final boundary bin, and only scores at or above it can matter. Those bit
    patterns are kept (and pruned as the bound rises) up to ``spill_limit``
    elements; tensors whose scores did not fit are re-scored by the caller.
    """

    k: int
    total: int
    spill_limit: int = 1 << 26  # int32 bit patterns kept in memory (256 MB)
    coarse: torch.Tensor = field(default_factory=lambda: torch.zeros(_COARSE_BINS, dtype=torch.int64))
    _tensor_bins: dict[str, torch.Tensor] = field(default_factory=dict)  # non-empty coarse bins
    _spills: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    _spilled: int = 0
    _spilled_after_prune: int = 0
    _unspilled: set[str] = field(default_factory=set)
    _tensor_fine: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _boundary: tuple[int, int] | None = None  # (coarse bin, ties still needed in it)

    def add_coarse(self, name: str, scores: torch.Tensor) -> None:
        """Histogram one tensor's (or row block's) scores; keep the bit patterns that may matter later."""
        seen = set()
        for bits in _bit_chunks(scores):
            bins = bits >> 16
            counts = torch.bincount(bins, minlength=_COARSE_BINS).cpu()
            counts[:_FIRST_NORMAL_BIN] = 0  # zeros and subnormal scores are never masked
            self.coarse += counts
            seen.update(torch.nonzero(counts).squeeze(1).tolist())
            self._spill(name, bits[bins >= self._running_bound()].cpu())
        known = set(self._tensor_bins[name].tolist()) if name in self._tensor_bins else set()
        self._tensor_bins[name] = torch.tensor(sorted(seen | known), dtype=torch.int64)
        self._prune()

    def _running_bound(self) -> int:
        """Bin of the k-th largest score so far: the final boundary bin is never below it."""
        if self.k == 0 or self.positives < self.k:
            return _FIRST_NORMAL_BIN
        return _bin_of_kth_largest(self.coarse, self.k)[0]

    def _spill(self, name: str, bits: torch.Tensor) -> None:
        if name in self._unspilled:
            return
        if self._spilled + bits.numel() > self.spill_limit:
            self._spilled -= sum(t.numel() for t in self._spills.pop(name, []))
            self._unspilled.add(name)
            return
        self._spills.setdefault(name, []).append(bits)
        self._spilled += bits.numel()

    def _prune(self) -> None:
        """Drop kept scores below the risen bound; amortised: only once the store has doubled."""
        if self._spilled < 2 * self._spilled_after_prune + (1 << 20):
            return
        bound = self._running_bound()
        for name, parts in self._spills.items():
            self._spills[name] = [p[(p >> 16) >= bound] for p in parts]
        self._spilled = self._spilled_after_prune = sum(p.numel() for parts in self._spills.values() for p in parts)

    @property
    def positives(self) -> int:
        """Scores seen so far that can be masked (normal, positive)."""
        return int(self.coarse.sum())

    def needs_fine_pass(self) -> bool:
        """Whether the threshold lies strictly inside the positive scores (else no fine step is needed)."""
        return 0 < self.k < self.positives

    def _find_boundary(self) -> tuple[int, int]:
        if self._boundary is None:
            boundary_bin, above = _bin_of_kth_largest(self.coarse, self.k)
            self._boundary = (boundary_bin, self.k - above)
        return self._boundary

    def _touches_boundary(self, name: str) -> bool:
        return bool((self._tensor_bins[name] == self._find_boundary()[0]).any())

    def fine_pass_names(self) -> list[str]:
        """Tensors the caller must score again and pass to ``add_fine`` (their spill overflowed)."""
        if not self.needs_fine_pass():
            return []
        return sorted(n for n in self._unspilled if self._touches_boundary(n))

    def add_fine(self, name: str, scores: torch.Tensor) -> None:
        """Histogram the low bits of one re-scored tensor's scores in the boundary bin."""
        for bits in _bit_chunks(scores):
            self._add_fine_bits(name, bits)

    def _add_fine_bits(self, name: str, bits: torch.Tensor) -> None:
        boundary_bin, _ = self._find_boundary()
        # Offset inside the boundary bin; below it -> bin 0, above it -> last bin.
        key = bits.sub(boundary_bin << 16).clamp_(-1, _FINE_BINS).add_(1)
        counts = torch.bincount(key, minlength=_FINE_BINS + 2)[1:-1].cpu()
        if name in self._tensor_fine:  # another row block of the same tensor
            earlier_low, earlier_counts = self._tensor_fine[name]
            counts[earlier_low] += earlier_counts
        low = torch.nonzero(counts).squeeze(1)
        self._tensor_fine[name] = (low, counts[low])

    def result(self) -> GlobalThreshold:
        """The exact threshold and per-tensor tie quota, once every tensor has been added."""
        if not self.needs_fine_pass():
            # k == 0 masks nothing (threshold = +inf); k >= positives masks every positive score.
            threshold = float("inf") if self.k == 0 else 0.0
            return GlobalThreshold(threshold, {}, self.k, self.total, self.positives)
        boundary_bin, needed = self._find_boundary()
        for name, parts in self._spills.items():
            if self._touches_boundary(name):
                for part in parts:
                    self._add_fine_bits(name, part)
        self._spills.clear()
        fine = torch.zeros(_FINE_BINS, dtype=torch.int64)
        for low, counts in self._tensor_fine.values():
            fine[low] += counts
        low_bits, above_in_bin = _bin_of_kth_largest(fine, needed)
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
