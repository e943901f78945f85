"""Fisher sums under FSDP2: each rank keeps only what it owns, one layer's working set at a time.

The hooks and the per-sequence math are :class:`~graftmerge.estimate.accumulator.FisherAccumulator`'s.
What changes is where a batch's contribution goes once it is complete:

- a diagonal sum (one parameter's Σ_n (∇L_n)² for this batch) is reduce-scattered at once,
  so each rank adds only its dim-0 shard (``ceil(rows / world)`` rows, the last padded) to
  the sum it keeps;
- a KFAC side sum (a aᵀ of one layer input, g gᵀ of one output) is reduced to the rank that
  owns it, picked the first time the side appears as the least-loaded rank by elements;
  a side shared by several weights (q/k/v read one input) is reduced once.

So a full-size buffer lives only from the hook that fills it to its reduction, and every
rank must run the same hooks in the same order: ranks that run out of data feed
:meth:`ShardedFisherAccumulator.accumulate_nothing` batches (zero weight, the same
collectives). The reductions run on their own process group, apart from FSDP's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from graftmerge.errors import GraftError
from graftmerge.estimate import kfac_factors
from graftmerge.estimate.accumulator import FisherAccumulator
from graftmerge.estimate.batching import Batch
from graftmerge.math.ownership import least_loaded, shard_rows

# torch 2.13 renamed reduce_scatter_tensor (and warns on the old name)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Workspace(dict):
    """This batch's full-size sums, each made (zeroed) on first use and dropped once reduced."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.shapes, self.dtype, self.device = shapes, dtype, device

    def fresh(self, key: str) -> torch.Tensor:
        """A zeroed buffer shaped like sum ``key`` (not kept)."""
        return torch.zeros(self.shapes[key], dtype=self.dtype, device=self.device)

    def __missing__(self, key: str) -> torch.Tensor:
        self[key] = self.fresh(key)
        return self[key]


