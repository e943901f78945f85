"""The graft of one tensor, θpost + Δ', from its :class:`TensorRecord` and its input tensors.

The record holds all a tensor needs, resolved before the first tensor is grafted; the kernel
asks nobody a question and calls only ``math/`` and ``formats/`` (tests/test_layering.py). A
non-finite value is raised as :class:`NonFinite`, for the caller, which holds the inputs, to
name its culprit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from graftmerge.math.donor_delta import donor_delta
from graftmerge.math.finite import all_finite, fits
from graftmerge.math.low_rank import low_rank_rotate
from graftmerge.math.projection import (
    ScoredDelta,
    TensorFisher,
    remove_masked,
    remove_masked_coordinates,
    remove_masked_pairs,
    score_delta,
)
from graftmerge.math.selection import mask_from_threshold, masked_count, top_k_mask

Rows = tuple[int, int] | None  # a block of rows scored on its own, or None: the whole tensor


@dataclass(frozen=True)
class TensorRecord:
    """One tensor's graft, resolved: what the kernel reads instead of the plan, the inputs and the run."""

    name: str
    lambdas: tuple[float, ...]  # λ·weight of each donor_ft, in config order
    delta_lambdas: tuple[float, ...] = ()  # λ·weight of each delta
    kind: str | None = None  # the Fisher it is masked with, "diagonal" or "kfac"; None: Δ applied unmasked
    fisher: object | None = None  # the Fisher cache (formats/): ``diagonal(name, rows)``, ``kfac(name)``
    rows: tuple[Rows, ...] = (None,)  # row blocks scored independently (a huge embedding's)
    rho: float | None = None  # rho_scope tensor: this tensor's ρ; None: the global threshold below
    threshold: float = 0.0  # global: scores above it are masked, and ``ties`` of those equal to it
    ties: int = 0
    kept_masks: object | None = None  # the threshold pass's final masks (formats/rotation_store), if it kept them
    rotations: object | None = None  # its Δ̃ of KFAC weights: ``load(name, device)``
    lora_factors: Callable[[], tuple] | None = None  # a lone adapter's (B, A, scale): Δ̃ from its factors
    out_dtype: torch.dtype | None = None  # the written dtype: the result is checked finite in it too
    scheduled: object | None = None  # a scheduled graft's TensorScales, which mergekit must hand this tensor too


class NonFinite(Exception):  # noqa: N818 - a finding handed up, not an error a user sees
    """A NaN or Inf the kernel found: at which ``stage`` (scores, delta, result), in which rows."""

    def __init__(self, stage: str, rows: Rows = None, rotated: torch.Tensor | None = None,
                 result: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
        super().__init__(stage)
        self.stage, self.rows, self.rotated, self.result, self.out_dtype = stage, rows, rotated, result, out_dtype


def read_fisher(fisher, name: str, kind: str, rows: Rows = None) -> TensorFisher:
    """The Fisher tensor ``name`` (its ``rows``) is masked with, read from the cache ``fisher``."""
    if kind == "kfac":
        factors = fisher.kfac(name)
        if rows is not None:
            factors = dataclasses.replace(factors, S=factors.S[rows[0] : rows[1]])
        return TensorFisher(kfac=factors)
    return TensorFisher(diagonal=fisher.diagonal(name, rows))


def graft(record: TensorRecord, post: torch.Tensor, donor: torch.Tensor | None, fine_tunes: Sequence[torch.Tensor],
          deltas: Sequence[torch.Tensor] = (), out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, int | None]:
    """(θpost + M(Δ), how many directions the global mask removed, None otherwise); inputs in the working dtype.

    ``out_dtype`` (default: the record's) is what the result is written in: it is checked finite there too.
    """
    delta = donor_delta(donor, fine_tunes, list(record.lambdas), deltas, list(record.delta_lambdas))
    masked = None
    if record.kind is not None:
        masked = _mask_tensor(record, delta) if record.rho is not None else _mask_global(record, delta)
    result = delta.add_(post.to(delta.dtype)).to(post.dtype)  # θpost + Δ', in Δ's buffer
    out_dtype = out_dtype or record.out_dtype
    if not fits(result, out_dtype):
        raise NonFinite("result", result=result, out_dtype=out_dtype)
    return result, masked


def _scored(record: TensorRecord, part: torch.Tensor, fisher: TensorFisher, rows: Rows,
            rotated: torch.Tensor | None) -> ScoredDelta:
    """Scores of ``part`` (Δ or its ``rows``); a lone adapter's Δ̃ rotated from its factors, ``λ·s·(UᵀB)(AV)``."""
    if rotated is None and record.lora_factors is not None and fisher.kfac is not None and rows is None:
        found = record.lora_factors()
        if found is not None:
            left, right, scale = found
            device = part.device
            rotated = low_rank_rotate(left.to(device), right.to(device), scale * record.delta_lambdas[0],
                                      fisher.kfac.U, fisher.kfac.V)
    scored = score_delta(part, fisher, rotated)
    if not all_finite(scored.scores):  # NaN/Inf in Δ or Δ̃ never reaches a mask
        raise NonFinite("scores", rows, rotated=scored.rotated)
    return scored


def _mask_tensor(record: TensorRecord, delta: torch.Tensor) -> None:
    """``rho_scope: tensor``: the ⌈ρ·D⌉ top-scored directions of this tensor removed from Δ, in place."""
    fisher = read_fisher(record.fisher, record.name, record.kind).to(delta.device)
    scored = _scored(record, delta, fisher, None, None)
    remove_masked(scored, top_k_mask(scored.scores, masked_count(record.rho, scored.scores.numel())), fisher)


def _mask_global(record: TensorRecord, delta: torch.Tensor) -> int:
    """The directions scored above the global threshold removed from Δ, in place: how many."""
    masked = _remove_kept_mask(record, delta)
    if masked is not None:
        return masked
    ties_left, masked = record.ties, 0
    # The same row blocks as the threshold pass: identical scores, and a huge
    # embedding never needs a full-size score tensor.
    for rows in record.rows:
        part = delta if rows is None else delta[rows[0] : rows[1]]
        fisher = read_fisher(record.fisher, record.name, record.kind, rows).to(delta.device)
        kept = record.rotations
        rotated = kept.load(record.name, delta.device) if kept is not None and rows is None else None
        scored = _scored(record, part, fisher, rows, rotated)
        mask = mask_from_threshold(scored.scores, record.threshold, ties_left)
        masked += int(mask.sum())
        if ties_left:
            ties_left -= min(ties_left, int((scored.scores == record.threshold).sum()))
        remove_masked(scored, mask, fisher)  # in place: ``part`` is a view of ``delta``
        del scored, mask, fisher
    return masked


def _remove_kept_mask(record: TensorRecord, delta: torch.Tensor) -> int | None:
    """Remove the mask the threshold pass kept for this tensor from ``delta``, in place: how many directions it
    masked; None if it kept none."""
    kept = record.kept_masks
    positions = kept.masked_positions(record.name) if kept is not None else None
    if positions is None:
        return None
    if record.kind != "kfac":
        if not all_finite(delta):  # zeroing a masked coordinate must not hide a NaN or Inf there
            raise NonFinite("delta")
        remove_masked_coordinates(delta, positions)
        return positions.numel()
    pairs = kept.load_pairs(record.name, delta.device)
    if pairs is None:
        return None
    remove_masked_pairs(delta, pairs, positions)
    return positions.numel()
