"""The forgetting table of a stream of updates: average accuracy, backward and forward transfer.

Lopez-Paz & Ranzato (2017), with θ0 (the post model, before any step) in place of their
randomly initialised model. ``R`` has one row per model θ0 … θT and one column per step
1 … T: ``R[i][j-1]`` is θi's score on step j's tasks (each in [0, 1], higher better).

- ACC = (1/T) Σⱼ R[T][j]: how well the final model does on every step's tasks;
- BWT = 1/(T−1) Σ_{j<T} (R[T][j] − R[j][j]): what later steps did to earlier steps' scores
  (negative: forgetting);
- FWT = 1/(T−1) Σ_{j≥2} (R[j−1][j] − R[0][j]): what earlier steps did for a step's tasks before
  that step was learned.

With one step (T = 1) BWT and FWT have no term: they are None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Transfer:
    """ACC, BWT and FWT of one stream (BWT, FWT None for a single step)."""

    average_accuracy: float
    bwt: float | None
    fwt: float | None


def check_matrix(matrix: Sequence[Sequence[float]]) -> int:
    """T, the number of steps; ValueError unless ``matrix`` has T + 1 rows of T numbers, T ≥ 1."""
    steps = len(matrix) - 1
    if steps < 1 or any(len(row) != steps for row in matrix):
        raise ValueError(f"the step matrix needs T + 1 rows of T scores (T ≥ 1); got {[len(r) for r in matrix]}")
    return steps


def transfer(matrix: Sequence[Sequence[float]]) -> Transfer:
    """ACC, BWT and FWT of the step matrix ``matrix`` (rows θ0 … θT, columns steps 1 … T; module doc)."""
    steps = check_matrix(matrix)
    final = matrix[steps]
    accuracy = sum(final) / steps
    if steps == 1:
        return Transfer(accuracy, None, None)
    bwt = sum(final[j - 1] - matrix[j][j - 1] for j in range(1, steps)) / (steps - 1)
    fwt = sum(matrix[j - 1][j - 1] - matrix[0][j - 1] for j in range(2, steps + 1)) / (steps - 1)
    return Transfer(accuracy, bwt, fwt)


def group_means(row: Sequence[float], groups: Sequence[Sequence[int]],
                weights: Sequence[float]) -> list[float]:
    """One weighted mean per group of ``row``'s columns (``weights`` per column): a step's score from its tasks'."""
    means = []
    for columns in groups:
        total = sum(weights[c] for c in columns)
        if not columns or total <= 0:
            raise ValueError("every group needs at least one column of positive weight")
        means.append(sum(weights[c] * row[c] for c in columns) / total)
    return means
