"""Eigenbases of KFAC factors: the decomposition, the eigenvalue clamp, and the orthonormality check. Pure.

A Fisher cache stores each full factor side as its eigenbasis; these are the checks and
the decomposition that storing and reading one rely on, tensors in, tensors out.
"""

from __future__ import annotations

import math

import torch

from graftmerge.errors import GraftError

ORTHONORMAL_TOLERANCE = 1e-3
EIGENVALUE_TOLERANCE = 1e-6  # relative to the largest eigenvalue of the side


def symmetric_eigenbasis(factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(eigenvectors, eigenvalues) of the symmetric part ``(F + Fᵀ) / 2`` of a square factor, in its dtype."""
    eigenvalues, eigenvectors = torch.linalg.eigh((factor + factor.T) / 2)
    return eigenvectors, eigenvalues


def clamp_eigenvalues(values: torch.Tensor, where: str) -> tuple[torch.Tensor, int]:
    """A positive semi-definite factor's eigenvalues with rounding's tiny negatives set to 0, and how many were.

    GraftError (naming ``where``) for NaN or Inf, or for an eigenvalue below
    ``-EIGENVALUE_TOLERANCE`` times the largest magnitude: the factor is not PSD.
    """
    if not torch.isfinite(values).all():
        raise GraftError(f"{where} contains NaN or Inf")
    scale = max(float(values.abs().max()), 1e-30) if values.numel() else 1.0
    if (values < -EIGENVALUE_TOLERANCE * scale).any():
        raise GraftError(f"{where} has eigenvalue {float(values.min()):.3g} below zero (not positive semi-definite)")
    negative = values < 0
    return values.clamp_min(0), int(negative.sum())


def check_orthonormal(vectors: torch.Tensor, where: str, tolerance: float = ORTHONORMAL_TOLERANCE) -> None:
    """Columns of ``vectors`` must be orthonormal: max |VᵀV − I| over the whole Gram matrix ≤ ``tolerance``.

    One matmul in float32, the precision caches store (its rounding, ~1e-6, is far below
    the tolerance): O(d·r²) for ``d × r`` vectors, whose Gram matrix is ``r × r``. NaN or
    Inf anywhere makes the Gram non-finite and is refused as such. Run when a cache is
    written and when a read meets bytes that have not passed it before (``orthonormal_digest``).
    """
    if vectors.numel() == 0:
        return
    vectors = vectors.to(torch.float32)
    gram = vectors.T @ vectors
    gram.diagonal().sub_(1)
    error = float(gram.abs_().max())
    if not math.isfinite(error):
        raise GraftError(f"{where} contain NaN or Inf")
    if error > tolerance:
        raise GraftError(f"{where} are not orthonormal (max |VᵀV − I| = {error:.2g} > {tolerance:g})")
