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

Cost: the coarse histogram only ever needs its bins at or above the k-th largest
score seen so far (the *running bound*, which only rises), so each chunk is first
cut down to its scores at or above the bound (one comparison, one gather) and only
those are histogrammed; the positives are counted apart. At small k that is a few
streaming passes over the scores instead of a 32K-bin histogram of all of them.

With ``keep_positions`` the kept scores also keep their flat positions, and
:meth:`ThresholdSearch.masked_positions` then names the exact coordinates the mask
selects in every tensor whose scores stayed kept: a merge right after the pass
applies the mask without scoring those tensors again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from graftmerge.math.selection import SMALLEST_SCORE

_COARSE_BINS = 1 << 15  # non-negative float32 bit patterns >> 16 are < 0x8000
_FINE_BINS = 1 << 16
_FIRST_NORMAL_BIN = 0x0080  # bits of the smallest normal float32 (0x00800000) >> 16
_FIRST_NORMAL_BITS = _FIRST_NORMAL_BIN << 16
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


def positions_at_or_above(bits: torch.Tensor, lowest: int) -> torch.Tensor:
    """``nonzero(bits >= lowest)`` (int64), cheaper when few qualify: whole words of the mask first.

    ``nonzero`` over a chunk's boolean mask is the slowest step of the coarse pass. Read
    as int64 words (8 flags each), the mask has 8× fewer entries to scan; only the words
    holding a hit are then scanned flag by flag. Where most words hold a hit, the mask is
    scanned directly.
    """
    mask = bits >= lowest
    whole = mask.numel() - mask.numel() % 8
    if whole == 0:
        return torch.nonzero(mask).squeeze(1)
    hit = torch.nonzero(mask[:whole].view(torch.int64)).squeeze(1)
    if 4 * hit.numel() > whole // 8:  # dense: a quarter of the words or more
        return torch.nonzero(mask).squeeze(1)
    inner = torch.nonzero(mask[:whole].view(-1, 8).index_select(0, hit).view(-1)).squeeze(1)
    found = hit[inner >> 3].mul_(8).add_(inner & 7)
    tail = torch.nonzero(mask[whole:]).squeeze(1).add_(whole)
    return torch.cat([found, tail]) if tail.numel() else found


def _bin_of_kth_largest(histogram: torch.Tensor, k: int) -> tuple[int, int]:
    """(bin holding the k-th largest entry, number of entries in the bins above it)."""
    from_top = torch.cumsum(histogram.flip(0), 0)
    index_from_top = int(torch.searchsorted(from_top, k))  # first cumulative count >= k
    above = int(from_top[index_from_top - 1]) if index_from_top > 0 else 0
    return histogram.numel() - 1 - index_from_top, above


