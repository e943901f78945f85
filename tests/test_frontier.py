"""The sweep's selection math (graftmerge.math.frontier) against brute force over random grids with ties."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from graftmerge.math.frontier import SLACK, choose, pareto_frontier, qualifies


def random_grid(seed: int, size: int, levels: int, failures: float = 0.15):
    """Scores on a coarse grid (k/levels: many exact ties), some failed (NaN); λ and ρ from small sets."""
    rng = random.Random(seed)
    old = [rng.randrange(levels + 1) / levels for _ in range(size)]
    new = [rng.randrange(levels + 1) / levels for _ in range(size)]
    for i in range(size):
        if rng.random() < failures:
            (old if rng.random() < 0.5 else new)[i] = math.nan
    pairs = rng.sample(list(itertools.product([0.25, 0.5, 1.0, 2.0], [0.0, 0.001, 0.01, 0.1])), size)
    return old, new, [p[0] for p in pairs], [p[1] for p in pairs]


def brute_frontier(old, new) -> set[int]:
    ok = [i for i in range(len(old)) if math.isfinite(old[i]) and math.isfinite(new[i])]

    def dominates(a, b):
        return old[a] >= old[b] and new[a] >= new[b] and (old[a] > old[b] or new[a] > new[b])

    return {b for b in ok if not any(dominates(a, b) for a in ok)}


def brute_choice(old, new, lambdas, rhos, post_old, tolerance):
    eligible = [i for i in range(len(old)) if math.isfinite(old[i]) and math.isfinite(new[i])
                and old[i] >= post_old - tolerance - SLACK]
    if not eligible:
        return None
    top = max(new[i] for i in eligible)
    tied = [i for i in eligible if new[i] == top]
    smallest_lambda = min(lambdas[i] for i in tied)
    tied = [i for i in tied if lambdas[i] == smallest_lambda]
    return min(tied, key=lambda i: (rhos[i], i))


@pytest.mark.parametrize("seed", range(60))
def test_frontier_and_choice_equal_brute_force(seed):
    size = 1 + seed % 16
    old, new, lambdas, rhos = random_grid(seed, size, levels=1 + seed % 5)
    frontier = pareto_frontier(old, new)
    assert set(frontier) == brute_frontier(old, new)
    assert len(frontier) == len(set(frontier))
    assert [(new[i], -old[i]) for i in frontier] == sorted((new[i], -old[i]) for i in frontier)
    post_old = random.Random(seed).randrange(6) / 5
    for tolerance in (0.0, 0.2, 0.5, 1.0):
        got = choose(old, new, lambdas, rhos, post_old, tolerance)
        assert got == brute_choice(old, new, lambdas, rhos, post_old, tolerance), (seed, tolerance)


def test_ties_go_to_smaller_lambda_then_smaller_rho():
    old, new = [0.9, 0.9, 0.9, 0.9], [0.5, 0.5, 0.5, 0.4]
    assert choose(old, new, [1.0, 0.5, 0.5, 0.25], [0.0, 0.01, 0.001, 0.0], 0.9, 0.0) == 2


def test_the_tolerance_band_is_inclusive_despite_rounding():
    assert 0.8 - 0.1 > 0.7  # what the slack is for
    assert qualifies(0.7, 0.8, 0.1) and not qualifies(0.69, 0.8, 0.1)
    assert choose([0.7, 0.69], [0.3, 0.9], [1.0, 1.0], [0.0, 0.1], 0.8, 0.1) == 0


def test_no_qualifying_or_only_failed_points_choose_nothing():
    assert choose([0.1, 0.2], [0.9, 0.9], [1.0, 2.0], [0.0, 0.0], 0.9, 0.05) is None
    assert choose([math.nan, 0.95], [0.9, math.nan], [1.0, 2.0], [0.0, 0.0], 0.9, 0.05) is None
    assert pareto_frontier([math.nan], [0.5]) == [] and pareto_frontier([], []) == []


def test_equal_points_are_both_on_the_frontier_and_dominated_ones_are_not():
    old, new = [0.5, 0.5, 0.4, 0.9, 0.2], [0.5, 0.5, 0.5, 0.1, 0.9]
    assert pareto_frontier(old, new) == [3, 0, 1, 4]


def legend_of(figure) -> list[str]:
    return [text.get_text() for text in figure.axes[0].get_legend().get_texts()]


def test_the_picture_keys_every_lambda_by_its_size_and_every_rho_by_its_colour():
    from graftmerge.pipeline.frontier_plot import PlotPoint, frontier_figure

    points = [PlotPoint(lam, rho, old=0.9 - 0.1 * lam - rho, new=0.2 + 0.3 * lam + rho)
              for lam in (0.25, 0.5, 1.0) for rho in (0.0, 0.01)]
    figure = frontier_figure(points, (0.9, 0.2), frontier=[0, 3, 5], chosen=3, tolerance=0.1)
    entries = legend_of(figure)
    assert [e for e in entries if e.startswith("λ = ")] == ["λ = 0.25", "λ = 0.5", "λ = 1"]
    assert [e for e in entries if e.startswith("ρ = ")] == ["ρ = 0", "ρ = 0.01"]
    assert "Pareto frontier (λ, ρ)" in entries
    key = {e: h for e, h in zip(entries, figure.axes[0].get_legend().legend_handles)}
    sizes = [key[f"λ = {lam:g}"].get_sizes()[0] for lam in (0.25, 0.5, 1.0)]
    first_rho = figure.axes[0].collections[0]  # the ρ = 0 points, in λ order
    drawn = dict(zip((0.25, 0.5, 1.0), first_rho.get_sizes()))
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1] and sizes == [drawn[lam] for lam in (0.25, 0.5, 1.0)]


def test_a_frontier_of_one_point_has_no_line_and_no_legend_entry_for_one():
    from graftmerge.pipeline.frontier_plot import PlotPoint, frontier_figure

    points = [PlotPoint(0.5, 0.0, old=0.85, new=0.6), PlotPoint(1.0, 0.0, old=0.5, new=0.3)]
    figure = frontier_figure(points, (0.9, 0.2), frontier=[0], chosen=0, tolerance=0.1)
    assert "Pareto frontier (λ, ρ)" not in legend_of(figure)
    assert not figure.axes[0].get_lines()[1:]  # the τ line alone
