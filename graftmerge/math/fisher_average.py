"""Fisher-weighted averaging (Matena & Raffel, "Merging Models with Fisher-Weighted Averaging"). Pure.

θ = Σ_i w_i F̂_i ⊙ θ_i / Σ_i w_i F̂_i with F̂_i = max(F_i, ε): the floor keeps a coordinate
that no model's Fisher covers from dividing by zero, and makes it the plain weighted
average there (all F̂_i = ε). With ε = 0 a coordinate whose Σ w_i F_i is exactly zero
takes the plain weighted average Σ w_i θ_i / Σ w_i instead (the documented fallback).

The sums are accumulated one input at a time, so a caller never holds more than the
running numerator, the running denominator and one input's tensor and Fisher.
"""

from __future__ import annotations

import torch

from graftmerge.math.workspace import Workspace


class FisherAverage:
    """Running sums of one tensor's Fisher-weighted average; :meth:`add` each input, then :meth:`result`.

    With a :class:`~graftmerge.math.workspace.Workspace`, the sums and the inputs' dtype
    conversions live in its reused buffers (no fresh allocation per tensor), and the
    result is a view of one: copy it before the next tensor.
    """

    def __init__(self, epsilon: float, dtype: torch.dtype = torch.float32, workspace: Workspace | None = None):
        self.epsilon = epsilon
        self.dtype = dtype  # the sums' dtype: at least float32, whatever the inputs are
        self.workspace = workspace
        self.numerator: torch.Tensor | None = None  # Σ w F̂ θ
        self.denominator: torch.Tensor | None = None  # Σ w F̂
        self.plain: torch.Tensor | None = None  # Σ w θ, kept only when ε = 0 (the fallback needs it)
        self.weight_sum = 0.0

    def _scratch(self, slot: str, like: torch.Tensor) -> torch.Tensor:
        if self.workspace is None:
            return torch.empty(like.shape, dtype=self.dtype)
        return self.workspace.take(f"fisher-average-{slot}", like.shape, self.dtype)

    def add(self, tensor: torch.Tensor, fisher: torch.Tensor, weight: float) -> None:
        """One input: its tensor, its diagonal Fisher (same shape, ≥ 0) and its weight (≥ 0).

        ``fisher`` is consumed: floored (and, without a workspace, scaled) in place when it is
        already in the sums' dtype (a Fisher read from a cache is the caller's own copy).
        """
        if tensor.dtype != self.dtype:
            tensor = self._scratch("input", tensor).copy_(tensor)
        floored = fisher.to(self.dtype)
        if self.epsilon > 0:
            floored.clamp_min_(self.epsilon)
        if self.numerator is None:
            self.numerator = torch.mul(floored, tensor, out=self._scratch("numerator", tensor)).mul_(weight)
            if self.workspace is None:
                self.denominator = floored.mul_(weight)
            else:
                self.denominator = torch.mul(floored, weight, out=self._scratch("denominator", tensor))
        else:
            self.numerator.addcmul_(floored, tensor, value=weight)
            self.denominator.add_(floored, alpha=weight)
        if self.epsilon == 0:
            if self.plain is None:
                self.plain = torch.mul(tensor, weight, out=self._scratch("plain", tensor))
            else:
                self.plain.add_(tensor, alpha=weight)
        self.weight_sum += weight

    def result(self) -> torch.Tensor:
        """The merged tensor (in the sums' dtype); plain weighted average where Σ w F̂ is zero."""
        merged = self.numerator.div_(self.denominator)
        if self.plain is not None:
            empty = self.denominator == 0
            if bool(empty.any()):
                merged = torch.where(empty, self.plain / self.weight_sum, merged)
        return merged


def weighted_average(tensors: list[torch.Tensor], weights: list[float], dtype: torch.dtype = torch.float32
                     ) -> torch.Tensor:
    """Σ w_i θ_i / Σ w_i, accumulated in ``dtype``: what a tensor without Fisher (or Gram) information gets."""
    total = None
    for tensor, weight in zip(tensors, weights):
        scaled = tensor.to(dtype) * weight
        total = scaled if total is None else total.add_(scaled)
    return total.div_(sum(weights))


def fisher_average(tensors: list[torch.Tensor], fishers: list[torch.Tensor], weights: list[float],
                   epsilon: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The Fisher-weighted average of whole lists (for callers that hold them anyway)."""
    average = FisherAverage(epsilon, dtype)
    for tensor, fisher, weight in zip(tensors, fishers, weights):
        average.add(tensor, fisher, weight)
    return average.result()
