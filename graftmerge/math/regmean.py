"""RegMean (Jin et al. 2023, "Dataless Knowledge Fusion by Merging Weights of Language Models"). Pure.

For a linear layer y = W x, model i's input Gram is G_i = Σ x xᵀ over its data, and RegMean
takes the W closest, in Σ_i ‖X_i Wᵀ − X_i W_iᵀ‖², to every model on its own inputs:
W = (Σ_i G̃_i W_iᵀ)ᵀ (Σ_i G̃_i)⁻¹, i.e. Wᵀ = (Σ_i G̃_i)⁻¹ Σ_i G̃_i W_iᵀ, with the
non-diagonal part shrunk, G̃ = α·G + (1 − α)·diag(G).

Everything here takes a weight **input-first** (``in × out``: Wᵀ of a torch Linear, a GPT-2
Conv1D weight as stored), so one solve serves both layouts. All of it runs in float64:
Gram matrices of activations are badly conditioned (eigenvalues spanning 10⁶ and more),
and a float32 solve would lose most of the digits the merge is meant to keep.
"""

from __future__ import annotations

import torch

from graftmerge.errors import GraftError

SINGULAR_RCOND = 1e-12  # smallest Cholesky pivot² / largest diagonal entry of Σ G̃ below this: singular

GramSide = tuple[torch.Tensor | None, torch.Tensor]  # (eigenvectors d × d or None for a diagonal side, eigenvalues d)


def gram(side: GramSide) -> torch.Tensor:
    """G = V diag(λ) Vᵀ in float64 (diag(λ) for a diagonal side)."""
    vectors, values = side
    values = values.to(torch.float64)
    if vectors is None:
        return torch.diag(values)
    vectors = vectors.to(torch.float64)
    return (vectors * values) @ vectors.T


def gram_diagonal(side: GramSide) -> torch.Tensor:
    """diag(G) = Σ_k λ_k v_k², without forming G (float64)."""
    vectors, values = side
    values = values.to(torch.float64)
    if vectors is None:
        return values
    return vectors.to(torch.float64).square() @ values


def check_alpha(alpha: float, label: str = "alpha") -> float:
    """α in [0, 1] (1: the plain Gram; 0: its diagonal only); GraftError otherwise."""
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not 0 <= alpha <= 1:
        raise GraftError(f"regmean parameter {label} must be a number in [0, 1], got {alpha!r}")
    return float(alpha)


def regularised_gram(side: GramSide, alpha: float) -> torch.Tensor:
    """G̃ = α·G + (1 − α)·diag(G), float64."""
    full = gram(side)
    if alpha != 1:
        diagonal = full.diagonal().clone()
        full.mul_(alpha).diagonal().add_((1 - alpha) * diagonal)
    return full


def regularised_gram_times(side: GramSide, alpha: float, x: torch.Tensor) -> torch.Tensor:
    """G̃ @ x for ``x`` (in × out, float64), through the eigenbasis: V(λ ⊙ Vᵀx), never the d × d G."""
    vectors, values = side
    values = values.to(torch.float64)
    diagonal = gram_diagonal(side)[:, None]
    if vectors is None:
        return diagonal * x
    vectors = vectors.to(torch.float64)
    product = vectors @ (values[:, None] * (vectors.T @ x))
    if alpha != 1:
        product.mul_(alpha).add_((1 - alpha) * diagonal * x)
    return product


def cholesky(total: torch.Tensor, where: str) -> torch.Tensor:
    """The Cholesky factor of Σ G̃ (float64); GraftError when it is singular or nearly so."""
    factor, info = torch.linalg.cholesky_ex(total)
    scale = float(total.diagonal().max()) if total.numel() else 0.0
    pivots = factor.diagonal().square()
    if int(info) != 0 or scale <= 0 or not torch.isfinite(factor).all() or float(pivots.min()) < SINGULAR_RCOND * scale:
        raise GraftError(
            f"{where}: Σ G̃ (the inputs' summed Gram matrices, {total.shape[0]} × {total.shape[0]}) is singular: "
            "lower alpha to add more ridge (G̃ = α·G + (1 − α)·diag G), or use fewer layers (leave this "
            "weight's KFAC entries out of the caches and set regmean_fallback: average)"
        )
    return factor


CLEARLY_DEFINITE = 1e-9  # the cheap bound must clear SINGULAR_RCOND by this much more (Cholesky's rounding: ~d·ε)


def clearly_positive_definite(diagonals: list[torch.Tensor], scales: list[float], alpha: float) -> bool:
    """Whether Σ c_i G̃_i certainly passes :func:`cholesky`, from the Grams' diagonals alone (O(d), no d³ work).

    Each G_i is positive semi-definite (non-negative eigenvalues), so for α < 1
    λ_min(Σ c G̃) ≥ (1 − α)·min_j (Σ c diag G)_j, and every Cholesky pivot² is at least λ_min.
    True when that bound clears the singularity threshold with room for rounding; False says
    only "not certain": the caller then factors Σ G̃ to decide.
    """
    if alpha >= 1 or not diagonals:
        return False
    summed = sum(scale * diagonal.to(torch.float64) for diagonal, scale in zip(diagonals, scales))
    largest = float(summed.max())
    return largest > 0 and (1 - alpha) * float(summed.min()) >= CLEARLY_DEFINITE * largest


def regmean_solve(weights: list[torch.Tensor], sides: list[GramSide], scales: list[float], alpha: float,
                  where: str = "regmean") -> torch.Tensor:
    """Wᵀ = (Σ c_i G̃_i)⁻¹ Σ c_i G̃_i W_iᵀ for input-first weights W_iᵀ (in × out), in float64.

    ``scales`` c_i are the models' weights (1 each in the paper). The dense reference:
    each G̃_i is formed; the pipeline streams the same sums (:class:`RegMeanSums`).
    """
    sums = RegMeanSums(alpha)
    for side, scale in zip(sides, scales):
        sums.add_gram(side, scale)
    for weight, side, scale in zip(weights, sides, scales):
        sums.add_product(weight, side, scale)
    return sums.solve(where)


class RegMeanSums:
    """Σ c_i G̃_i and Σ c_i G̃_i W_iᵀ, added one input at a time, then one Cholesky solve (float64)."""

    def __init__(self, alpha: float):
        self.alpha = alpha
        self.total: torch.Tensor | None = None  # Σ c G̃ (in × in)
        self.factor: torch.Tensor | None = None  # its Cholesky factor, once solved
        self.right: torch.Tensor | None = None  # Σ c G̃ Wᵀ (in × out)

    def add_gram(self, side: GramSide, scale: float) -> None:
        """Σ c G̃ += c·G̃ of one input."""
        term = regularised_gram(side, self.alpha).mul_(scale)
        self.total = term if self.total is None else self.total.add_(term)

    def add_product(self, weight: torch.Tensor, side: GramSide, scale: float) -> None:
        """Σ c G̃ Wᵀ += c·G̃ Wᵀ of one input (``weight`` input-first, any float dtype)."""
        term = regularised_gram_times(side, self.alpha, weight.to(torch.float64)).mul_(scale)
        self.right = term if self.right is None else self.right.add_(term)

    def solve(self, where: str) -> torch.Tensor:
        """(Σ c G̃)⁻¹ Σ c G̃ Wᵀ, float64 (in × out)."""
        if self.factor is None:
            self.factor = cholesky(self.total, where)
        return torch.cholesky_solve(self.right, self.factor)
