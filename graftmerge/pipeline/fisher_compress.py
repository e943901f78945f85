"""Compact KFAC caches: keep the top-K eigenvectors of every factor side.

A full eigenbasis costs d² floats per side (a 151936-row side would not even
fit); a graft at small ρ masks mostly leading eigen-directions. ``compress_cache``
keeps, per side, the K eigenvectors with the largest eigenvalues (all eigenvalues
are kept, the kept ones first), so the merge scores and masks only the pairs
``u_i v_jᵀ`` of the kept block: D counts K_rows·K_cols pairs for such a weight.
The projection ``Δ' = Δ − U(1_S ⊙ UᵀΔV)Vᵀ`` is exact for any orthonormal U, V.

Sides with at most K eigenvectors are copied unchanged (same order, same bits),
so K = the largest side reproduces the original cache's merges bit for bit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from graftmerge.errors import GraftError
from graftmerge.formats.fisher_cache import (
    FisherCache,
    FisherCacheWriter,
    open_fisher_cache,
    side_rank,
)
from graftmerge.formats.output_folder import check_not_inputs
from graftmerge.math.mask_stats import block_share, pair_overlap
from graftmerge.pipeline.graft_plan import GraftInputs
from graftmerge.pipeline.mask_preview import score_pass, tensor_masks


@dataclass(frozen=True)
class SideSummary:
    """One factor side after compression: kept/total eigenvectors, kept share of Σ eigenvalues."""

    key: str
    size: int
    kept: int
    eigenvalue_share: float
    kept_indices: torch.Tensor | None  # in the source's order; None = unchanged


@dataclass
class CompressResult:
    """What compress_cache wrote: the folder, K, each side's summary and each KFAC weight's two side keys."""

    path: Path
    rank: int
    sides: dict[str, SideSummary] = field(default_factory=dict)
    weights: dict[str, tuple[str, str]] = field(default_factory=dict)  # KFAC weight → (rows key, columns key)


def truncate_side(vectors: torch.Tensor | None, values: torch.Tensor, rank: int
                  ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """(vectors, values, kept indices) keeping the ``rank`` largest-eigenvalue vectors. Pure.

    ``values`` lists every eigenvalue, the first ``vectors.shape[1]`` with a vector.
    Kept vectors come first, largest eigenvalue first (ties: earlier column first);
    then all other eigenvalues, largest first. A side with at most ``rank`` vectors
    (or a diagonal side) is returned unchanged with kept indices None.
    """
    if vectors is None or vectors.shape[1] <= rank:
        return vectors, values, None
    with_vectors = vectors.shape[1]
    order = torch.sort(values[:with_vectors], descending=True, stable=True).indices
    kept, dropped = order[:rank], order[rank:]
    rest = torch.cat([values[dropped], values[with_vectors:]])
    rest = torch.sort(rest, descending=True, stable=True).values
    return vectors[:, kept], torch.cat([values[kept], rest]), kept


def _largest_side(cache: FisherCache) -> int:
    sizes = [side_rank(cache.kfac_side(name, side)) for name in cache.names("kfac") for side in ("rows", "columns")
             if "eigenvectors" in cache.kfac_side(name, side)]
    return max(sizes, default=0)


def check_compress(source: str | Path, out: str | Path, rank: int) -> FisherCache:
    """Everything compress refuses, before any work: OUT an input, a missing/diagonal-only cache, bad K,
    existing OUT."""
    check_not_inputs(out, [("Fisher cache", source)])
    cache = open_fisher_cache(source)
    if not cache.names("kfac"):
        raise GraftError(
            f"Fisher cache {source} has no KFAC entries (kind {cache.kind}); only KFAC eigenbases can be compressed"
        )
    largest = _largest_side(cache)
    if largest == 0:
        raise GraftError(f"Fisher cache {source} has no KFAC side with eigenvectors (all sides are diagonal)")
    if not 1 <= rank <= largest:
        raise GraftError(f"--rank must be between 1 and {largest} (the largest eigenbasis in {source}), got {rank}")
    if Path(out).exists():
        raise GraftError(f"output {out} already exists; choose a new folder")
    if Path(out).resolve() == Path(source).resolve():
        raise GraftError("output must differ from the input cache")
    return cache


def compress_cache(source: str | Path, out: str | Path, rank: int, progress: bool = True) -> CompressResult:
    """Write a copy of ``source`` whose KFAC sides keep at most ``rank`` eigenvectors (atomically)."""
    cache = check_compress(source, out, rank)
    estimator = dict(cache.manifest.get("estimator") or {})
    estimator["compressed"] = {"from": str(Path(source).resolve()), "rank": rank}
    result = CompressResult(Path(out), rank)
    truncated: dict[str, tuple[torch.Tensor | None, torch.Tensor]] = {}

    def side(name: str, which: str) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One factor side truncated to ``rank`` (once per side key: weights may share a side)."""
        key = cache.entries[name]["kfac"][which]
        if key not in truncated:
            vectors, values = cache.side_spectrum(key, name)
            new_vectors, new_values, kept = truncate_side(vectors, values, rank)
            truncated[key] = (new_vectors, new_values)
            count = side_rank(cache.kfac_side(name, which)) if kept is None else rank
            total = float(values.sum(dtype=torch.float64))
            share = float(new_values[:count].sum(dtype=torch.float64)) / total if total > 0 else 1.0
            result.sides[key] = SideSummary(key, int(values.shape[0]), count, share, kept)
        return truncated[key]

    with FisherCacheWriter(out, model=cache.manifest["model"], estimator=estimator, inputs=[("Fisher cache", source)],
                           counts=dict(cache.manifest.get("counts") or {})) as writer:
        for name in tqdm(cache.names(), desc="fisher compress", disable=not progress, unit="tensor"):
            if cache.has(name, "diagonal"):
                writer.add_diagonal(name, cache.diagonal(name))
            if cache.has(name, "kfac"):
                U, S = side(name, "rows")
                V, D = side(name, "columns")
                writer.add_kfac_eigen(name, U=U, S=S, V=V, D=D)
                result.weights[name] = (cache.entries[name]["kfac"]["rows"], cache.entries[name]["kfac"]["columns"])
    return result


