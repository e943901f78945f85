"""Rules that propose ρ and λ from the removed-share curve and a KL budget. Numbers in, numbers out.

ρ: the knee of ``R(ρ)``, the share of the Fisher-weighted update ``Σ s`` that the ρ mask
removes, read on a log grid of ρ (Kneedle for a concave increasing curve).

λ: the largest global ``lambda`` (at most ``λ_max``) whose predicted per-token KL on the
old task stays within a budget κ. Why the prediction is ``(T̄/2)·λ²·Δ'ᵀFΔ'``:

The retention Fisher (docs/math.md#the-estimator) is ``F = (1/N) Σ_n g_n g_nᵀ`` with
``g_n = ∇L_n = −(1/T_n) Σ_t ∇log p(y_{n,t} | z_n, y_{n,<t})`` and completions sampled
from θpost itself. Write ``e_t = ∇log p(y_t | prefix)``. Given the prefix, ``e_t`` has
mean zero (the expected score of a model's own samples), and for ``t' < t`` the score
``e_{t'}`` is fixed by that prefix, so ``E[e_t e_{t'}ᵀ] = 0`` for ``t ≠ t'``: the cross
terms of ``g_n g_nᵀ`` vanish in expectation and
``E[g_n g_nᵀ] = (1/T_n²) Σ_t F_t`` with ``F_t = E[e_t e_tᵀ]`` the Fisher of one
position. The per-token KL of a small step δ is, to second order,
``(1/T) Σ_t ½ δᵀ F_t δ = ½ δᵀ F_tok δ`` with ``F_tok = (1/T) Σ_t F_t`` the per-token
mean Fisher. With ``T_n ≈ T̄``, ``F ≈ F_tok / T̄``, hence
``KL_token ≈ ½ δᵀ F_tok δ = (T̄/2) δᵀ F δ``, and for ``δ = λ Δ'``:
``KL ≈ (T̄/2) λ² Δ'ᵀFΔ'``. (Strictly, rollouts of unequal length weigh ``1/T_n²``; the
arithmetic mean T̄ is the approximation used.) Solving ``KL = κ`` gives
``λ* = sqrt(2κ / (T̄ · Δ'ᵀFΔ'))``, capped at ``λ_max``.

The masked quadratic form needs no second pass: with an orthonormal eigenbasis the
directions are F-orthogonal, so ``Δ'ᵀFΔ' = Σ_{unmasked} s = Σ s − Σ_{masked} s``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

SATURATED = 1e-6  # R(ρ_min) ≥ 1 − this: the smallest ρ already removes (almost) everything
FLAT = 1e-12  # a curve whose values span no more than this is flat


def default_rho_grid(low_exponent: int = -5, high: float = 0.5) -> list[float]:
    """1, 2, 5 per decade from ``10**low_exponent`` up to ``high``: 1e-5, 2e-5, 5e-5, ..., 0.2, 0.5.

    Round values, so the suggested ρ pastes into a config as typed.
    """
    grid = []
    exponent = low_exponent
    while True:
        for mantissa in (1, 2, 5):
            value = float(f"{mantissa}e{exponent}")
            if value > high:
                return grid
            grid.append(value)
        exponent += 1


def check_rho_grid(rhos: Sequence[float]) -> None:
    """A log grid: every ρ finite, in (0, 1), strictly increasing. ValueError otherwise."""
    if not rhos:
        raise ValueError("the ρ grid is empty")
    for rho in rhos:
        if not (math.isfinite(rho) and 0 < rho < 1):
            raise ValueError(f"every ρ of a log grid must be in (0, 1), got {rho!r}")
    if any(b <= a for a, b in zip(rhos, rhos[1:])):
        raise ValueError("the ρ grid must be strictly increasing")


@dataclass(frozen=True)
class Knee:
    """The suggested ρ: a grid point (``index``), or 0 (``index`` None) when nothing is removed.

    ``found``: a true knee (a grid point strictly above the chord of the normalised
    curve); otherwise ``reason`` says which edge case chose ``rho``.
    ``differences``: ``R_norm − x_norm`` per grid point (empty in the edge cases).
    """

    rho: float
    index: int | None
    found: bool
    reason: str
    differences: tuple[float, ...] = ()


def normalise(values: Sequence[float]) -> list[float]:
    """Affine map of ``values`` onto [0, 1] (min → 0, max → 1); all zeros when they are all equal."""
    low, high = min(values), max(values)
    if high - low <= 0:
        return [0.0 for _ in values]
    return [(v - low) / (high - low) for v in values]


def kneedle_differences(rhos: Sequence[float], removed: Sequence[float]) -> list[float]:
    """``R_norm − x_norm`` at each grid point, x = log10 ρ; both normalised to [0, 1] over the grid."""
    x = normalise([math.log10(rho) for rho in rhos])
    r = normalise(list(removed))
    return [ri - xi for ri, xi in zip(r, x)]


def removed_share_knee(rhos: Sequence[float], removed: Sequence[float]) -> Knee:
    """The knee of R(ρ) on a log grid of ρ (Kneedle: the point farthest above the chord).

    ``rhos`` strictly increasing in (0, 1); ``removed[i] = R(rhos[i])`` in [0, 1],
    non-decreasing in ρ (nested masks). Edge cases, in this order:

    - R is 0 everywhere: nothing is removed at any ρ, so ρ = 0 (no mask).
    - One grid point: no curve; that ρ.
    - R(ρ_min) ≥ 1 − 1e-6: the smallest ρ already removes ~all of Σ s; the smallest ρ
      (a grid reaching lower may find a smaller one).
    - R flat (span ≤ 1e-12): no knee; the smallest ρ.
    - No point strictly above the chord (R convex or straight in log ρ): no knee; the
      smallest ρ, the most conservative mask of the grid.

    Otherwise the grid point maximising ``R_norm − x_norm`` (ties: the smaller ρ).
    """
    check_rho_grid(rhos)
    if len(removed) != len(rhos):
        raise ValueError(f"{len(rhos)} grid points but {len(removed)} removed shares")
    for value in removed:
        if not (math.isfinite(value) and -FLAT <= value <= 1 + 1e-9):
            raise ValueError(f"a removed share must be in [0, 1], got {value!r}")
    if max(removed) <= FLAT:
        return Knee(0.0, None, False, "the mask removes nothing at any ρ of the grid (Σ s has no positive "
                    "score to mask), so no mask is suggested: ρ = 0")
    if len(rhos) == 1:
        return Knee(rhos[0], 0, False, "a single grid point has no curve to take a knee of; it is returned as is")
    if removed[0] >= 1 - SATURATED:
        return Knee(rhos[0], 0, False, f"the smallest ρ of the grid already removes {100 * removed[0]:.4g}% of "
                    "Σ s; extend the grid downward to find a smaller ρ")
    if max(removed) - min(removed) <= FLAT:
        return Knee(rhos[0], 0, False, "R(ρ) is flat over the grid: no knee; the smallest ρ is suggested")
    differences = kneedle_differences(rhos, removed)
    best = max(range(len(rhos)), key=lambda i: (differences[i], -i))
    if differences[best] <= 0:
        return Knee(rhos[0], 0, False, "R(ρ) is not concave in log ρ on this grid (no point above the chord): "
                    "no knee; the smallest ρ is suggested", tuple(differences))
    return Knee(rhos[best], best, True, f"knee of R(ρ): R_norm − x_norm = {differences[best]:.3f} is largest "
                f"at ρ = {rhos[best]:g}", tuple(differences))


def remaining_mass(total: float, removed: float) -> float:
    """``Δ'ᵀFΔ' = Σ s − Σ_masked s`` (never below 0: the two sums round differently)."""
    return max(total - removed, 0.0)


def predicted_kl(lam: float, masked_quadratic: float, mean_tokens: float) -> float:
    """Second-order per-token KL on the old task of adding ``λ Δ'``: ``(T̄/2) λ² Δ'ᵀFΔ'``."""
    return 0.5 * mean_tokens * lam * lam * masked_quadratic


