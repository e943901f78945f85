"""Inputs and dense float64 references for the fisher and regmean merge methods.

Each architecture's tiny models get caches of kind ``both``: a random non-negative diagonal
for every tensor and KFAC factors (random SPD, kept here as written) for every 2-D weight,
the input side shared by weights of the same input size as the estimator shares q/k/v's.
The references recompute the merges from those original factors, in float64, with the
layout rule written out by hand: a torch Linear's input Gram is its columns factor, a GPT-2
Conv1D's its rows factor, and embeddings are averaged.
"""

from __future__ import annotations

from pathlib import Path

import torch

from graftmerge.demo.tiny_models import save_tiny_model
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.fisher_cache import FisherCacheWriter
from tests.helpers.fisher_caches import spd

# name → (architecture, config overrides): Qwen3 with a tied head, Llama untied, GPT-2 (Conv1D)
ARCHITECTURES = {
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "llama-untied": ("llama", {"tie_word_embeddings": False}),
    "gpt2": ("gpt2", {}),
}
CONV1D = ("c_attn", "c_proj", "c_fc")


def input_side(architecture: str, name: str) -> str | None:
    """Which factor is the input Gram of weight ``name`` (None: not a linear weight, averaged)."""
    module = name.rsplit(".", 2)
    if not name.endswith(".weight") or "embed" in name or name.split(".")[-2] in ("wte", "wpe"):
        return None
    if architecture == "gpt2" and module[-2] in CONV1D:
        return "rows"
    if module[-2].endswith("proj") or module[-2] == "lm_head":
        return "columns"
    return None


def make_models(root: Path, key: str, count: int = 3) -> list[Path]:
    """``count`` related models of one architecture (a common base plus noise)."""
    architecture, overrides = ARCHITECTURES[key]
    base = save_tiny_model(root / "m0", seed=10, architecture=architecture, **overrides)
    for index in range(1, count):
        save_tiny_model(root / f"m{index}", seed=10 + index, base=base, noise=0.1, architecture=architecture,
                        **overrides)
    return [root / f"m{index}" for index in range(count)]


def write_both_cache(path: Path, model: Path, seed: int, zero=None, only_diagonal: bool = False,
                     singular: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A cache of kind both for ``model``; returns the KFAC factors written, (P, Q) by weight (float64).

    ``zero(name, diagonal)`` may zero parts of a diagonal; ``singular`` makes every input-side
    factor rank-deficient (rank 1).
    """
    generator = torch.Generator().manual_seed(seed)
    factors, shared = {}, {}
    with FisherCacheWriter(path, model=model, overwrite=True) as writer:
        for name, info in sorted(Checkpoint(model).tensors.items()):
            diagonal = torch.rand(info.shape, generator=generator) ** 2
            writer.add_diagonal(name, zero(name, diagonal) if zero else diagonal)
            if len(info.shape) != 2 or only_diagonal:
                continue
            rows, columns = info.shape
            P = shared.setdefault(("rows", rows), _factor(rows, generator, singular))
            Q = shared.setdefault(("columns", columns), _factor(columns, generator, singular))
            writer.add_kfac(name, P=P, Q=Q)
            factors[name] = (P, Q)
    return factors


def _factor(size: int, generator: torch.Generator, singular: bool) -> torch.Tensor:
    if singular:
        vector = torch.randn(size, 1, generator=generator, dtype=torch.float64)
        return vector @ vector.T
    return spd(size, generator)


def dense_fisher(models: list[dict], fishers: list[dict], weights: list[float], epsilon: float) -> dict:
    """θ = Σ w max(F, ε) θ / Σ w max(F, ε) in float64 (plain weighted average where that sum is 0)."""
    merged = {}
    for name in models[0]:
        thetas = [m[name].double() for m in models]
        floors = [w * f[name].double().clamp_min(epsilon) for f, w in zip(fishers, weights)]
        denominator = sum(floors)
        plain = sum(w * t for w, t in zip(weights, thetas)) / sum(weights)
        with torch.no_grad():
            weighted = sum(f * t for f, t in zip(floors, thetas)) / denominator
        merged[name] = torch.where(denominator == 0, plain, weighted)
    return merged


def dense_regmean(architecture: str, models: list[dict], factors: list[dict], weights: list[float],
                  alpha: float) -> dict:
    """W = (Σ w W G̃)(Σ w G̃)⁻¹ per Linear, (Σ w G̃)⁻¹ Σ w G̃ W per Conv1D, average elsewhere; float64."""
    merged = {}
    for name in models[0]:
        side = input_side(architecture, name) if name in factors[0] else None
        thetas = [m[name].double() for m in models]
        if side is None:
            merged[name] = sum(w * t for w, t in zip(weights, thetas)) / sum(weights)
            continue
        grams = []
        for cache_factors, w in zip(factors, weights):
            G = cache_factors[name][1 if side == "columns" else 0].double()
            grams.append(w * (alpha * G + (1 - alpha) * torch.diag(G.diagonal())))
        total = sum(grams)
        if side == "columns":  # W (out × in): W Σ G̃ = Σ W_i G̃_i
            right = sum(t @ g for t, g in zip(thetas, grams))
            merged[name] = torch.linalg.solve(total, right.T).T
        else:  # Conv1D W (in × out): Σ G̃ W = Σ G̃_i W_i
            merged[name] = torch.linalg.solve(total, sum(g @ t for t, g in zip(thetas, grams)))
    return merged


def config(method: str, models: list[Path], caches: list[Path], weights: list[float], **parameters) -> str:
    """A fisher / regmean config (float32 throughout)."""
    lines = [f"merge_method: {method}", "dtype: float32", "models:"]
    for model, cache, weight in zip(models, caches, weights):
        lines += [f"  - model: {model}", f"    parameters: {{fisher: {cache}, weight: {weight}}}"]
    if parameters:
        lines.append("parameters:")
        lines += [f"  {key}: {value}" for key, value in parameters.items()]
    return "\n".join(lines) + "\n"
