"""Per-sequence gradients ∇_θ L_n of one batch, from captured layer inputs and output gradients.

The diagonal Fisher needs Σ_n (∇L_n)², the square of each *sequence's* gradient, which
one batched backward does not give (it returns Σ_n ∇L_n). Instead of one backward per
sequence we run one backward through the activations only and rebuild every
sequence's parameter gradient from what the layer saw (as per-example-gradient
libraries do):

- Linear ``h = a Wᵀ + b``:   ∇W_n = Σ_t g_{n,t} a_{n,t}ᵀ = G_nᵀ A_n,   ∇b_n = Σ_t g_{n,t}
- Embedding row r:            ∇E_n[r] = Σ_{t: id_{n,t}=r} g_{n,t}
- any other module whose forward maps one (B, ...) tensor sequence-wise (RMSNorm,
  LayerNorm): a vector-Jacobian product per sequence, vectorised with ``torch.func.vmap``.

Layout: ``a`` (B, T, d_in), ``g`` (B, T, d_out) with g = ∂(Σ_n L_n)/∂h = ∂L_n/∂h on row n,
and exactly zero at padding (right padding, causal attention).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap


def sequence_chunks(batch: int, numel: int, max_elements: int) -> Iterator[slice]:
    """Slices of the batch so that a chunk of per-sequence gradients holds ≤ max_elements."""
    step = max(1, max_elements // max(numel, 1))
    for start in range(0, batch, step):
        yield slice(start, min(batch, start + step))


def linear_weight_gradients(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """(b, d_out, d_in): G_nᵀ A_n for each sequence n of the chunk."""
    return torch.bmm(g.transpose(1, 2), a)


def linear_bias_gradients(g: torch.Tensor) -> torch.Tensor:
    """(b, d_out): Σ_t g_{n,t}."""
    return g.sum(dim=1)


def embedding_weight_gradients(
    input_ids: torch.Tensor, g: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """(b, vocab, hidden) dense per-sequence embedding gradients (needed when tied)."""
    b, t, hidden = g.shape
    out = torch.zeros(b, vocab_size, hidden, dtype=g.dtype, device=g.device)
    rows = input_ids + vocab_size * torch.arange(b, device=g.device)[:, None]  # (b, T)
    out.view(b * vocab_size, hidden).index_add_(0, rows.reshape(-1), g.reshape(b * t, hidden))
    return out


def embedding_squared_gradient_sum(
    input_ids: torch.Tensor, g: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """(vocab, hidden) Σ_n (∇E_n)² touching only the rows each sequence uses (untied case)."""
    total = torch.zeros(vocab_size, g.shape[-1], dtype=g.dtype, device=g.device)
    for ids, grads in zip(input_ids, g, strict=True):
        rows, where = torch.unique(ids, return_inverse=True)
        summed = torch.zeros(rows.shape[0], g.shape[-1], dtype=g.dtype, device=g.device)
        summed.index_add_(0, where, grads)
        total.index_add_(0, rows, summed * summed)
    return total


def module_parameter_gradients(
    module: nn.Module, parameters: dict[str, torch.Tensor], x: torch.Tensor, g: torch.Tensor
) -> dict[str, torch.Tensor]:
    """{name: (b, *shape)}: per-sequence VJPs of ``module``'s own parameters.

    Valid for modules that treat every row of dim 0 independently (normalisations).
    """

    def one_sequence(x_n: torch.Tensor, g_n: torch.Tensor) -> dict[str, torch.Tensor]:
        """One sequence's parameter VJP; vmap maps it over dim 0."""
        _, pullback = vjp(lambda p: functional_call(module, p, (x_n,)), parameters)
        return pullback(g_n)[0]

    return vmap(one_sequence)(x, g)
