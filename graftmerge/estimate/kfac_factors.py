"""Sums behind the KFAC factors of SPEC §3, for one batch (pure tensor functions).

Layout: activations ``a`` are the layer input, (B, T, d_in); output gradients ``g`` are
∂L_n/∂h at the layer output, (B, T, d_out); ``token_mask`` (B, T) marks non-padding
positions. The functions return *sums*; the estimator divides at the end:

    Q = Σ_{n,t} a aᵀ / Σ_n S_n        (mean over tokens)
    P = Σ_{n,t} g gᵀ / N              (token sum, mean over sequences)

Products are taken in ``dtype`` (float32 or float64), never in the model's bf16.
"""

from __future__ import annotations

import torch


def _masked_tokens(x: torch.Tensor, token_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(tokens, d): the non-padding rows of (B, T, d) ``x`` in ``dtype``."""
    return x.reshape(-1, x.shape[-1])[token_mask.reshape(-1)].to(dtype)


def covariance_sum(x: torch.Tensor, token_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Σ_{n,t} x xᵀ over non-padding positions: (d, d). Used for a (→ Q) and g (→ P)."""
    rows = _masked_tokens(x, token_mask, dtype)
    return rows.T @ rows


def squared_sum(x: torch.Tensor, token_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Σ_{n,t} x², the diagonal of :func:`covariance_sum` without the d×d matrix: (d,).

    The vocabulary side of an untied ``lm_head`` is kept diagonal this way.
    """
    rows = _masked_tokens(x, token_mask, dtype)
    return (rows * rows).sum(dim=0)


def token_count(
    input_ids: torch.Tensor, token_mask: torch.Tensor, vocab_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Σ_{n,t} onehot(id) onehotᵀ as a vector: how often each token id occurs, (vocab,).

    The input of an embedding is one-hot, so its input factor is diagonal.
    """
    ids = input_ids.reshape(-1)[token_mask.reshape(-1)]
    return torch.bincount(ids, minlength=vocab_size).to(dtype)
