"""The streaming pre-pass that fixes the global mask threshold, and its result cache.

Each merge call sees one tensor, but a global top-ρ mask depends on every
tensor: this pass reads the deltas and the Fisher once before the merge
(see ``compute_global_threshold`` for the rare second look), and stores the result in the
user's cache keyed by a fingerprint of the inputs, the cache and the parameters, so a
second run with the same inputs skips it. Nothing is kept in the process: a merge holds
its threshold in its :class:`~graftmerge.pipeline.merge_run.MergeRun`. A stored threshold
is trusted only as far as it is checked: its record's name is keyed by the user's secret
(:mod:`graftmerge.formats.user_cache`), its k and D must be this plan's, and the merge
counts what it masks (``check_masked_total``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm

from graftmerge import __version__
from graftmerge.errors import GraftError
from graftmerge.formats.output_folder import stage_reached
from graftmerge.formats.rotation_store import RotationStore
from graftmerge.formats.user_cache import (
    read_record,
    record_name,
    record_path,
    remove_record,
    write_record,
)
from graftmerge.math.global_threshold import GlobalThreshold, ThresholdSearch
from graftmerge.math.projection import TensorFisher, candidate_pairs
from graftmerge.math.scores import diagonal_scores
from graftmerge.math.selection import SMALLEST_SCORE, masked_count
from graftmerge.pipeline.finite_values import check_scores
from graftmerge.pipeline.graft_plan import GraftInputs
from graftmerge.pipeline.lora_inputs import scored_delta

NO_CACHE_ENV = "GRAFTMERGE_NO_THRESHOLD_CACHE"


def threshold_cache_enabled() -> bool:
    """The user's setting for mergekit-yaml: False when ``$GRAFTMERGE_NO_THRESHOLD_CACHE`` is set (to anything
    but ``0`` or empty). Read where a merge starts; ``graftmerge merge --no-threshold-cache`` passes False."""
    return os.environ.get(NO_CACHE_ENV, "") in ("", "0")


def threshold_key(inputs: GraftInputs, device: str) -> str:
    """Fingerprint of everything the threshold depends on: plan, device, and each input shard's content stamp.

    A shard's stamp is its path, size and mtime plus a sha256 of its safetensors header
    and of three 4 KiB windows of every tensor (``Checkpoint.content_stamps``); the
    Fisher manifest is hashed whole. Every file Δ and F are read from adds its identity
    as pinned when opened (device, inode, size, mtime, ctime: ``GraftInputs.pinned``), so
    a file edited in place, even outside the sampled windows with its mtime put back,
    or replaced by another, is a new key.

    Computed at each call (sha256 of sampled windows of every input): a merge asks once, when it starts.
    """
    plan = dataclasses.asdict(inputs.plan)
    plan.pop("post")  # Δ and F do not depend on θpost; the cache was checked against it
    payload = {
        "graftmerge": __version__,
        "plan": plan,
        "donor": inputs.donor.content_stamps() if inputs.donor is not None else None,
        "fine_tunes": [ft.content_stamps() for ft in inputs.fine_tunes],
        "deltas": [d.content_stamps() for d in inputs.deltas],
        "fisher": inputs.fisher.content_stamps(),
        "device": torch.device(device).type,
        # Every file Δ and F are read from, as pinned when opened: a changed file (new inode or ctime) is a new key.
        "files": sorted([str(file), *identity] for file, identity in inputs.pinned(with_post=False).items()),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def global_threshold(
    inputs: GraftInputs, device: str = "cpu", progress: bool = True, rotations: RotationStore | None = None,
    use_cache: bool = True,
) -> tuple[GlobalThreshold, str | None]:
    """(the global threshold for a plan, the name of its record in the user's cache): from that cache, or a fresh pass.

    A fresh pass saves each KFAC weight's Δ̃ into ``rotations`` when given. Without
    ``use_cache``, it is computed afresh and neither read from nor written to disk (record
    None). Called once per merge, which keeps the result.
    """
    if not use_cache:
        return compute_global_threshold(inputs, device=device, progress=progress, rotations=rotations), None
    name = record_name(THRESHOLDS, threshold_key(inputs, device))
    result = _cached_threshold(inputs, name) if name is not None else None
    if result is None:
        result = compute_global_threshold(inputs, device=device, progress=progress, rotations=rotations)
        if name is not None:
            write_record(THRESHOLDS, f"{name}.json", json.dumps(result.to_json()).encode())
    return result, name


THRESHOLDS = "thresholds"  # the user cache's folder of thresholds, one record per key


def _cached_threshold(inputs: GraftInputs, name: str) -> GlobalThreshold | None:
    """The threshold recorded under ``name`` when it is sound and fits this plan; else None (and the entry removed).

    Sound: JSON of the right shape and types (``_parse_threshold``). Fits: its ``total``
    is this plan's D, from the headers, and its ``k`` is ⌈ρ·D⌉; its threshold, positives
    and tie quotas are consistent with each other (``expected_masked``). The merge then
    counts what the threshold masks and checks it (``check_masked_total``).
    """
    raw = read_record(THRESHOLDS, f"{name}.json")
    if raw is None:
        return None
    result = _parse_threshold(raw)
    names = inputs.ranked_names()
    total = sum(inputs.direction_count(n) for n in names)
    if result is None or result.total != total or result.k != masked_count(inputs.plan.rho, total) or (
            not set(result.tie_quota) <= set(names) or expected_masked(result) is None):
        remove_record(THRESHOLDS, f"{name}.json")  # malformed, or not this plan's: recomputed and rewritten
        return None
    return result


def _parse_threshold(raw: bytes) -> GlobalThreshold | None:
    """A recorded threshold, when the bytes are JSON of exactly its shape and types; else None (never raises)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError, MemoryError):  # bad JSON, bad UTF-8, integers past the digit limit
        return None
    count = lambda value: type(value) is int and 0 <= value < 1 << 62  # noqa: E731
    if not isinstance(data, dict) or set(data) != {"threshold", "tie_quota", "k", "total", "positives"}:
        return None
    threshold, quota = data["threshold"], data["tie_quota"]
    if type(threshold) not in (int, float) or not threshold >= 0 or not isinstance(quota, dict):
        return None
    if not all(count(data[field]) for field in ("k", "total", "positives")) or not all(
            isinstance(n, str) and count(v) for n, v in quota.items()):
        return None
    return GlobalThreshold(threshold=float(threshold), tie_quota=dict(quota), k=data["k"], total=data["total"],
                           positives=data["positives"])


