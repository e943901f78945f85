"""Per-tensor statistics of a delta: L2 norms and where its Fisher-weighted mass lies. Pure.

The sensitivity share follows the paper's Fig. 8 (right): of a delta's
Fisher-weighted size ``Σ_j F_j Δ_j²``, the fraction that falls inside the
coordinates with the largest Fisher values ``F_j`` (the top 1% by default). It
says how much an update writes into the post model's most sensitive coordinates.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from graftmerge.math.kfac import KfacFactors

_CHUNK = 1 << 22  # elements per reduction step
_BLOCK = re.compile(r"^(.*?\.(?:layers|layer|h|blocks|block)\.\d+)\.")


def block_of(name: str) -> str:
    """The transformer block a tensor belongs to (``model.layers.3``), else its module name."""
    match = _BLOCK.match(name)
    if match:
        return match.group(1)
    return re.sub(r"\.(weight|bias)$", "", name)


def natural_key(name: str) -> list:
    """Sort key that puts ``layers.2`` before ``layers.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def kfac_diagonal(factors: KfacFactors) -> torch.Tensor:
    """The diagonal of ``Q ⊗ P`` in the weight's layout: ``F_ij = diag(P)_i · diag(Q)_j``.

    ``diag(P)_i = Σ_k U_ik² σ_k`` (σ itself for an identity side), likewise for Q;
    exact for the stored factors, leading eigenvectors only included.
    """

    def side(vectors: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
        """diag of one factor side in float64: σ itself for an identity side, else Σ_k U_ik² σ_k."""
        values = values.to(torch.float64)
        return values if vectors is None else vectors.to(torch.float64).square() @ values

    return torch.outer(side(factors.U, factors.S), side(factors.V, factors.D)).to(torch.float32)


@dataclass(frozen=True)
class WeightedMass:
    """``Σ F Δ²`` of one tensor, and the parts of it inside two selected coordinate sets."""

    total: float
    in_tensor_top: float  # inside the tensor's own top coordinates by F
    in_global_top: float  # inside the model-wide top coordinates by F


def weighted_mass(
    fisher: torch.Tensor, delta: torch.Tensor, tensor_top: torch.Tensor, global_top: torch.Tensor
) -> WeightedMass:
    """Sums of ``F ⊙ Δ²`` (formed in float32, summed in float64) over everything and two masks.

    Chunked, so a huge embedding needs no full-size temporaries.
    """
    sums = torch.zeros(3, dtype=torch.float64)
    flat = [t.reshape(-1) for t in (fisher, delta, tensor_top, global_top)]
    for start in range(0, flat[0].numel(), _CHUNK):
        f, d, in_tensor, in_global = (t[start : start + _CHUNK] for t in flat)
        weighted = torch.square(d.to(torch.float32)).mul_(f.to(torch.float32))
        sums[0] += weighted.sum(dtype=torch.float64)
        sums[1] += torch.where(in_tensor, weighted, 0).sum(dtype=torch.float64)
        sums[2] += torch.where(in_global, weighted, 0).sum(dtype=torch.float64)
    return WeightedMass(*(float(v) for v in sums))


def l2_norm(delta: torch.Tensor) -> float:
    """‖Δ‖₂, accumulated in float64 over chunks."""
    flat = delta.reshape(-1)
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, flat.numel(), _CHUNK):
        total += torch.square(flat[start : start + _CHUNK].to(torch.float64)).sum()
    return float(total.sqrt())
