"""Sums behind the KFAC factors (docs/math.md#the-estimator), for one batch (pure tensor functions).

Layout: activations ``a`` are the layer input, (B, T, d_in); output gradients ``g`` are
∂L_n/∂h at the layer output, (B, T, d_out); ``rows`` (from :func:`token_rows`) are the
flat indices of the non-padding positions. The functions make or add to *sums*; the estimator divides at the end:

    Q = Σ_{n,t} a aᵀ / Σ_n S_n        (mean over tokens)
    P = Σ_{n,t} g gᵀ / N              (token sum, mean over sequences)

Full factors are summed in place, on and above their diagonal blocks only (they are
symmetric); :func:`mirror` completes them when they are read.

Products are taken in ``dtype`` (float32 or float64), never in the model's bf16.
"""

from __future__ import annotations

import torch

FACTOR_STRIPS = 4  # a full factor is summed in this many row strips, from the diagonal rightwards


def strips(size: int) -> list[slice]:
    """Row strips of a size × size factor sum; :func:`add_covariance` fills each from its diagonal block on."""
    width = -(-size // FACTOR_STRIPS)
    return [slice(start, min(size, start + width)) for start in range(0, size, width)]


def token_rows(token_mask: torch.Tensor) -> torch.Tensor | None:
    """Flat indices of the non-padding positions of a (B, T) mask; None when nothing is padding."""
    return None if bool(token_mask.all()) else token_mask.reshape(-1).nonzero().squeeze(1)


def masked_rows(x: torch.Tensor, rows: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """(tokens, d): the non-padding rows of (B, T, d) ``x`` in ``dtype`` (a view when unpadded)."""
    flat = x.reshape(-1, x.shape[-1])
    return (flat if rows is None else flat.index_select(0, rows)).to(dtype)


def add_covariance(total: torch.Tensor, rows: torch.Tensor) -> None:
    """total += rowsᵀ rows on and above the diagonal blocks only, in place.

    The sum is symmetric, so the strips below the diagonal blocks are left out (with 4
    strips 5/8 of the full product's flops) and :func:`mirror` fills them once, when the
    sums are read. Used for a (→ Q) and g (→ P), ``rows`` from :func:`masked_rows`.
    """
    for strip in strips(total.shape[0]):
        total[strip, strip.start :].addmm_(rows[:, strip].T, rows[:, strip.start :])


def add_upper(total: torch.Tensor, upper: torch.Tensor) -> None:
    """total += upper on the part :func:`add_covariance` fills (one product shared by several sums)."""
    for strip in strips(total.shape[0]):
        total[strip, strip.start :] += upper[strip, strip.start :]


def mirror(total: torch.Tensor) -> None:
    """Fill the part below the diagonal blocks from its transpose: the full symmetric sum, in place."""
    for strip in strips(total.shape[0])[1:]:
        total[strip, : strip.start] = total[: strip.start, strip].T


def squared_sum(x: torch.Tensor, rows: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Σ_{n,t} x², the diagonal of Σ x xᵀ without the d×d matrix: (d,).

    The vocabulary side of an untied ``lm_head`` is kept diagonal this way.
    """
    x = masked_rows(x, rows, dtype)
    return (x * x).sum(dim=0)


def token_count(
    input_ids: torch.Tensor, rows: torch.Tensor | None, vocab_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Σ_{n,t} onehot(id) onehotᵀ as a vector: how often each token id occurs, (vocab,).

    The input of an embedding is one-hot, so its input factor is diagonal.
    """
    ids = input_ids.reshape(-1)
    ids = ids if rows is None else ids.index_select(0, rows)
    return torch.bincount(ids, minlength=vocab_size).to(dtype)