def expected_masked(threshold: GlobalThreshold) -> int | None:
    """How many directions ``threshold`` masks over the whole plan, as the pass that found it would; None if incoherent.

    k = 0 masks nothing (threshold +inf); fewer positive scores than k masks every one
    (threshold 0); otherwise exactly k, the ties at a positive threshold shared out by quota.
    """
    t, k, positives = threshold, threshold.k, threshold.positives
    if positives > t.total or sum(t.tie_quota.values()) > k:
        return None
    if k == 0:
        return 0 if t.threshold == float("inf") else None
    if positives <= k:
        return positives if t.threshold < SMALLEST_SCORE else None
    return k if SMALLEST_SCORE <= t.threshold < float("inf") else None


def check_masked_total(inputs: GraftInputs, threshold: GlobalThreshold, counted: dict[str, int],
                       name: str | None) -> None:
    """After the merge: the directions it masked (``counted``, per tensor), summed, are what ``threshold`` claims to
    mask.

    A mismatch means the threshold does not summarise these inputs (a planted or stale
    cache entry): its record ``name`` is removed and the run fails in one line, before OUT is published.
    """
    if set(counted) != set(inputs.ranked_names()):
        return  # not every ranked tensor went through the kernel (nothing to compare the sum with)
    masked, expected = sum(counted.values()), expected_masked(threshold)
    if masked == expected:
        return
    where = "the global threshold"
    if name is not None:
        remove_record(THRESHOLDS, f"{name}.json")
        where = f"the cached global threshold {record_path(THRESHOLDS, name + '.json')}"
    raise GraftError(f"{where} masked {masked} directions where its pass masks {expected} (k = {threshold.k} of "
                     f"D = {threshold.total}): it does not match these inputs and was removed; run again")