@dataclass(frozen=True)
class LambdaChoice:
    """The suggested global ``lambda``; ``bound``: 'budget' (KL = κ) or 'cap' (λ_max, KL ≤ κ)."""

    lam: float
    unclamped: float  # sqrt(2κ / (T̄ · Δ'ᵀFΔ')); inf when Δ'ᵀFΔ' = 0
    predicted_kl: float
    bound: str


def kl_budget_lambda(
    masked_quadratic: float, mean_tokens: float, budget: float, max_lambda: float = 1.0
) -> LambdaChoice:
    """``λ* = min(λ_max, sqrt(2κ / (T̄ · Δ'ᵀFΔ')))``: the largest λ whose predicted KL is within κ."""
    for label, value in (("KL budget", budget), ("max lambda", max_lambda), ("mean tokens", mean_tokens)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{label} must be a finite number > 0, got {value!r}")
    if not (math.isfinite(masked_quadratic) and masked_quadratic >= 0):
        raise ValueError(f"Δ'ᵀFΔ' must be a finite number ≥ 0, got {masked_quadratic!r}")
    unclamped = math.sqrt(2 * budget / (mean_tokens * masked_quadratic)) if masked_quadratic > 0 else math.inf
    lam, bound = (unclamped, "budget") if unclamped < max_lambda else (max_lambda, "cap")
    return LambdaChoice(lam, unclamped, predicted_kl(lam, masked_quadratic, mean_tokens), bound)
