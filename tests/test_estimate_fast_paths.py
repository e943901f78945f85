"""The estimator's fast paths against dense brute force, in float64.

Σ_n (∇L_n)² is built block by block per sequence (a tied embedding's rows added into the
``lm_head`` block before squaring, an untied embedding as a sparse scatter), and full KFAC
factors are summed on and above their diagonal blocks, then mirrored. Each is compared
here with the plain dense computation: every sequence's whole gradient, then squared.
Padding positions hold NaN, so reading past a sequence's length would show.
"""

from __future__ import annotations

import pytest
import torch

from graftmerge.errors import GraftError
from graftmerge.estimate import kfac_factors
from graftmerge.estimate.accumulator import FisherAccumulator
from graftmerge.estimate.batching import Batch
from graftmerge.estimate.per_sequence_gradients import (
    DenseUse,
    EmbeddingUse,
    LinearUse,
    add_squared_gradients,
)
from graftmerge.estimate.rollouts import Rollout
from tests.helpers.estimation import (
    accumulate,
    brute_force_diagonal,
    load,
    make_model,
    relative_error,
)

LENGTHS = [9, 6, 9, 1]
VOCAB, HIDDEN, D_IN = 23, 5, 7


def padded(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random (B, T, ...) values with NaN past each sequence's length."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    for n, length in enumerate(LENGTHS):
        x[n, length:] = float("nan")
    return x


def token_ids(seed: int) -> torch.Tensor:
    """(B, T) ids with tokens repeated inside sequences (few distinct ids, some rows twice)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(LENGTHS), max(LENGTHS)), generator=generator)
    ids[0, 3] = ids[0, 1] = ids[0, 7]  # three times in one sequence
    ids[2, 0] = ids[2, 8] = VOCAB - 1  # the last row, at both ends
    ids[1, 2] = 0
    return ids


def dense_sequence_gradients(uses: list, shape: tuple[int, ...]) -> torch.Tensor:
    """(B, *shape): every sequence's whole gradient, summed over its uses token by token."""
    grads = torch.zeros(len(LENGTHS), *shape, dtype=torch.float64)
    for n, length in enumerate(LENGTHS):
        for use in uses:
            if isinstance(use, LinearUse):
                grads[n] += use.g[n, :length].T @ use.a[n, :length]
            elif isinstance(use, EmbeddingUse):
                for t in range(length):
                    grads[n, use.input_ids[n, t]] += use.g[n, t]
            else:
                grads[n] += use.grads[n]
    return grads


def squared_sum(uses: list, shape: tuple[int, ...], block: int) -> torch.Tensor:
    total = torch.zeros(shape, dtype=torch.float64)
    add_squared_gradients(total, uses, LENGTHS, max_block_elements=block)
    return total


@pytest.mark.parametrize("block", [1, 3 * HIDDEN, 1 << 18], ids=["row", "3 rows", "whole"])
def test_tied_embedding_rows_are_summed_into_the_dense_lm_head_gradient_before_squaring(block):
    lm_head = LinearUse(padded((4, 9, HIDDEN), 1), padded((4, 9, VOCAB), 2))
    embedding = EmbeddingUse(token_ids(3), padded((4, 9, HIDDEN), 4))
    assert len(set(embedding.input_ids[0, : LENGTHS[0]].tolist())) < LENGTHS[0]  # repeats
    uses = [lm_head, embedding]
    expected = (dense_sequence_gradients(uses, (VOCAB, HIDDEN)) ** 2).sum(dim=0)
    assert relative_error(squared_sum(uses, (VOCAB, HIDDEN), block), expected) < 1e-13
    # the order of the uses does not matter
    assert relative_error(squared_sum(uses[::-1], (VOCAB, HIDDEN), block), expected) < 1e-13


def test_untied_embedding_is_a_sparse_scatter_of_summed_rows():
    uses = [EmbeddingUse(token_ids(5), padded((4, 9, HIDDEN), 6))]
    expected = (dense_sequence_gradients(uses, (VOCAB, HIDDEN)) ** 2).sum(dim=0)
    got = squared_sum(uses, (VOCAB, HIDDEN), 1)
    assert relative_error(got, expected) < 1e-13
    held = {int(i) for n, length in enumerate(LENGTHS) for i in uses[0].input_ids[n, :length]}
    unused = sorted(set(range(VOCAB)) - held)
    assert unused and not got[unused].any()  # rows no sequence holds stay exactly zero


@pytest.mark.parametrize("block", [1, 2 * D_IN, 1 << 18], ids=["row", "2 rows", "whole"])
def test_linear_weight_and_bias_equal_dense_per_sequence_gradients(block):
    weight = LinearUse(padded((4, 9, D_IN), 7), padded((4, 9, 11), 8))
    expected = (dense_sequence_gradients([weight], (11, D_IN)) ** 2).sum(dim=0)
    assert relative_error(squared_sum([weight], (11, D_IN), block), expected) < 1e-13
    # a weight used by two Linear modules, and a dense use (norms, biases) of any shape
    twice = [weight, LinearUse(padded((4, 9, D_IN), 9), padded((4, 9, 11), 10))]
    expected = (dense_sequence_gradients(twice, (11, D_IN)) ** 2).sum(dim=0)
    assert relative_error(squared_sum(twice, (11, D_IN), block), expected) < 1e-13
    dense = [DenseUse(torch.randn(4, 3, 2, 5, dtype=torch.float64))]
    expected = (dense[0].grads ** 2).sum(dim=0)
    assert relative_error(squared_sum(dense, (3, 2, 5), block), expected) < 1e-13


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13])
def test_upper_strip_covariance_mirrored_equals_the_full_product(size):
    generator = torch.Generator().manual_seed(size)
    batches = [torch.randn(rows, size, generator=generator, dtype=torch.float64) for rows in (6, 4)]
    total = torch.zeros(size, size, dtype=torch.float64)
    for rows in batches:
        kfac_factors.add_covariance(total, rows)
    kfac_factors.mirror(total)
    expected = sum(rows.T @ rows for rows in batches)
    assert relative_error(total, expected) < 1e-13
    for strip in kfac_factors.strips(size):  # the mirrored part is the exact transpose
        assert torch.equal(total[strip, : strip.start], total[: strip.start, strip].T)
    # one product shared by several sums (q/k/v) adds the same bits to each
    shared, first, second = (torch.zeros(size, size, dtype=torch.float64) for _ in range(3))
    kfac_factors.add_covariance(shared, batches[0])
    kfac_factors.add_upper(first, shared)
    kfac_factors.add_upper(second, shared)
    kfac_factors.mirror(first)
    kfac_factors.mirror(second)
    assert torch.equal(first, second)
    assert relative_error(first, batches[0].T @ batches[0]) < 1e-13


