"""experiments.paired_tests against numeric integration, closed forms, simulation and brute force."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from experiments.paired_tests import (
    equivalence_bound,
    holm,
    paired_t,
    student_t_cdf,
    student_t_quantile,
    student_t_sf,
    tost,
)


def density(x: float, df: int) -> float:
    """Student's t density, from its definition."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_c - (df + 1) / 2 * math.log1p(x * x / df))


def integrated_cdf(t: float, df: int, steps: int = 4000) -> float:
    """0.5 + ∫₀ᵗ density, composite Simpson in float64 (the distribution is symmetric)."""
    h = t / steps
    inner = sum((4 if i % 2 else 2) * density(i * h, df) for i in range(1, steps))
    return 0.5 + h / 3 * (density(0.0, df) + inner + density(t, df))


@pytest.mark.parametrize("df", range(1, 31))
def test_cdf_matches_numeric_integration(df: int) -> None:
    for t in (-7.5, -2.1, -0.3, 0.0, 0.7, 1.96, 4.3, 12.0):
        assert student_t_cdf(t, df) == pytest.approx(integrated_cdf(t, df), abs=1e-11)
        assert student_t_sf(t, df) == pytest.approx(1 - integrated_cdf(t, df), abs=1e-11)


@pytest.mark.parametrize("df", range(1, 31))
def test_quantile_inverts_the_integrated_cdf(df: int) -> None:
    for p in (0.6, 0.9, 0.95, 0.975, 0.995):
        q = student_t_quantile(p, df)
        assert integrated_cdf(q, df) == pytest.approx(p, abs=1e-10)
        assert student_t_quantile(1 - p, df) == -q


def test_quantile_closed_forms() -> None:
    """df 1 is Cauchy, tan(π(p − ½)); df 2 has t = (2p − 1)/√(2p(1 − p))."""
    for p in (0.55, 0.8, 0.95, 0.975, 0.999):
        assert student_t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-12)
        assert student_t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-12)


def test_tail_keeps_small_p_values() -> None:
    assert student_t_sf(1e4, 3) > 0
    assert student_t_sf(40.0, 2) == pytest.approx(1 - integrated_cdf(40.0, 2, steps=40000), rel=1e-4)


@pytest.mark.parametrize("bad", [0, 2.5, -1])
def test_degrees_of_freedom_must_be_positive_integers(bad: float) -> None:
    with pytest.raises(ValueError, match="degrees of freedom"):
        student_t_cdf(1.0, bad)


def test_paired_t_interval_is_the_set_of_means_the_test_keeps() -> None:
    """At either end of the 95 % interval the two-sided p-value of H0: μ = end is exactly 0.05."""
    diffs = [0.031, -0.072, 0.010, 0.044]
    result = paired_t(diffs)
    assert result.mean == pytest.approx(statistics.fmean(diffs))
    assert result.sd == pytest.approx(statistics.stdev(diffs))
    for end in (result.low, result.high):
        assert paired_t([d - end for d in diffs]).p == pytest.approx(0.05, abs=1e-9)
    assert result.verdict == "inconclusive"
    assert paired_t([0.2, 0.25, 0.3]).verdict == "positive"
    assert paired_t([-0.2, -0.25, -0.3]).verdict == "negative"


def test_paired_t_with_three_seeds_covers_and_rejects_at_the_stated_rates() -> None:
    """n = 3 normal samples: the 95 % interval covers the true mean 95 % of the time, p < 0.05 5 %."""
    rng = random.Random(0)
    trials, covered, rejected = 20000, 0, 0
    for _ in range(trials):
        result = paired_t([rng.gauss(0.3, 0.05) for _ in range(3)])
        covered += result.low <= 0.3 <= result.high
        rejected += paired_t([rng.gauss(0.0, 0.05) for _ in range(3)]).p < 0.05
    assert covered / trials == pytest.approx(0.95, abs=0.006)
    assert rejected / trials == pytest.approx(0.05, abs=0.006)


def test_paired_t_degenerate_inputs() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        paired_t([0.1])
    flat = paired_t([0.1, 0.1, 0.1])
    assert (flat.low, flat.high, flat.p) == (pytest.approx(0.1), pytest.approx(0.1), 0.0)


def step_down_rejections(p_values: list[float], alpha: float) -> set[int]:
    """Holm's procedure as written: walk the sorted p-values, stop at the first p(k) > α/(m − k)."""
    rejected = set()
    for rank, index in enumerate(sorted(range(len(p_values)), key=lambda i: p_values[i])):
        if p_values[index] > alpha / (len(p_values) - rank):
            break
        rejected.add(index)
    return rejected


def test_holm_adjusted_p_values_reject_exactly_what_the_step_down_procedure_rejects() -> None:
    rng = random.Random(1)
    for _ in range(500):
        p_values = [rng.random() ** 3 for _ in range(rng.randint(1, 8))]
        adjusted = holm(p_values)
        assert all(1 >= a >= p for a, p in zip(adjusted, p_values))
        for alpha in (0.01, 0.05, 0.1):
            assert {i for i, a in enumerate(adjusted) if a <= alpha} == step_down_rejections(p_values, alpha)


def test_tost_agrees_with_the_90_percent_interval() -> None:
    """TOST at α rejects both nulls exactly when the (1 − 2α) interval lies inside ±margin."""
    rng = random.Random(2)
    for _ in range(2000):
        diffs = [rng.gauss(rng.uniform(-0.1, 0.1), 0.05) for _ in range(rng.randint(2, 12))]
        margin = rng.uniform(0.01, 0.2)
        interval = paired_t(diffs, confidence=0.90)
        inside = -margin < interval.low and interval.high < margin
        assert tost(diffs, margin).equivalent == inside
        bound = equivalence_bound(diffs)
        assert tost(diffs, bound * (1 + 1e-9)).equivalent and not tost(diffs, bound * (1 - 1e-6)).equivalent


def test_tost_rejects_bad_margins() -> None:
    with pytest.raises(ValueError, match="margin"):
        tost([0.1, 0.2], 0.0)
