"""The cheap pre-check of Σ G̃: whenever it says "certainly definite", the dense float64 matrix is, and the
Cholesky the merge runs accepts it; it never vouches for a singular or nearly singular sum."""

from __future__ import annotations

import pytest
import torch

from graftmerge.errors import GraftError
from graftmerge.math.regmean import (
    SINGULAR_RCOND,
    cholesky,
    clearly_positive_definite,
    gram_diagonal,
    regularised_gram,
)


def side(size: int, rank: int, generator: torch.Generator, spread: float = 1.0):
    """A stored Gram side: an orthonormal basis and non-negative eigenvalues, ``size - rank`` of them zero."""
    basis, _ = torch.linalg.qr(torch.randn(size, size, generator=generator, dtype=torch.float64))
    values = torch.zeros(size, dtype=torch.float64)
    values[:rank] = torch.rand(rank, generator=generator, dtype=torch.float64) ** spread
    return basis.float(), values.float()


def dense_total(sides, scales, alpha):
    return sum(scale * regularised_gram(s, alpha) for s, scale in zip(sides, scales))


@pytest.mark.parametrize("seed", range(12))
def test_whenever_it_vouches_the_dense_sum_is_definite_and_cholesky_accepts(seed: int) -> None:
    """Random sides (full rank, rank-deficient, badly spread eigenvalues), weights and α: the bound it relies on
    holds against the dense eigenvalues, and a vouched-for sum always factors."""
    generator = torch.Generator().manual_seed(seed)
    size = int(torch.randint(2, 24, (1,), generator=generator))
    sides = [side(size, int(torch.randint(1, size + 1, (1,), generator=generator)), generator,
                  spread=float(torch.rand(1, generator=generator)) * 12) for _ in range(3)]
    scales = [float(v) for v in torch.rand(3, generator=generator) + 0.1]
    for alpha in (0.0, 0.5, 0.9, 0.999, 1.0):
        total = dense_total(sides, scales, alpha)
        vouched = clearly_positive_definite([gram_diagonal(s) for s in sides], scales, alpha)
        if alpha == 1.0:
            assert not vouched  # nothing is known about the plain Gram's smallest eigenvalue from its diagonal
        if vouched:
            summed = sum(c * gram_diagonal(s) for s, c in zip(sides, scales))
            rounding = 1e-12 * float(summed.max())  # eigvalsh's own error, ~d·ε of the largest entry
            assert float(torch.linalg.eigvalsh(total).min()) >= (1 - alpha) * float(summed.min()) - rounding
            cholesky(total, "vouched")  # accepted


def test_a_coordinate_no_input_sees_is_never_vouched_for_and_cholesky_refuses_it() -> None:
    generator = torch.Generator().manual_seed(0)
    sides = []
    for _ in range(2):
        vectors, values = side(6, 6, generator)
        vectors[2, :] = 0  # input feature 2 never active: row and column 2 of G are zero
        sides.append((vectors, values))
    assert not clearly_positive_definite([gram_diagonal(s) for s in sides], [1.0, 1.0], alpha=0.5)
    with pytest.raises(GraftError, match="singular"):
        cholesky(dense_total(sides, [1.0, 1.0], 0.5), "blind feature")


def test_a_nearly_singular_sum_is_left_to_cholesky() -> None:
    """Diagonals spanning more than the margin allows: no vouching, even where Cholesky would still pass."""
    diagonal = torch.tensor([1.0, 1e-12], dtype=torch.float64)
    assert not clearly_positive_definite([diagonal], [1.0], alpha=0.5)
    total = torch.diag(diagonal)
    assert float(diagonal.min()) >= SINGULAR_RCOND * float(diagonal.max())  # Cholesky itself accepts this one
    cholesky(total, "diagonal")
    assert clearly_positive_definite([torch.tensor([1.0, 1e-6], dtype=torch.float64)], [1.0], alpha=0.5)


def test_no_diagonals_or_zero_diagonals_are_never_vouched_for() -> None:
    assert not clearly_positive_definite([], [], alpha=0.5)
    assert not clearly_positive_definite([torch.zeros(3)], [1.0], alpha=0.5)