def compute_global_threshold(
    inputs: GraftInputs, device: str = "cpu", progress: bool = True, rotations: RotationStore | None = None
) -> GlobalThreshold:
    """Radix-select the exact ⌈ρ·D⌉-th largest score over all ranked tensors, streaming.

    With ``rotations``, what the merge needs is kept there: each KFAC weight's candidate
    pairs (or its whole Δ̃ when its scores overflowed the search's memory), and at the end
    the final mask of every tensor whose scores stayed kept (``RotationStore.keep_masks``).
    """
    names = inputs.ranked_names()
    total = sum(inputs.direction_count(name) for name in names)
    search = ThresholdSearch(k=masked_count(inputs.plan.rho, total), total=total,
                             keep_positions=rotations is not None)
    blocks = [(name, rows) for name in names for rows in inputs.row_blocks(name)]
    score = functools.partial(_score_block, inputs, device)
    with (tqdm(total=len(names), desc="graft threshold: scoring", disable=not progress, unit="tensor") as bar,
          ThreadPoolExecutor(max_workers=1) as writer):  # files for the merge are written meanwhile
        saved = []
        for (name, rows), (fisher, scores, rotated) in read_ahead(blocks, score):
            if rows is None or rows[0] == 0:
                stage_reached("scoring")
                bar.update()
            search.add_coarse(name, scores)
            if rotations is not None and rows is None and rotated is not None:
                while len(saved) >= 2:  # bounded: at most two weights' Δ̃ wait for the writer
                    saved.pop(0).result()
                positions = search.kept_positions(name)
                saved.append(writer.submit(_keep_rotation, rotations, name, rotated, fisher, positions))
        for done in saved:
            done.result()  # raises what a write raised
    rescore = search.fine_pass_names()  # empty unless the kept scores overflowed spill_limit
    for name in tqdm(rescore, desc="graft threshold: re-scoring", disable=not progress or not rescore, unit="tensor"):
        for rows in inputs.row_blocks(name):
            search.add_fine(name, score((name, rows))[1])
    result = search.result()
    if rotations is not None:
        masks = {name: search.masked_positions(name) for name in names}
        rotations.keep_masks({name: positions for name, positions in masks.items() if positions is not None})
    return result


def _score_block(inputs: GraftInputs, device: str, block: tuple[str, tuple[int, int] | None]
                 ) -> tuple[TensorFisher, torch.Tensor, torch.Tensor | None]:
    """(Fisher, scores, Δ̃ or None) of one row block of one tensor: read, check, score."""
    name, rows = block
    delta = inputs.read_delta(name, device, rows)
    fisher = inputs.tensor_fisher(name, rows).to(device)
    if fisher.kfac is None:  # Δ is not needed after its scores: square it in place
        scores = diagonal_scores(fisher.diagonal, delta, in_place=True)
        check_scores(inputs, name, scores, rows)  # a NaN or Inf in Δ never reaches the search
        return fisher, scores, None
    scored = scored_delta(inputs, name, delta, fisher, rows)
    return fisher, scored.scores, scored.rotated


def read_ahead(items: list, compute: Callable) -> Iterator[tuple]:
    """``(item, compute(item))`` in order, the next item computed in a background thread meanwhile.

    The threshold pass reads and scores block i+1 (file reads, sha256, conversions and
    matmuls release the GIL) while the caller feeds block i to the search: one block in
    flight, so memory holds at most two blocks' scores. An exception raised by
    ``compute`` is raised here, for its item.
    """
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(compute, items[0]) if items else None
        for index, item in enumerate(items):
            result = pending.result()
            pending = pool.submit(compute, items[index + 1]) if index + 1 < len(items) else None
            yield item, result


def _keep_rotation(rotations: RotationStore, name: str, rotated: torch.Tensor, fisher: TensorFisher,
                   positions: torch.Tensor | None) -> None:
    """Keep a KFAC weight's candidate pairs (the scores kept at ``positions``) for the merge; its whole Δ̃ when None."""
    if positions is None:
        rotations.save(name, rotated)
    else:
        rotations.save_pairs(name, candidate_pairs(rotated, positions, fisher.kfac))
