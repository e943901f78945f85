"""Which rank owns what in a sharded Fisher estimate: dim-0 row shards and size-balanced owners.

Pure arithmetic on sizes, no tensors: every rank computes the same answer from the same
inputs, so no rank has to be told who owns what.
"""

from __future__ import annotations

from collections.abc import Sequence


def shard_rows(rows: int, world_size: int) -> int:
    """Rows of every dim-0 shard (the last ones padded): ``ceil(rows / world_size)``, as FSDP2 cuts."""
    return -(-rows // world_size)


def row_range(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the real rows of ``rank``'s dim-0 shard (empty for trailing ranks of a short tensor)."""
    size = shard_rows(rows, world_size)
    start = min(rank * size, rows)
    return start, min(start + size, rows)


def balanced_owners(sizes: Sequence[int], world_size: int) -> list[int]:
    """Owner rank of each item, largest first to the least-loaded rank (ties: lowest index, lowest rank).

    Longest-processing-time-first: the largest load is at most 4/3 of the best possible.
    """
    loads = [0] * world_size
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += sizes[index]
    return owners


def least_loaded(loads: list[int], size: int) -> int:
    """The rank with the smallest load (lowest on ties), charged ``size``: owners picked as items appear."""
    rank = min(range(len(loads)), key=lambda r: (loads[r], r))
    loads[rank] += size
    return rank