@dataclass
class ThresholdSearch:
    """Accumulates histograms over a stream of tensors; see the module docstring.

    Usage: ``add_coarse`` every tensor (or each row block of it, in row order); then
    ``add_fine`` every tensor in ``fine_pass_names()`` (usually none); then
    ``result()``.

    The fine pass is usually answered from memory: while streaming, the k-th
    largest score seen so far only grows, so its bin is a lower bound on the
    final boundary bin, and only scores at or above it can matter. Those bit
    patterns are kept (and pruned as the bound rises) up to ``spill_limit``
    elements (half as many with ``keep_positions``: a position costs as much as a
    score); tensors whose scores did not fit are re-scored by the caller.

    ``coarse`` is exact in every bin at or above the running bound (each score there
    was at or above the bound when it was added); bins below it are never read.
    """

    k: int
    total: int
    spill_limit: int = 1 << 26  # int32 bit patterns kept in memory (256 MB)
    keep_positions: bool = False
    coarse: torch.Tensor = field(default_factory=lambda: torch.zeros(_COARSE_BINS, dtype=torch.int64))
    _positives: int = 0
    _tensor_bins: dict[str, torch.Tensor] = field(default_factory=dict)  # non-empty coarse bins
    _spills: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    _positions: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # parallel to _spills
    _offsets: dict[str, int] = field(default_factory=dict)  # elements of each tensor added so far
    _spilled: int = 0
    _spilled_after_prune: int = 0
    _pruned_at: int = -1  # running bound of the last prune
    _unspilled: set[str] = field(default_factory=set)
    _tensor_fine: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _boundary: tuple[int, int] | None = None  # (coarse bin, ties still needed in it)
    _masked: dict[str, torch.Tensor] = field(default_factory=dict)

    def add_coarse(self, name: str, scores: torch.Tensor) -> None:
        """Histogram one tensor's (or row block's) scores at or above the running bound, and keep them."""
        seen: set[int] = set()
        for bits in _bit_chunks(scores):
            seen.update(self._add_chunk(name, bits))
        known = set(self._tensor_bins[name].tolist()) if name in self._tensor_bins else set()
        self._tensor_bins[name] = torch.tensor(sorted(seen | known), dtype=torch.int64)
        self._prune()

    def _add_chunk(self, name: str, bits: torch.Tensor) -> list[int]:
        """Count, histogram and keep one chunk; returns its non-empty coarse bins at or above the bound.

        Until k positives have been seen there is no bound yet: the whole chunk is
        histogrammed first, so the bound it sets already filters what is kept.
        """
        start = self._offsets.get(name, 0)
        self._offsets[name] = start + bits.numel()
        early = self._positives < self.k
        if early:
            counts = torch.bincount((bits >> 16).clamp_(min=0), minlength=_COARSE_BINS).cpu()
            counts[:_FIRST_NORMAL_BIN] = 0  # zeros, subnormal (and negative-zero) scores are never masked
            self._positives += int(counts.sum())
        elif int(bits.amin()) >= _FIRST_NORMAL_BITS:  # the usual chunk: no zero score (a min is cheaper than a count)
            self._positives += bits.numel()
        else:
            self._positives += int(torch.count_nonzero(bits >= _FIRST_NORMAL_BITS))
        at_or_above = positions_at_or_above(bits, self._running_bound(counts if early else None) << 16)
        kept = bits[at_or_above]
        if not early:
            counts = torch.bincount(kept >> 16, minlength=_COARSE_BINS).cpu()
        self.coarse += counts
        positions = None
        if self.keep_positions:
            dtype = torch.int32 if start + bits.numel() < 2**31 else torch.int64
            positions = at_or_above.to(dtype).add_(start).cpu()
        self._spill(name, kept.cpu(), positions)
        return torch.nonzero(counts).squeeze(1).tolist()

    def _running_bound(self, pending: torch.Tensor | None = None) -> int:
        """Bin of the k-th largest score so far (with ``pending`` counts not yet in ``coarse``): never above the
        final boundary bin."""
        if self.k == 0 or self._positives < self.k:
            return _FIRST_NORMAL_BIN
        return _bin_of_kth_largest(self.coarse if pending is None else self.coarse + pending, self.k)[0]

    def _limit(self) -> int:
        return self.spill_limit // 2 if self.keep_positions else self.spill_limit

    def _spill(self, name: str, bits: torch.Tensor, positions: torch.Tensor | None) -> None:
        if name in self._unspilled:
            return
        if self._spilled + bits.numel() > self._limit():
            self._prune(force=True)
        if self._spilled + bits.numel() > self._limit():
            self._spilled -= sum(t.numel() for t in self._spills.pop(name, []))
            self._positions.pop(name, None)
            self._unspilled.add(name)
            return
        self._spills.setdefault(name, []).append(bits)
        if positions is not None:
            self._positions.setdefault(name, []).append(positions)
        self._spilled += bits.numel()

    def _prune(self, force: bool = False) -> None:
        """Drop kept scores below the risen bound; amortised: only once the store has doubled (or ``force``)."""
        bound = self._running_bound()
        if (self._spilled < 2 * self._spilled_after_prune + (1 << 20) and not force) or bound == self._pruned_at:
            return
        self._pruned_at = bound
        for name, parts in self._spills.items():
            keep = [positions_at_or_above(p, bound << 16) for p in parts]
            self._spills[name] = [p.index_select(0, k) for p, k in zip(parts, keep)]
            if name in self._positions:
                self._positions[name] = [p.index_select(0, k) for p, k in zip(self._positions[name], keep)]
        self._spilled = self._spilled_after_prune = sum(p.numel() for parts in self._spills.values() for p in parts)

    @property
    def positives(self) -> int:
        """Scores seen so far that can be masked (normal, positive)."""
        return self._positives

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
        in_bin = bits[(bits >> 16) == boundary_bin] & 0xFFFF  # offset inside the boundary bin
        counts = torch.bincount(in_bin, minlength=_FINE_BINS).cpu()
        if name in self._tensor_fine:  # another row block of the same tensor
            earlier_low, earlier_counts = self._tensor_fine[name]
            counts[earlier_low] += earlier_counts
        low = torch.nonzero(counts).squeeze(1)
        self._tensor_fine[name] = (low, counts[low])

    def kept_positions(self, name: str) -> torch.Tensor | None:
        """Flat positions (int64, ascending) of the scores of ``name`` kept so far; None unless kept whole.

        The mask :meth:`masked_positions` names later is a subset of them.
        """
        if not self.keep_positions or name in self._unspilled or name not in self._positions:
            return None
        return torch.cat([p.to(torch.int64) for p in self._positions[name]])

    def masked_positions(self, name: str) -> torch.Tensor | None:
        """After ``result()``: flat positions (int64, ascending) the mask selects in ``name``.

        None when ``keep_positions`` is off or the tensor's scores overflowed ``spill_limit``
        (the caller then scores it again and applies ``mask_from_threshold``).
        """
        return self._masked.get(name)

    def result(self) -> GlobalThreshold:
        """The exact threshold and per-tensor tie quota, once every tensor has been added."""
        if not self.needs_fine_pass():
            # k == 0 masks nothing (threshold = +inf); k >= positives masks every positive score.
            threshold = float("inf") if self.k == 0 else 0.0
            found = GlobalThreshold(threshold, {}, self.k, self.total, self.positives)
        else:
            found = self._exact_threshold()
        if self.keep_positions:
            self._masked = {name: self._select(name, found) for name in self._positions}
        self._spills.clear()
        self._positions.clear()
        return found

    def _exact_threshold(self) -> GlobalThreshold:
        """Fine step over the kept scores in the boundary bin (and the re-scored tensors): exact t and ties."""
        boundary_bin, needed = self._find_boundary()
        for name, parts in self._spills.items():
            if self._touches_boundary(name):
                for part in parts:
                    self._add_fine_bits(name, part)
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

    def _select(self, name: str, found: GlobalThreshold) -> torch.Tensor:
        """Positions of ``name``'s kept scores that ``mask_from_threshold`` would select, in order.

        Every score the mask can select is kept (it is at or above every running bound).
        """
        positions = torch.cat([p.to(torch.int64) for p in self._positions[name]])
        scores = torch.cat(self._spills[name]).view(torch.float32)
        if found.threshold < SMALLEST_SCORE:
            return positions[scores >= SMALLEST_SCORE]
        chosen = scores > found.threshold
        quota = found.tie_quota.get(name, 0)
        if quota:
            chosen[torch.nonzero(scores == found.threshold).squeeze(1)[:quota]] = True
        return positions[chosen]
