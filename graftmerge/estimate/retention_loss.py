"""The retention loss (docs/math.md#the-estimator): per-token-normalised NLL of completion tokens.

Layout: ``logits`` (B, T, V) from a right-padded batch, ``input_ids`` (B, T), and
``completion_mask`` (B, T) true at completion-token positions. Each sequence's loss is
divided by its own completion length T_n, then summed over the batch, so the gradient
of the batch loss with respect to sequence n's activations is exactly ∇L_n
(sequences do not interact: causal attention with right padding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def completion_token_weights(completion_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) weights 1/T_n at completion positions of sequence n, 0 elsewhere."""
    lengths = completion_mask.sum(dim=1, keepdim=True).clamp_min(1)
    return completion_mask.to(torch.float64) / lengths


def summed_sequence_losses(
    logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor
) -> torch.Tensor:
    """Σ_n L_n with L_n = −(1/T_n) Σ_t log p(y_{n,t} | z_n, y_{n,<t}); a scalar.

    The token at position t is predicted by the logits at t − 1; the logits are
    upcast to at least float32 so bf16 models get an accurate softmax.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    predicted = logits[:, :-1].to(dtype)  # (B, T-1, V) predicts positions 1..T-1
    targets = input_ids[:, 1:]
    nll = F.cross_entropy(
        predicted.reshape(-1, predicted.shape[-1]), targets.reshape(-1), reduction="none"
    )
    weights = completion_token_weights(completion_mask)[:, 1:].to(dtype)
    return (nll.view_as(targets) * weights).sum()
