"""Power of a paired t test: how many seeds an experiment needs before it is run.

Numbers in, numbers out. The paired t statistic on n differences with mean δ and sd σ
follows a noncentral t with n − 1 degrees of freedom and noncentrality δ√n/σ. Its tail
is computed by conditioning on the sample sd: with S = √(V/ν), V ~ χ²(ν),
P(T > c) = E[Φ(ncp − c·S)], a one-dimensional integral over S done here by Simpson's
rule (scipy is not a dependency). The test module checks it against scipy's ``nct``
where scipy is installed and against a simulation.
"""

from __future__ import annotations

import math

from experiments.paired_tests import student_t_quantile

_INTERVALS = 4000  # Simpson intervals over S; the integrand is smooth, so this is far below 1e-9 error


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def _sd_density(s: float, df: int) -> float:
    """Density of S = √(V/df), V ~ χ²(df), at ``s`` > 0 (in logs: df up to hundreds stays finite)."""
    if s <= 0:
        return 0.0
    half = df / 2
    log_density = (math.log(2) + half * math.log(half) - math.lgamma(half) + (df - 1) * math.log(s)
                   - half * s * s)
    return math.exp(log_density)


def noncentral_t_sf(c: float, df: int, noncentrality: float) -> float:
    """P(T > c) for T a noncentral t with ``df`` degrees of freedom and the given noncentrality."""
    if int(df) != df or df < 1:
        raise ValueError(f"degrees of freedom must be a positive integer, got {df}")
    upper = 1 + 12 / math.sqrt(df)  # S concentrates at 1 with sd ≈ 1/√(2 df); far tail negligible
    upper = max(upper, 8.0) if df < 4 else upper
    step = upper / _INTERVALS
    total = 0.0
    for i in range(_INTERVALS + 1):
        s = i * step
        weight = 1 if i in (0, _INTERVALS) else (4 if i % 2 else 2)
        total += weight * _normal_cdf(noncentrality - c * s) * _sd_density(s, df)
    return min(1.0, max(0.0, total * step / 3))


def paired_t_power(n: int, difference: float, sd: float, alpha: float = 0.05, two_sided: bool = True) -> float:
    """Probability that a paired t test on ``n`` differences (true mean ``difference``, sd ``sd``) rejects at ``alpha``.

    Two-sided: either tail counts (the wrong-sign tail is included, as in the usual
    definition); one-sided: only the tail of ``difference``'s sign.
    """
    if n < 2:
        raise ValueError(f"a paired t test needs at least 2 differences, got {n}")
    if sd <= 0:
        raise ValueError(f"the sd of the differences must be positive, got {sd}")
    df = n - 1
    critical = student_t_quantile(1 - (alpha / 2 if two_sided else alpha), df)
    noncentrality = abs(difference) * math.sqrt(n) / sd
    power = noncentral_t_sf(critical, df, noncentrality)
    if two_sided:
        power += noncentral_t_sf(critical, df, -noncentrality)  # P(T < −c) = P(−T > c), −T has ncp −ncp
    return min(1.0, power)


def seeds_needed(difference: float, sd: float, alpha: float = 0.05, power: float = 0.8, tests: int = 1,
                 two_sided: bool = True, most: int = 1000) -> int:
    """The smallest n whose paired t test reaches ``power`` at level ``alpha / tests``.

    ``tests``: the size of the Holm family. Holm's first (strictest) step is Bonferroni's,
    so power at ``alpha / tests`` is a lower bound on the power of the test Holm ranks
    first, whichever it is.
    """
    for n in range(2, most + 1):
        if paired_t_power(n, difference, sd, alpha / tests, two_sided) >= power:
            return n
    raise ValueError(f"no n ≤ {most} reaches power {power} for a difference {difference} with sd {sd}")


def tost_power(n: int, margin: float, sd: float, alpha: float = 0.05, difference: float = 0.0) -> float:
    """Probability that TOST on ``n`` paired differences (true mean ``difference``) declares equivalence within ±margin.

    Both one-sided tests must reject: T_low = (m + margin)/se > c and T_high = (m − margin)/se < −c
    with c the one-sided t quantile. Computed by conditioning on S as :func:`noncentral_t_sf`:
    given S = s, the mean must lie in (−margin + c·se, margin − c·se) with se = σ·s/√n.
    """
    if n < 2 or sd <= 0 or margin <= 0:
        raise ValueError("TOST power needs n ≥ 2, a positive sd and a positive margin")
    df = n - 1
    critical = student_t_quantile(1 - alpha, df)
    root_n = math.sqrt(n)
    upper = max(1 + 12 / math.sqrt(df), 8.0 if df < 4 else 0.0)
    step = upper / _INTERVALS
    total = 0.0
    for i in range(_INTERVALS + 1):
        s = i * step
        half_width = margin - critical * sd * s / root_n
        if half_width <= 0:
            continue
        z_high = (half_width - difference) * root_n / sd
        z_low = (-half_width - difference) * root_n / sd
        weight = 1 if i in (0, _INTERVALS) else (4 if i % 2 else 2)
        total += weight * (_normal_cdf(z_high) - _normal_cdf(z_low)) * _sd_density(s, df)
    return min(1.0, max(0.0, total * step / 3))
