"""experiments.power: the noncentral t tail against scipy (where installed) and against simulation."""

from __future__ import annotations

import math

import pytest
import torch

from experiments.paired_tests import student_t_sf
from experiments.power import noncentral_t_sf, paired_t_power, seeds_needed, tost_power


@pytest.mark.parametrize("df, c, ncp", [(2, 4.3, 1.0), (11, 2.593, 3.46), (30, 2.0, 2.5), (9, -1.0, 0.3), (5, 1.5, -1)])
def test_noncentral_t_tail_matches_scipy(df: int, c: float, ncp: float) -> None:
    stats = pytest.importorskip("scipy.stats")
    assert noncentral_t_sf(c, df, ncp) == pytest.approx(float(stats.nct.sf(c, df, ncp)), abs=1e-8)


@pytest.mark.parametrize("df, c", [(2, 0.7), (7, 2.365), (11, -1.2)])
def test_zero_noncentrality_is_the_central_t(df: int, c: float) -> None:
    assert noncentral_t_sf(c, df, 0.0) == pytest.approx(student_t_sf(c, df), abs=1e-9)


def _simulated_power(n: int, difference: float, sd: float, critical: float, draws: int = 200_000) -> float:
    generator = torch.Generator().manual_seed(0)
    samples = difference + sd * torch.randn(draws, n, generator=generator, dtype=torch.float64)
    t = samples.mean(1) / (samples.std(1) / math.sqrt(n))
    return float((t.abs() > critical).double().mean())


def test_paired_power_matches_simulation() -> None:
    n, difference, sd, alpha = 12, 0.05, 0.05, 0.025
    critical = 2.593097  # t quantile 1 − α/2 = 0.9875, 11 df (tables)
    simulated = _simulated_power(n, difference, sd, critical)
    assert paired_t_power(n, difference, sd, alpha) == pytest.approx(simulated, abs=0.005)  # 200k draws: se 0.001


def test_tost_power_matches_simulation() -> None:
    n, margin, sd, alpha = 12, 0.05, 0.05, 0.05
    critical = 1.795885  # one-sided 0.95 quantile, 11 df
    generator = torch.Generator().manual_seed(1)
    for difference in (0.0, 0.02):
        samples = difference + sd * torch.randn(200_000, n, generator=generator, dtype=torch.float64)
        error = samples.std(1) / math.sqrt(n)
        mean = samples.mean(1)
        equivalent = ((mean + margin) / error > critical) & ((mean - margin) / error < -critical)
        simulated = float(equivalent.double().mean())
        assert tost_power(n, margin, sd, alpha, difference) == pytest.approx(simulated, abs=0.005)


def test_seeds_needed_is_the_first_n_with_enough_power() -> None:
    n = seeds_needed(0.05, 0.05, tests=2)
    assert paired_t_power(n, 0.05, 0.05, 0.025) >= 0.8 > paired_t_power(n - 1, 0.05, 0.05, 0.025)
    # the normal approximation ((z_{1−α/2} + z_{power}) σ/δ)² undercounts a t test by one or two
    z = (2.2414 + 0.8416) ** 2
    assert z < n <= z + 4
    assert seeds_needed(0.05, 0.04, tests=2) < n  # less noise, fewer seeds
    with pytest.raises(ValueError, match="no n"):
        seeds_needed(0.001, 1.0, most=20)
