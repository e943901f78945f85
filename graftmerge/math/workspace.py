"""Reusable scratch tensors: one flat buffer per named slot, grown to the largest request and reused.

Why: on the CPU a freshly allocated tensor is paid for again at its first touch (the kernel
faults in and zeroes every page; on a VM measured 5-10x slower than writing the same
tensor again). A merge that allocates its sums, its dtype conversions and its cache reads
anew for every tensor pays that on every byte; one that reuses them pays it once per slot.
A slot keeps its largest request's size for the whole merge: fisher asks only for one
span's buffers (1 MiB each), so this costs nothing measurable.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch


class Workspace:
    """``take(slot, shape, dtype)``: an uninitialised tensor viewing slot ``slot``'s buffer (per thread).

    A view is valid until the same slot is taken again: never hand one out of the merge.
    """

    def __init__(self) -> None:
        self._local = threading.local()  # a caller's threads never share a buffer

    def take(self, slot: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A ``shape``-shaped, ``dtype`` view of this thread's buffer ``slot`` (grown when too small)."""
        buffers: dict[str, torch.Tensor] = self._local.__dict__.setdefault("buffers", {})
        count = 1
        for size in shape:
            count *= int(size)
        buffer = buffers.get(slot)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < count:
            buffers[slot] = buffer = None  # drop the old one first: never hold both
            buffers[slot] = buffer = torch.empty(count, dtype=dtype)
        return buffer[:count].view(tuple(shape))

    def release(self) -> None:
        """Free this thread's buffers (a finished merge's scratch space)."""
        self._local.__dict__.pop("buffers", None)
