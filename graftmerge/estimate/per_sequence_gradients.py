"""Σ_n (∇_θ L_n)² of one batch, from captured layer inputs and output gradients.

The diagonal Fisher needs the square of each *sequence's* gradient, which one batched
backward does not give (it returns Σ_n ∇L_n). Instead of one backward per sequence we
run one backward through the activations only and rebuild every sequence's parameter
gradient from what the layer saw (as per-example-gradient libraries do):

- Linear ``h = a Wᵀ + b``:   ∇W_n = Σ_t g_{n,t} a_{n,t}ᵀ = G_nᵀ A_n,   ∇b_n = Σ_t g_{n,t}
- Embedding row r:            ∇E_n[r] = Σ_{t: id_{n,t}=r} g_{n,t}
- any other module whose forward maps one (B, ...) tensor sequence-wise (RMSNorm,
  LayerNorm): a vector-Jacobian product per sequence, vectorised with ``torch.func.vmap``.

Layout: ``a`` (B, T, d_in), ``g`` (B, T, d_out) with g = ∂(Σ_n L_n)/∂h = ∂L_n/∂h on row n;
sequence n's real tokens are its first ``lengths[n]`` positions (right padding), and
only those are read.

Speed: a parameter's per-sequence gradient is never materialised whole. It is built one
sequence and one block of rows at a time in a small buffer that stays in cache (each use
of a tied weight adds its share to the same block), squared into the sum and dropped, so
a Linear costs one ``mm`` per sequence plus one cache-resident multiply-add: about the
weight-gradient matmul of a plain backward. An embedding's gradient touches only the
rows of the sequence's own tokens: tokens repeated in a sequence are summed first, then
squared, and scattered into the sum. A tied ``lm_head`` is dense over the vocabulary for
every sequence (Σ_t g_t h_tᵀ, with g_t = softmax − onehot scaled by 1/T_n, has no zero
row), so its square is a (vocab × hidden) pass per sequence — in blocks, with the
embedding's few rows added into the block before it is squared.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

MAX_BLOCK_ELEMENTS = 1 << 18  # one sequence's gradient block (1 MiB in fp32): stays in cache


@dataclass
class LinearUse:
    """One Linear's share of a weight's gradient: ∇W_n = G_nᵀ A_n over the real tokens."""

    a: torch.Tensor  # (B, T, d_in)
    g: torch.Tensor  # (B, T, d_out)

    def add_block(self, n: int, length: int, rows: slice, out: torch.Tensor, first: bool) -> None:
        """Rows ``rows`` of ∇W_n written to (``first``) or added into ``out``."""
        g_rows = self.g[n, :length, rows].T
        if first:
            torch.mm(g_rows, self.a[n, :length], out=out)
        else:
            out.addmm_(g_rows, self.a[n, :length])


@dataclass
class DenseUse:
    """Per-sequence gradients already made, (B, *shape): biases, norms."""

    grads: torch.Tensor

    def add_block(self, n: int, length: int, rows: slice, out: torch.Tensor, first: bool) -> None:
        """Rows ``rows`` of sequence n's gradient (as a 2-D matrix) written to or added into ``out``."""
        block = self.grads[n].reshape(-1, out.shape[1])[rows]
        if first:
            out.copy_(block)
        else:
            out.add_(block)


@dataclass
class EmbeddingUse:
    """One Embedding call's share: gradient g_{n,t} lands on row input_ids[n, t]."""

    input_ids: torch.Tensor  # (B, T)
    g: torch.Tensor  # (B, T, hidden)


def linear_bias_gradients(g: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """(B, d_out): Σ_t g_{n,t} over each sequence's real tokens."""
    return torch.stack([g[n, :length].sum(dim=0) for n, length in enumerate(lengths)])


def sequence_rows(
    uses: Sequence[EmbeddingUse], n: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted distinct token ids of sequence n, (rows, hidden) gradient of each): repeats summed."""
    ids = torch.cat([use.input_ids[n, :length] for use in uses])
    g = torch.cat([use.g[n, :length] for use in uses])
    rows, where = torch.unique(ids, sorted=True, return_inverse=True)
    return rows, g.new_zeros(rows.shape[0], g.shape[-1]).index_add_(0, where, g)


def add_squared_gradients(
    total: torch.Tensor,
    uses: Sequence[LinearUse | DenseUse | EmbeddingUse],
    lengths: Sequence[int],
    max_block_elements: int = MAX_BLOCK_ELEMENTS,
) -> None:
    """total += Σ_n (Σ_uses ∇_n)² in place: every use of one parameter summed before squaring."""
    embeddings = [use for use in uses if isinstance(use, EmbeddingUse)]
    blocks = [use for use in uses if not isinstance(use, EmbeddingUse)]
    if not blocks:  # an untied embedding: only the rows each sequence uses
        for n, length in enumerate(lengths):
            ids, grads = sequence_rows(embeddings, n, length)
            total.index_add_(0, ids, grads * grads)
        return
    matrix = total.view(total.shape[0], -1) if total.dim() else total.view(1, 1)
    height, width = matrix.shape
    step = max(1, max_block_elements // width)
    buffer = matrix.new_empty(min(step, height), width)
    # a tied embedding: each sequence's distinct rows, found per block by bisection
    sparse = [
        sequence_rows(embeddings, n, length) for n, length in enumerate(lengths) if embeddings
    ]
    sorted_ids = [ids.tolist() for ids, _ in sparse]
    for start in range(0, height, step):
        rows = slice(start, min(height, start + step))
        out = buffer[: rows.stop - start]
        for n, length in enumerate(lengths):
            for index, use in enumerate(blocks):
                use.add_block(n, length, rows, out, first=index == 0)
            if sparse:
                low = bisect_left(sorted_ids[n], rows.start)
                high = bisect_left(sorted_ids[n], rows.stop)
                if high > low:
                    ids, grads = sparse[n]
                    out.index_add_(0, ids[low:high] - start, grads[low:high])
            matrix[rows].addcmul_(out, out)


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
