"""torch.distributed glue: one process per device under ``torchrun``, or a single process.

Rollout batches are sharded across ranks; each rank accumulates sums; the sums are
all-reduced once at the end (SUM), so the result equals one process up to rounding.
gloo on CPU, nccl on GPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: its rank, how many ranks, its device."""

    rank: int
    world_size: int
    device: torch.device
    started_here: bool  # we created the process group and must destroy it

    @property
    def is_main(self) -> bool:
        """Rank 0, the one that prints progress and writes the cache."""
        return self.rank == 0


def rank_device(device: str | None) -> torch.device:
    """``device``, or this process's GPU (torchrun's LOCAL_RANK) when there are GPUs, else the CPU; made current."""
    if device is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    target = torch.device(device)
    if target.type == "cuda":
        torch.cuda.set_device(target)
    return target


def start(device: str | None = None) -> Ranks:
    """Join the torchrun process group if there is one (env WORLD_SIZE > 1)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    target = rank_device(device)
    if world_size == 1:
        return Ranks(0, 1, target, False)
    started = False
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if target.type == "cuda" else "gloo")
        started = True
    return Ranks(dist.get_rank(), dist.get_world_size(), target, started)


def stop(ranks: Ranks) -> None:
    """Leave the process group if :func:`start` created it (one that was already there stays)."""
    if ranks.started_here and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(ranks: Ranks, tensors: dict[str, torch.Tensor]) -> None:
    """In-place SUM over ranks, in sorted key order (every rank holds the same keys)."""
    if ranks.world_size == 1:
        return
    for key in sorted(tensors):
        dist.all_reduce(tensors[key], op=dist.ReduceOp.SUM)


def all_gather(ranks: Ranks, value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order."""
    if ranks.world_size == 1:
        return [value]
    gathered: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def agree(ranks: Ranks, error: str | None) -> str | None:
    """Share a failure across ranks so no rank waits forever on a collective another left."""
    if ranks.world_size == 1:
        return error
    errors = [e for e in all_gather(ranks, error) if e]
    return errors[0] if errors else None


def barrier(ranks: Ranks) -> None:
    """Wait for every rank; a no-op in one process."""
    if ranks.world_size > 1:
        dist.barrier()
