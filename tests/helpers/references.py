"""Brute-force references: the whole-model graft and the global top-k mask, computed densely
and independently of graftmerge's streaming threshold; and the scores they are tested on."""

from __future__ import annotations

from fractions import Fraction
from math import ceil
from pathlib import Path
from typing import NamedTuple

import torch

from graftmerge.formats.fisher_cache import open_fisher_cache
from tests.helpers.models import read_model


class BruteForceGraft(NamedTuple):
    """What a whole-model brute force expects: outputs, and which directions it masked."""

    expected: dict[str, torch.Tensor]  # θpost + Δ' (float32)
    masks: dict[str, torch.Tensor]  # ranked tensors only: bool, shape of Δ (Δ̃ for KFAC)
    kinds: dict[str, str]  # ranked tensors only: "diagonal" or "kfac"


def _per_tensor(value, name: str) -> float:
    """A brute force's parameter: one number, or a function of the tensor's name (a per-layer schedule)."""
    return value(name) if callable(value) else value


def _weighted_sum(terms: list[tuple[torch.Tensor, float]]) -> torch.Tensor:
    """Σ w·x in float32, each term after the first added as ``a + w·x`` in one rounding (torch's ``add`` with
    ``alpha``): the float32 Δ of a graft of several fine-tunes, bit for bit."""
    (first, weight), *rest = terms
    total = first * weight
    for term, weight in rest:
        total = torch.add(total, term, alpha=weight)
    return total


def brute_force_graft(
    post: Path, donor: Path, fine_tunes, fisher: Path, rho, scope: str = "global", mask: str = "auto",
) -> BruteForceGraft:
    """The whole model flattened at once: every ranked direction scored, one stable sort, top ⌈ρ·D⌉.

    Written from docs/math.md (the masks, the threshold's tie rule), independently of graftmerge's
    streaming threshold: diagonal scores F⊙Δ², KFAC scores σ_i d_j Δ̃² with
    Δ̃ = UᵀΔV; tensors in name order, row-major coordinates; scores below
    float32's smallest normal never masked; tensors without a usable Fisher entry
    unranked and unmasked. KFAC: Δ' = Δ − U(1_S ⊙ Δ̃)Vᵀ.

    A fine-tune's weight (λ·weight) and, under ``scope="tensor"``, ``rho`` may be functions of the
    tensor's name: per-layer schedules, each tensor's Δ scaled by its own weights.
    """
    post_w, donor_w = read_model(post), read_model(donor)
    ft_w = [(read_model(p), w) for p, w in fine_tunes]
    cache = open_fisher_cache(fisher)
    names = sorted(post_w)
    deltas = {n: _weighted_sum([(ft[n].float() - donor_w[n].float(), _per_tensor(w, n)) for ft, w in ft_w])
              for n in names}
    kinds: dict[str, str] = {}
    for n in names:
        if mask == "auto":
            kind = cache.representation(n)
        elif mask == "kfac" and cache.has(n, "kfac"):
            kind = "kfac"
        else:
            kind = "diagonal" if cache.has(n, "diagonal") else None
        if kind:
            kinds[n] = kind
    ranked = [n for n in names if n in kinds]
    rotated, scores = {}, {}
    for n in ranked:
        if kinds[n] == "kfac":
            f = cache.kfac(n)
            left = deltas[n] if f.U is None else f.U.T @ deltas[n]
            rotated[n] = left if f.V is None else left @ f.V
            scores[n] = rotated[n].square() * f.S[:, None] * f.D[None, :]
        else:
            scores[n] = cache.diagonal(n) * deltas[n].square()

    def top(flat: torch.Tensor, rho: float) -> torch.Tensor:
        k = ceil(Fraction(repr(rho)) * flat.numel())
        chosen = torch.zeros_like(flat, dtype=torch.bool)
        chosen[torch.sort(flat, descending=True, stable=True).indices[:k]] = True
        return chosen & (flat >= torch.finfo(torch.float32).tiny)

    if scope == "global":
        flat_mask = top(torch.cat([scores[n].reshape(-1) for n in ranked]), rho)
        flat_masks = dict(zip(ranked, torch.split(flat_mask, [scores[n].numel() for n in ranked])))
    else:
        flat_masks = {n: top(scores[n].reshape(-1), _per_tensor(rho, n)) for n in ranked}
    masks = {n: flat_masks[n].reshape(scores[n].shape) for n in ranked}
    expected = {}
    for n in names:
        applied = deltas[n]
        if kinds.get(n) == "kfac":
            f = cache.kfac(n)
            part = torch.where(masks[n], rotated[n], 0.0)
            part = part if f.V is None else part @ f.V.T
            applied = applied - (part if f.U is None else f.U @ part)
        elif n in kinds:
            applied = applied.masked_fill(masks[n], 0)
        expected[n] = post_w[n].float() + applied
    return BruteForceGraft(expected, masks, kinds)


def brute_force_mask(scores: list[torch.Tensor], k: int) -> list[torch.Tensor]:
    """The k largest positive scores of the concatenation, ties to earlier positions."""
    flat = torch.cat([s.reshape(-1) for s in scores])
    order = torch.sort(flat, descending=True, stable=True).indices[:k]
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    chosen[order] = True
    chosen &= flat > 0
    return [c.reshape(s.shape) for c, s in zip(torch.split(chosen, [s.numel() for s in scores]), scores)]


def tied_scores(seed: int) -> dict[str, torch.Tensor]:
    """Scores with heavy ties and zeros (small integers times a power of two)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"a.weight": (7, 5), "b.bias": (11,), "c.weight": (4, 9), "d.weight": (3, 3, 2)}
    return {n: torch.randint(0, 4, s, generator=generator).float() * 0.125 for n, s in shapes.items()}


def continuous_scores(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"a": (40, 30), "b": (64,), "c": (17, 23)}
    return {n: torch.rand(s, generator=generator) ** 4 * 10 ** torch.randint(-8, 3, (1,), generator=generator).item()
            for n, s in shapes.items()}
