"""Small-sample inference on paired differences: Student t, paired-t intervals, Holm, TOST.

Numbers in, numbers out (plain floats: an experiment has a handful of seeds, not tensors).
scipy is not a dependency and ``torch.distributions.StudentT`` has no inverse CDF, so the
t distribution is computed here exactly for integer degrees of freedom (a paired test on
n seeds has n − 1): the CDF in closed form (finite sums in θ = atan(t/√ν)), the quantile
by bisection on it.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def _check_df(df: int) -> None:
    if int(df) != df or df < 1:
        raise ValueError(f"degrees of freedom must be a positive integer, got {df}")


def _central_mass(t: float, df: int) -> float:
    """P(−t < T < t) · sign(t) for T ~ t(df): the classical finite series in θ = atan(t/√df)."""
    theta = math.atan(t / math.sqrt(df))
    cos2, sin_theta = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 0:  # sinθ · (1 + ½cos²θ + (1·3)/(2·4)cos⁴θ + … up to cos^(df−2)θ)
        term = total = 1.0
        for k in range(1, df // 2):
            term *= cos2 * (2 * k - 1) / (2 * k)
            total += term
        return sin_theta * total
    if df == 1:
        return 2 * theta / math.pi
    term = total = 1.0  # (2/π)(θ + sinθ cosθ (1 + (2/3)cos²θ + (2·4)/(3·5)cos⁴θ + … up to cos^(df−3)θ))
    for k in range(1, (df - 1) // 2):
        term *= cos2 * (2 * k) / (2 * k + 1)
        total += term
    return 2 / math.pi * (theta + sin_theta * math.cos(theta) * total)


def student_t_cdf(t: float, df: int) -> float:
    """P(T ≤ t) for Student's t with integer ``df`` degrees of freedom."""
    _check_df(df)
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    return 0.5 + 0.5 * _central_mass(t, df)


def student_t_sf(t: float, df: int) -> float:
    """P(T > t), computed from the tail side so small p-values keep their digits."""
    _check_df(df)
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    return 0.5 - 0.5 * _central_mass(t, df) if t <= 0 else 0.5 * (1 - _central_mass(t, df))


@functools.lru_cache(maxsize=256)
def student_t_quantile(p: float, df: int) -> float:
    """The t with P(T ≤ t) = p (0 < p < 1), by bisection on :func:`student_t_cdf` to machine precision."""
    _check_df(df)
    if not 0 < p < 1:
        raise ValueError(f"a quantile needs 0 < p < 1, got {p}")
    if p < 0.5:
        return -student_t_quantile(1 - p, df)
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < p:
        low, high = high, high * 2
    for _ in range(200):
        middle = (low + high) / 2
        if middle in (low, high):
            break
        low, high = (middle, high) if student_t_cdf(middle, df) < p else (low, middle)
    return (low + high) / 2


@dataclass(frozen=True)
class PairedTest:
    """A one-sample t analysis of paired differences (one per seed): mean, spread, t, p, interval."""

    n: int
    mean: float
    sd: float  # sample sd (n − 1)
    t: float
    p: float  # two-sided, H0: mean difference = 0
    low: float  # confidence interval of the mean difference
    high: float
    confidence: float

    @property
    def verdict(self) -> str:
        """"positive" / "negative" when the interval excludes 0, else "inconclusive"."""
        if self.low > 0:
            return "positive"
        return "negative" if self.high < 0 else "inconclusive"


def paired_t(differences: Sequence[float], confidence: float = 0.95) -> PairedTest:
    """Paired t test and two-sided ``confidence`` interval from per-unit differences (n ≥ 2)."""
    n = len(differences)
    if n < 2:
        raise ValueError(f"a paired t interval needs at least 2 differences, got {n}")
    mean, sd = statistics.fmean(differences), statistics.stdev(differences)
    error = sd / math.sqrt(n)
    if error == 0:
        t = 0.0 if mean == 0 else math.copysign(math.inf, mean)
        p = 1.0 if mean == 0 else 0.0
    else:
        t = mean / error
        p = min(1.0, 2 * student_t_sf(abs(t), n - 1))
    half = student_t_quantile(0.5 + confidence / 2, n - 1) * error
    return PairedTest(n, mean, sd, t, p, mean - half, mean + half, confidence)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values (same order as given): reject where adjusted ≤ α."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted = [0.0] * len(p_values)
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


@dataclass(frozen=True)
class Equivalence:
    """Two one-sided tests (TOST) of |mean difference| < margin."""

    margin: float
    p: float  # the larger of the two one-sided p-values
    alpha: float

    @property
    def equivalent(self) -> bool:
        """Both one-sided nulls (mean ≤ −margin, mean ≥ margin) rejected at ``alpha``."""
        return self.p < self.alpha


def tost(differences: Sequence[float], margin: float, alpha: float = 0.05) -> Equivalence:
    """TOST on paired differences: equivalent within ±``margin`` when both one-sided t tests reject."""
    if margin <= 0:
        raise ValueError(f"an equivalence margin must be positive, got {margin}")
    n = len(differences)
    if n < 2:
        raise ValueError(f"TOST needs at least 2 differences, got {n}")
    mean, error = statistics.fmean(differences), statistics.stdev(differences) / math.sqrt(n)
    if error == 0:
        return Equivalence(margin, 0.0 if abs(mean) < margin else 1.0, alpha)
    above_lower = student_t_sf((mean + margin) / error, n - 1)  # H0: mean ≤ −margin
    below_upper = student_t_cdf((mean - margin) / error, n - 1)  # H0: mean ≥ +margin
    return Equivalence(margin, max(above_lower, below_upper), alpha)


def equivalence_bound(differences: Sequence[float], alpha: float = 0.05) -> float:
    """The smallest margin TOST at ``alpha`` would call equivalent: the far end of the (1 − 2α) interval."""
    interval = paired_t(differences, confidence=1 - 2 * alpha)
    return max(abs(interval.low), abs(interval.high))
