"""Propose the config's ``rho`` and ``lambda`` from the Fisher cache and the delta alone.

One :func:`~graftmerge.pipeline.mask_preview.plan_report` at ``lambda = 1`` (the config's per-model
weights, mask and rho_scope) gives, for every ρ of a log grid, the share ``R(ρ)`` of
``Σ s = ΔᵀFΔ`` that the mask removes and ``Δ'ᵀFΔ' = Σ s − Σ_masked s``. The rules
themselves live in :mod:`graftmerge.math.suggestion`.

``R(ρ)`` does not depend on the global λ: every score scales by λ², which keeps the
ranking (up to the float rounding of ``Δ(λ)`` against ``λ·Δ(1)`` and scores falling below
float32's smallest normal), so the curve at λ = 1 is the curve at the config's λ and at
the suggested one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from graftmerge.errors import GraftError
from graftmerge.math.suggestion import (
    check_rho_grid,
    default_rho_grid,
    kl_budget_lambda,
    remaining_mass,
    removed_share_knee,
)
from graftmerge.pipeline.config_files import read_graft_config
from graftmerge.pipeline.graft_plan import GraftInputs
from graftmerge.pipeline.mask_preview import plan_report

DEFAULT_KL_BUDGET = 0.05  # nats per completion token on the old task
DEFAULT_MAX_LAMBDA = 1.0


@dataclass
class Suggestion:
    """A suggested (ρ, λ) for a graft config and every number behind it (``to_dict`` for JSON)."""

    config: str
    fisher: str  # as written in the config (or --fisher)
    rho_scope: str
    mask: str
    directions: int  # D, ranked directions
    score_mass: float  # Σ s = ΔᵀFΔ at lambda = 1
    rho_grid: list[float]
    removed_share: list[float]  # R(ρ) per grid point
    knee_index: int | None  # grid index of the suggested ρ; None when ρ = 0
    knee_found: bool
    rho: float
    rho_reason: str
    removed_at_rho: float  # R(ρ*) (0 when ρ* = 0)
    masked_quadratic: float  # Δ'ᵀFΔ' at ρ*, lambda = 1
    mean_tokens: float  # T̄
    tokens_source: str
    kl_budget: float  # κ
    max_lambda: float
    lam: float
    lam_unclamped: float  # sqrt(2κ / (T̄ Δ'ᵀFΔ')); inf when Δ'ᵀFΔ' = 0
    lam_bound: str  # 'budget' or 'cap'
    predicted_kl: float  # (T̄/2) λ² Δ'ᵀFΔ'
    config_lambda: float
    config_rho: float
    notes: list[str] = field(default_factory=list)

    def snippet(self) -> str:
        """The config's ``parameters:`` block with the suggested lambda and rho."""
        lines = ["parameters:", f"  lambda: {self.lam:.6g}", f"  rho: {self.rho!r}"]
        if self.rho > 0:
            lines += [f"  fisher: {self.fisher}", f"  rho_scope: {self.rho_scope}", f"  mask: {self.mask}"]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """Every field, the snippet too, as JSON-ready values (an infinite lam_unclamped becomes None)."""
        data = dataclasses.asdict(self)
        if math.isinf(self.lam_unclamped):
            data["lam_unclamped"] = None  # JSON has no infinity
        data["snippet"] = self.snippet()
        return data


def mean_completion_tokens(counts: dict | None) -> tuple[float, str, str | None]:
    """(T̄, where it came from, a note when it fell back to 1) from a Fisher manifest's ``counts``."""
    counts = counts or {}
    sequences, tokens = counts.get("sequences"), counts.get("completion_tokens")
    valid = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                for v in (sequences, tokens))
    if valid:
        return tokens / sequences, f"{tokens:,} completion tokens / N = {sequences:,} rollouts (cache manifest)", None
    note = ("the Fisher cache manifest records no token counts (counts.sequences, counts.completion_tokens), "
            "so T̄ = 1 is assumed: the predicted KL is then a lower bound and λ may be too large by √T̄")
    return 1.0, "assumed (no token counts in the cache manifest)", note