def test_token_rows_select_the_real_tokens_and_none_without_padding():
    mask = torch.tensor([[True, True, True], [True, False, False]])
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    rows = kfac_factors.token_rows(mask)
    assert torch.equal(kfac_factors.masked_rows(x, rows, torch.float64), x[mask])
    assert kfac_factors.token_rows(torch.ones(2, 3, dtype=torch.bool)) is None
    unpadded = kfac_factors.masked_rows(x, None, torch.float64)
    assert torch.equal(unpadded, x.reshape(6, 4)) and unpadded.data_ptr() == x.data_ptr()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_repeated_tokens_and_block_sizes_match_brute_force(tmp_path, tied):
    """Whole model, sequences repeating tokens (also across the tied lm_head / embedding)."""
    model = load(make_model(tmp_path / "post", tied=tied))
    rollouts = [
        Rollout((5, 5, 9), (5, 17, 17, 17, 5)),
        Rollout((3,), (3, 3, 40, 3)),
        Rollout((100, 7, 100), (7, 7)),
    ]
    reference = brute_force_diagonal(model, rollouts)
    for block in (1, 40, 1 << 18):
        diagonal, _ = accumulate(model, rollouts, 2, kind="both", max_chunk_elements=block)
        for name, value in diagonal.items():
            assert relative_error(value, reference[name]) < 1e-10, (block, name)


def test_a_batch_that_is_not_right_padded_is_refused(tmp_path):
    model = load(make_model(tmp_path / "post"))
    ids = torch.tensor([[0, 4, 5, 6]])
    mask = torch.tensor([[False, True, True, True]])
    batch = Batch(ids, mask.long(), torch.arange(4)[None], mask, mask)
    with (
        FisherAccumulator(model) as accumulator,
        pytest.raises(GraftError, match="not right-padded"),
    ):
        accumulator.accumulate(batch)
