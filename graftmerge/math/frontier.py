"""Choosing a grid point from its old-role and new-role scores: the tolerance rule and the Pareto frontier.

Numbers in, numbers out. A point is a pair of normalised role scores (higher is better)
with its (λ, ρ); a point with a non-finite score (its evaluation failed) takes no part:
it is never chosen, is on no frontier and dominates nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Scores are means of per-example scores (k/n): without slack, binary rounding would shut out a point
# exactly τ below θpost (0.8 − 0.1 = 0.7000000000000001 > 0.7). Far below any real difference.
SLACK = 1e-9


def qualifies(old: float, post_old: float, tolerance: float) -> bool:
    """Whether an old-role score is within ``tolerance`` of θpost's: old ≥ post_old − τ (up to :data:`SLACK`)."""
    return math.isfinite(old) and old >= post_old - tolerance - SLACK


def choose(old: Sequence[float], new: Sequence[float], lambdas: Sequence[float], rhos: Sequence[float],
           post_old: float, tolerance: float) -> int | None:
    """Index of the highest new-role score among points that :func:`qualifies`; None when none does.

    Ties go to the smaller λ, then the smaller ρ (then the earlier index): the least
    change to θpost among equally good points. Points with a non-finite score never qualify.
    """
    best, best_key = None, None
    for index, (old_score, new_score) in enumerate(zip(old, new, strict=True)):
        if not (math.isfinite(new_score) and qualifies(old_score, post_old, tolerance)):
            continue
        key = (-new_score, lambdas[index], rhos[index], index)
        if best_key is None or key < best_key:
            best, best_key = index, key
    return best


def pareto_frontier(old: Sequence[float], new: Sequence[float]) -> list[int]:
    """Indices of the points no other point dominates, by new-role score ascending (then old descending).

    ``a`` dominates ``b`` when it is at least as good in both roles and better in one;
    points with equal scores do not dominate each other, so both are on the frontier.
    O(n log n): scanned from the highest new-role score down, a point is on the frontier
    when its old-role score beats every point with a strictly higher new-role score, and
    is not below a point with the same new-role score.
    """
    finite = [i for i in range(len(old)) if math.isfinite(old[i]) and math.isfinite(new[i])]
    order = sorted(finite, key=lambda i: (-new[i], -old[i], i))
    frontier, best_old, position = [], -math.inf, 0
    while position < len(order):
        same = [order[position]]  # every point with this new-role score (old descending)
        while position + len(same) < len(order) and new[order[position + len(same)]] == new[same[0]]:
            same.append(order[position + len(same)])
        top = old[same[0]]
        if top > best_old:
            frontier += [i for i in same if old[i] == top]
        best_old = max(best_old, top)
        position += len(same)
    return sorted(frontier, key=lambda i: (new[i], -old[i], i))


def hypervolume(old: Sequence[float], new: Sequence[float], reference: tuple[float, float] = (0.0, 0.0)) -> float:
    """Area of the score plane dominated by the points and above ``reference`` (old, new): how much of the
    trade-off a set of points reaches, one number to compare frontiers at equal evaluations (higher is better).

    Points with a non-finite score, or not above the reference in both roles, add nothing.
    Swept from the highest new-role score down: each point adds the strip between the best
    old-role score seen so far and its own, as tall as its new-role score above the reference.
    """
    ref_old, ref_new = reference
    points = sorted(((n, o) for o, n in zip(old, new, strict=True)
                     if math.isfinite(o) and math.isfinite(n) and o > ref_old and n > ref_new), reverse=True)
    area, reached = 0.0, ref_old
    for new_score, old_score in points:
        if old_score > reached:
            area += (old_score - reached) * (new_score - ref_new)
            reached = old_score
    return area
