"""How many threads a forward pass gets: the cores this process may use, less those other work keeps busy.

On a shared machine every spare thread spins against someone else's: two threads on two
cores under a load of 8 ran an evaluation 4× slower than one thread did. The count is
chosen when a scoring call starts, from the CPU affinity mask and the one-minute load
average (this process counts itself once); ``GRAFTMERGE_THREADS=N`` fixes it, and a set
``OMP_NUM_THREADS`` is respected as torch reads it. Any count gives the same scores up to
float rounding in matmul reductions (see docs/performance.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from graftmerge.errors import GraftError

THREADS_VARIABLE = "GRAFTMERGE_THREADS"


def usable_cores() -> int:
    """Cores the process may run on (its affinity mask; os.cpu_count where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def eval_threads(cores: int | None = None, load: float | None = None) -> int:
    """Threads for one scoring call: GRAFTMERGE_THREADS, else torch's when OMP_NUM_THREADS is set, else the cores
    left free by the load (at least 1, at most the usable cores)."""
    configured = os.environ.get(THREADS_VARIABLE)
    if configured is not None:
        if not configured.strip().isdigit() or int(configured) < 1:
            raise GraftError(f"{THREADS_VARIABLE}={configured!r} is not a positive whole number of threads; "
                             f"unset it or give e.g. {THREADS_VARIABLE}=1")
        return int(configured)
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    cores = usable_cores() if cores is None else cores
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            return cores
    others = max(0.0, load - 1.0)  # the load counts this process's own runnable thread
    return max(1, min(cores, round(cores - others)))


@contextlib.contextmanager
def scoring_threads() -> Iterator[int]:
    """torch's intra-op threads set to :func:`eval_threads` for the block, then put back."""
    previous = torch.get_num_threads()
    chosen = eval_threads()
    torch.set_num_threads(chosen)
    try:
        yield chosen
    finally:
        torch.set_num_threads(previous)
