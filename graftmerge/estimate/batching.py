"""Right-padded batches and the batch plan shared by all ranks.

Right padding with an attention mask and explicit position ids: a real token never
attends to a pad (causal attention, pads come last), so a padded batch gives every
sequence exactly the numbers it would get alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graftmerge.estimate.rollouts import Rollout


@dataclass
class Batch:
    """Rollouts stacked for one forward: ids, masks and positions, all (sequences, tokens)."""

    input_ids: torch.Tensor  # (B, T) long, pad id 0 after each sequence
    attention_mask: torch.Tensor  # (B, T) long, 1 on real tokens
    position_ids: torch.Tensor  # (B, T) long, 0..S_n-1 then continuing over pads
    token_mask: torch.Tensor  # (B, T) bool, real tokens (prompt and completion)
    completion_mask: torch.Tensor  # (B, T) bool, completion tokens

    @property
    def sequences(self) -> int:
        """Rows in the batch."""
        return int(self.input_ids.shape[0])

    @property
    def tokens(self) -> int:
        """Real (non-pad) tokens, prompts included."""
        return int(self.token_mask.sum())

    def to(self, device: torch.device | str) -> Batch:
        """The same batch on ``device``."""
        return Batch(
            *(
                t.to(device)
                for t in (
                    self.input_ids,
                    self.attention_mask,
                    self.position_ids,
                    self.token_mask,
                    self.completion_mask,
                )
            )
        )


def pad_batch(rollouts: Sequence[Rollout], pad_id: int = 0) -> Batch:
    """Stack rollouts into one right-padded batch."""
    width = max(r.length for r in rollouts)
    input_ids = torch.full((len(rollouts), width), pad_id, dtype=torch.long)
    token_mask = torch.zeros(len(rollouts), width, dtype=torch.bool)
    completion_mask = torch.zeros_like(token_mask)
    for row, rollout in enumerate(rollouts):
        prompt, length = len(rollout.prompt_ids), rollout.length
        input_ids[row, :length] = torch.tensor(rollout.prompt_ids + rollout.completion_ids)
        token_mask[row, :length] = True
        completion_mask[row, prompt:length] = True
    position_ids = torch.arange(width).expand(len(rollouts), width).contiguous()
    return Batch(input_ids, token_mask.long(), position_ids, token_mask, completion_mask)


def plan_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices of each batch: sequences sorted by length (longest first) to waste little padding.

    Deterministic in the data and ``batch_size`` only, so ranks agree and a resumed run
    continues the same plan. The Fisher is a sum, so the order changes nothing but rounding.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def batches_of_rank(plan: list[list[int]], rank: int, world_size: int) -> list[list[int]]:
    """Round-robin shard of the plan: batch i goes to rank i mod K (balanced token counts)."""
    return plan[rank::world_size]


def planned_counts(rollouts: Sequence[Rollout], batches: Sequence[Sequence[int]]) -> tuple[int, int, int]:
    """(sequences, tokens, completion tokens) that ``batches`` add to the sums: what a checkpoint after them holds."""
    chosen = [rollouts[i] for batch in batches for i in batch]
    return len(chosen), sum(r.length for r in chosen), sum(len(r.completion_ids) for r in chosen)