def format_compress(result: CompressResult) -> str:
    """Per KFAC weight: kept eigenvectors per side and the kept share of Σ eigenvalues (trace)."""
    lines = [f"wrote {result.path}: KFAC sides keep at most {result.rank} eigenvectors",
             f"{'weight':<48} {'rows kept':>14} {'Σσ kept':>8} {'cols kept':>14} {'Σd kept':>8}"]
    for name, (rows, columns) in sorted(result.weights.items()):
        r, c = result.sides[rows], result.sides[columns]
        lines.append(f"{name:<48} {f'{r.kept}/{r.size}':>14} {100 * r.eigenvalue_share:7.2f}% "
                     f"{f'{c.kept}/{c.size}':>14} {100 * c.eigenvalue_share:7.2f}%")
    return "\n".join(lines)


@dataclass
class LayerReport:
    """One ranked tensor on a given Δ: score mass in the kept block, and the two masks' overlap."""

    name: str
    kind: str
    kept_share: float | None  # Σ s over kept pairs / Σ s (full basis); None for diagonal entries
    full_masked: int = 0
    both_masked: int = 0


def delta_report(result: CompressResult, source: str | Path, plan, device: str = "cpu",
                 progress: bool = True) -> list[LayerReport]:
    """Compare the compact cache with ``source`` on the Δ of a graft ``plan`` (its λ, ρ, mask, rho_scope).

    ``kept_share``: of the score mass ``Σ σ_i d_j Δ̃_ij²`` in the full basis, the part
    on pairs the compact cache keeps. Overlap (plan.rho > 0): the full cache's mask
    M_full and the compact cache's mask M_compact as sets of directions of the full
    basis (pairs ``u_i v_jᵀ`` of KFAC weights, coordinates elsewhere; a compact pair
    is the full pair of the same two eigenvectors), counted per tensor.
    """
    rho = plan.rho
    opened = {
        which: GraftInputs.open(dataclasses.replace(plan, fisher=str(path), rho=rho if rho > 0 else 0.5))
        for which, path in (("full", source), ("compact", result.path))
    }
    full, compact = opened["full"], opened["compact"]
    thresholds = {"full": None, "compact": None}
    if rho > 0 and plan.rho_scope == "global":
        for which, inputs in opened.items():
            thresholds[which] = score_pass({0: inputs}, [rho], device, progress)[0].thresholds
    reports = []
    for name in tqdm(full.ranked_names(), desc="compress report", disable=not progress, unit="tensor"):
        kind = full.fisher_kind(name)
        kept_rows = kept_columns = None
        kept_share = None
        if kind == "kfac":
            rows_key, columns_key = result.weights[name]
            kept_rows, kept_columns = result.sides[rows_key].kept_indices, result.sides[columns_key].kept_indices
            scores = next(tensor_masks(full, name, [], None, device))[1]
            inside, total = block_share(scores, kept_rows, kept_columns)
            kept_share = inside / total if total > 0 else 1.0
            del scores
        report = LayerReport(name, kind, kept_share)
        if rho > 0:
            blocks = zip(tensor_masks(full, name, [rho], thresholds["full"], device),
                         tensor_masks(compact, name, [rho], thresholds["compact"], device))
            for (_, _, full_masks), (_, _, compact_masks) in blocks:
                if kind == "kfac":
                    both, count = pair_overlap(compact_masks[rho], kept_rows, kept_columns, full_masks[rho])
                else:
                    both, count = int((compact_masks[rho] & full_masks[rho]).sum()), int(full_masks[rho].sum())
                report.both_masked += both
                report.full_masked += count
        reports.append(report)
    return reports


def format_delta_report(reports: list[LayerReport], rho: float) -> str:
    """Per KFAC weight: kept share of the score mass, |M_compact ∩ M_full| / |M_full|; then the whole model."""
    lines = ["", f"on the config's Δ (rho {rho:g}):",
             f"{'weight':<48} {'score mass kept':>16} {'mask overlap':>14}"]
    for report in reports:
        if report.kind != "kfac":
            continue
        overlap = f"{100 * report.both_masked / report.full_masked:.2f}%" if report.full_masked else "—"
        lines.append(f"{report.name:<48} {100 * report.kept_share:15.2f}% {overlap:>14}")
    both = sum(r.both_masked for r in reports)
    masked = sum(r.full_masked for r in reports)
    if rho > 0:
        overlap = f"{100 * both / masked:.2f}%" if masked else "— (the full mask is empty)"
        lines.append(
            f"whole model (every ranked direction): |M_compact ∩ M_full| / |M_full| = {overlap} "
            f"({both:,} of {masked:,})"
        )
    else:
        lines.append("mask overlap: the config's rho is 0 (no mask); set rho > 0 to compare masks")
    return "\n".join(lines)