def check_settings(kl_budget: float, max_lambda: float) -> None:
    """GraftError naming the option unless --kl-budget and --max-lambda are finite and positive."""
    for option, value in (("--kl-budget", kl_budget), ("--max-lambda", max_lambda)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise GraftError(f"{option} must be a finite number > 0, got {value!r}")


def open_suggestion_inputs(plan, fisher: str | None = None):
    """GraftInputs of ``plan`` at lambda = 1 with its (or ``fisher``'s) cache opened and checked."""
    fisher = fisher or plan.fisher
    if not fisher:
        raise GraftError("suggest needs a Fisher cache: the config has no `fisher:` parameter "
                         "(add one, or pass --fisher CACHE; see graftmerge fisher estimate)")
    # A positive ρ makes GraftInputs open and check the cache; the ρ itself is not used.
    return GraftInputs.open(dataclasses.replace(plan, lam=1.0, rho=0.5, fisher=fisher))


def suggest_graft(
    config_path: str,
    *,
    rho_grid: Sequence[float] | None = None,
    kl_budget: float = DEFAULT_KL_BUDGET,
    max_lambda: float = DEFAULT_MAX_LAMBDA,
    fisher: str | None = None,
    device: str = "cpu",
    progress: bool = True,
) -> Suggestion:
    """Suggest ``rho`` (knee of R(ρ)) and ``lambda`` (KL budget) for a graft config; nothing written.

    The config is checked exactly as a merge checks it. ``fisher`` supplies or
    overrides its ``fisher:``; ``rho_grid`` defaults to 1, 2, 5 per decade from 1e-5
    to 0.5. Raises GraftError for bad input.
    """
    check_settings(kl_budget, max_lambda)
    grid = _checked_rho_grid(rho_grid)
    _, _, plan = read_graft_config(config_path)
    inputs = open_suggestion_inputs(plan, fisher)
    report = plan_report(inputs, grid, device=device, progress=progress)

    removed_mass = [sum(t.tallies[rho].masked_score for t in report.tensors) for rho in grid]
    shares = [summary.removed_share for summary in report.rhos]
    knee = removed_share_knee(grid, shares)
    removed = removed_mass[knee.index] if knee.index is not None else 0.0
    quadratic = remaining_mass(report.mass, removed)
    mean_tokens, tokens_source, tokens_note = mean_completion_tokens(inputs.fisher.manifest.get("counts"))
    choice = kl_budget_lambda(quadratic, mean_tokens, kl_budget, max_lambda)
    notes = _suggestion_notes(inputs, tokens_note, choice.bound, max_lambda)

    return Suggestion(
        config=str(config_path),
        fisher=str(fisher or plan.fisher),
        rho_scope=plan.rho_scope,
        mask=plan.mask,
        directions=report.directions,
        score_mass=report.mass,
        rho_grid=list(grid),
        removed_share=shares,
        knee_index=knee.index,
        knee_found=knee.found,
        rho=knee.rho,
        rho_reason=knee.reason,
        removed_at_rho=shares[knee.index] if knee.index is not None else 0.0,
        masked_quadratic=quadratic,
        mean_tokens=mean_tokens,
        tokens_source=tokens_source,
        kl_budget=kl_budget,
        max_lambda=max_lambda,
        lam=choice.lam,
        lam_unclamped=choice.unclamped,
        lam_bound=choice.bound,
        predicted_kl=choice.predicted_kl,
        config_lambda=plan.lam,
        config_rho=plan.rho,
        notes=notes,
    )


def _checked_rho_grid(rho_grid: Sequence[float] | None) -> list[float]:
    """The ρ grid, sorted (default: :func:`default_rho_grid`); GraftError naming --rho-grid if invalid."""
    grid = sorted(rho_grid) if rho_grid is not None else default_rho_grid()
    try:
        check_rho_grid(grid)
    except ValueError as error:
        raise GraftError(f"--rho-grid: {error}") from None
    return grid


def _suggestion_notes(inputs: GraftInputs, tokens_note: str | None, lam_bound: str, max_lambda: float) -> list[str]:
    """Caveats on the prediction: no token counts, truncated KFAC bases, unranked tensors, a capped λ."""
    notes = [tokens_note] if tokens_note else []
    kfac = [name for name in inputs.ranked_names() if inputs.fisher_kind(name) == "kfac"]
    if any("rank" in inputs.fisher.kfac_side(name, side) for name in kfac for side in ("rows", "columns")):
        notes.append("the cache keeps only leading KFAC eigenvectors for some weights (fisher compress): "
                     "Δ'ᵀFΔ' counts the kept eigen-directions only, so the predicted KL is a lower bound")
    unranked = sum(1 for name, info in inputs.post.tensors.items() if info.is_floating and not inputs.fisher_kind(name))
    if unranked:
        notes.append(f"{unranked} floating tensor(s) have no Fisher entry: their Δ is grafted unmasked and "
                     "not counted in Δ'ᵀFΔ'")
    if lam_bound == "cap":
        notes.append(f"λ is capped at --max-lambda {max_lambda:g}; the predicted KL is below the budget")
    return notes


def format_suggestion(s: Suggestion) -> str:
    """The text report: R(ρ) per grid point (knee marked), the suggested ρ and λ, their inputs, a snippet."""
    lines = [
        f"graftmerge suggest: D = {s.directions:,} ranked directions, ΔᵀFΔ = Σ s = {s.score_mass:.6g} "
        f"(lambda 1, per-model weights as in the config; rho_scope {s.rho_scope}, mask {s.mask})",
        "",
        f"{'rho':>10}  {'R(rho)':>10}",
    ]
    for index, (rho, share) in enumerate(zip(s.rho_grid, s.removed_share)):
        marker = (
            "  <- knee"
            if index == s.knee_index and s.knee_found
            else ("  <- suggested" if index == s.knee_index else "")
        )
        lines.append(f"{rho:>10g}  {100 * share:>9.3f}%{marker}")
    lines += [
        "",
        f"rho    = {s.rho:g}   ({s.rho_reason})",
        f"lambda = {s.lam:.6g}   (" + (
            f"KL budget: sqrt(2κ / (T̄ · Δ'ᵀFΔ')) = {s.lam_unclamped:.6g}" if s.lam_bound == "budget"
            else f"--max-lambda; the budget allows {s.lam_unclamped:.6g}"
        ) + ")",
        f"  R(rho)  = {100 * s.removed_at_rho:.3f}% of Σ s removed by the mask",
        f"  Δ'ᵀFΔ'  = {s.masked_quadratic:.6g}   (Fisher-weighted update left after the mask, lambda 1)",
        f"  T̄       = {s.mean_tokens:.6g} completion tokens per rollout ({s.tokens_source})",
        f"  κ       = {s.kl_budget:g} nats/token (--kl-budget)",
        f"  predicted KL on the old task = (T̄/2)·λ²·Δ'ᵀFΔ' = {s.predicted_kl:.6g} nats/token",
    ]
    lines += [f"note: {note}" for note in s.notes]
    lines += ["", s.snippet()]
    return "\n".join(lines)