def nothing_batch(device: torch.device) -> Batch:
    """A two-token batch with no real token: it runs every hook and collective and adds exactly zero."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    none = torch.zeros(1, 2, dtype=torch.bool, device=device)
    return Batch(ids, torch.ones_like(ids), torch.arange(2, device=device)[None], none, none)


class ShardedFisherAccumulator(FisherAccumulator):
    """:class:`FisherAccumulator` whose sums are sharded over ranks (``group``: every rank)."""

    def __init__(self, model: nn.Module, *, rank: int, world_size: int, group, kind: str = "diagonal",
                 modules: Sequence[str] = (), dtype: torch.dtype = torch.float32):
        self.rank, self.world_size, self.group = rank, world_size, group
        super().__init__(model, kind=kind, modules=modules, dtype=dtype)
        shapes = {side: {k: tuple(v.shape) for k, v in sums.items()}
                  for side, sums in (("diagonal", self.diagonal), ("rows", self.rows), ("columns", self.columns))}
        self.shapes = shapes
        self.diagonal = _Workspace(shapes["diagonal"], dtype, self.device)
        self.rows = _Workspace(shapes["rows"], dtype, self.device)
        self.columns = _Workspace(shapes["columns"], dtype, self.device)
        for name, shape in shapes["diagonal"].items():
            if not shape:
                raise GraftError(f"parameter {name!r} is a scalar; --fsdp shards along dim 0")
        self.owned_diagonal = {  # this rank's dim-0 shard of every diagonal sum
            name: torch.zeros((shard_rows(shape[0], world_size), *shape[1:]), dtype=dtype, device=self.device)
            for name, shape in shapes["diagonal"].items()
        }
        self.owned_factors: dict[str, torch.Tensor] = {}  # "rows/NAME" → full sum, on its owner only
        self.factor_owner: dict[str, int] = {}
        self.factor_alias: dict[str, str] = {}  # a side shared with an earlier weight → that weight's side
        self._loads = [0] * world_size

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Shapes only while planning: the sums this rank keeps are made in ``__init__``."""
        return torch.empty(shape, dtype=self.dtype, device="meta")

    # -- reductions, as contributions complete -------------------------------
    def _diagonal_done(self, name: str) -> None:
        buffer = self.diagonal.pop(name)
        total = self.owned_diagonal[name]
        rows = total.shape[0] * self.world_size
        if buffer.shape[0] != rows:
            buffer = torch.cat([buffer, buffer.new_zeros(rows - buffer.shape[0], *buffer.shape[1:])])
        part = torch.empty_like(total)
        _reduce_scatter(part, buffer.contiguous(), group=self.group)
        total += part

    def _factor_done(self, sums: dict[str, torch.Tensor], key: str) -> None:
        side = "rows" if sums is self.rows else "columns"
        self._reduce_factor(f"{side}/{key}", sums.pop(key))

    def _flush_input(self) -> None:
        """One a aᵀ for all weights reading the same input, reduced once and stored under the first weight."""
        if self._pending_input is None or len(self._pending_input[1]) == 1:
            return super()._flush_input()
        x, keys = self._pending_input
        self._pending_input = None
        shared = self.columns.fresh(keys[0])
        kfac_factors.add_covariance(shared, kfac_factors.masked_rows(x.detach(), self._rows, self.dtype))
        for key in keys[1:]:
            self.factor_alias[f"columns/{key}"] = f"columns/{keys[0]}"
        self._reduce_factor(f"columns/{keys[0]}", shared)

    def _reduce_factor(self, side: str, buffer: torch.Tensor) -> None:
        """Sum ``buffer`` over ranks into the owner's kept sum of ``side``."""
        owner = self.factor_owner.get(side)
        if owner is None:
            owner = self.factor_owner[side] = least_loaded(self._loads, buffer.numel())
        dist.reduce(buffer, dst=dist.get_global_rank(self.group, owner), group=self.group)
        if self.rank == owner:
            kept = self.owned_factors.get(side)
            if kept is None:
                self.owned_factors[side] = buffer
            else:
                kept += buffer

    def stored_side(self, side: str) -> str:
        """The side whose sum stands for ``side`` (itself, or the earlier side it is shared with)."""
        while side in self.factor_alias:
            side = self.factor_alias[side]
        return side

    # -- batches ------------------------------------------------------------
    def accumulate_nothing(self) -> None:
        """Run one batch that adds nothing, so this rank joins every collective of a batch it has no data for."""
        counts = self.sequences, self.tokens, self.completion_tokens
        self.accumulate(nothing_batch(self.device))
        self.sequences, self.tokens, self.completion_tokens = counts

    # -- results ------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's kept sums (diagonal shards, owned sides as summed) and the counts, for checkpoints."""
        state = {f"diagonal/{k}": v for k, v in self.owned_diagonal.items()}
        state.update({f"factor/{k}": v for k, v in self.owned_factors.items()})
        state["counts"] = torch.tensor([self.sequences, self.tokens, self.completion_tokens], dtype=torch.float64)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take back :meth:`state_dict` output (a checkpoint of this rank, same world size)."""
        diagonal = {k for k in state if k.startswith("diagonal/")}
        if diagonal != {f"diagonal/{k}" for k in self.owned_diagonal} or "counts" not in state:
            raise GraftError("the checkpoint holds other accumulators than this run needs")
        for key, value in state.items():
            if key.startswith("diagonal/"):
                self.owned_diagonal[key.removeprefix("diagonal/")].copy_(value)
            elif key.startswith("factor/"):
                self.owned_factors[key.removeprefix("factor/")] = value.to(self.device, self.dtype).clone()
        self.sequences, self.tokens, self.completion_tokens = (int(v) for v in state["counts"].tolist())

    def total_counts(self) -> tuple[int, int, int]:
        """(sequences, tokens, completion tokens) summed over ranks."""
        counts = torch.tensor([self.sequences, self.tokens, self.completion_tokens], dtype=torch.float64)
        dist.all_reduce(counts, group=self.group)
        return tuple(int(v) for v in counts.tolist())
