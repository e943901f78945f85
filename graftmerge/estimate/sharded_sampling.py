"""``--prompts`` under ``--fsdp``: every rank samples its own prompts with the sharded weights.

Each forward of an FSDP2 model is a collective (every layer's weights are all-gathered),
so all ranks must run the same number of forwards, while their prompts differ in number
and their completions in length. :class:`LockstepModel` keeps them in step: before every
forward the ranks all-reduce whether each still samples; a rank that has finished joins
the others' forwards with a one-token forward of its own until none samples. Samples are
drawn exactly as in one process (each prompt its own seeded generator), so they do not
depend on the number of ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class LockstepModel:
    """The sharded model as the sampling loop sees it: every call is one round that all ranks join."""

    def __init__(self, model: nn.Module, group):
        self.model, self.group = model, group

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)  # config, parameters(), forward's signature ...

    def __call__(self, *args, **kwargs):
        self._round(sampling=True)
        return self.model(*args, **kwargs)

    def _round(self, sampling: bool) -> bool:
        """All-reduce of 'this rank still samples': whether any rank does."""
        flag = torch.tensor([int(sampling)])
        dist.all_reduce(flag, group=self.group)
        return bool(flag.item())

    @torch.no_grad()
    def finish(self) -> None:
        """Join the other ranks' forwards (one token, no cache) until no rank samples any more."""
        device = next(self.model.parameters()).device
        while self._round(sampling=False):
            self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
