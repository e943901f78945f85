"""The streaming pre-pass that fixes the global mask threshold, and its result cache.

Each merge call sees one tensor, but a global top-ρ mask depends on every
tensor: this pass reads the deltas and the Fisher once before the merge
(see ``global_threshold`` for the rare second look), and stores the result keyed by a
fingerprint of the inputs, the cache and the parameters, so a second run with
the same inputs skips it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator

import torch
from tqdm import tqdm

from graftmerge import __version__
from graftmerge.formats.output_folder import stage_reached
from graftmerge.formats.rotation_store import RotationStore
from graftmerge.formats.user_cache import cache_dir
from graftmerge.math.global_threshold import GlobalThreshold, ThresholdSearch
from graftmerge.math.projection import ScoredDelta, TensorFisher, candidate_pairs
from graftmerge.math.selection import masked_count
from graftmerge.pipeline.graft_plan import GraftInputs
from graftmerge.pipeline.lora_inputs import scored_delta

_MEMORY: dict[str, GlobalThreshold] = {}


def forget_thresholds() -> None:
    """Drop the thresholds this process remembers (the on-disk cache is kept)."""
    _MEMORY.clear()
NO_CACHE_ENV = "GRAFTMERGE_NO_THRESHOLD_CACHE"


def threshold_cache_enabled() -> bool:
    """False when ``$GRAFTMERGE_NO_THRESHOLD_CACHE`` is set (to anything but ``0`` or empty), e.g. by ``--no-threshold-cache``."""
    return os.environ.get(NO_CACHE_ENV, "") in ("", "0")


@contextlib.contextmanager
def threshold_cache_disabled(disabled: bool = True) -> Iterator[None]:
    """Within the block, every threshold is computed afresh (``$GRAFTMERGE_NO_THRESHOLD_CACHE=1``)."""
    previous = os.environ.get(NO_CACHE_ENV)
    if disabled:
        os.environ[NO_CACHE_ENV] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(NO_CACHE_ENV, None)
        else:
            os.environ[NO_CACHE_ENV] = previous


def threshold_key(inputs: GraftInputs, device: str) -> str:
    """Fingerprint of everything the threshold depends on: plan, device, and each input shard's content stamp.

    A shard's stamp is its path, size and mtime plus a sha256 of its safetensors header
    and of three 4 KiB windows of every tensor (``Checkpoint.content_stamps``); the
    Fisher manifest is hashed whole. An in-place edit outside the sampled windows that
    keeps size and mtime is not seen: ``--no-threshold-cache`` for files edited in place.

    Computed once per opened inputs and device (the merge kernel asks per tensor).
    """
    cached = inputs.memo.get(("threshold_key", device))
    if cached is None:
        cached = inputs.memo[("threshold_key", device)] = _threshold_key(inputs, device)
    return cached


def _threshold_key(inputs: GraftInputs, device: str) -> str:
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
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def global_threshold(
    inputs: GraftInputs, device: str = "cpu", progress: bool = True, rotations: RotationStore | None = None
) -> GlobalThreshold:
    """The global threshold for a plan: from memory, the on-disk cache, or a fresh pass.

    A fresh pass saves each KFAC weight's Δ̃ into ``rotations`` when given. With the
    cache disabled (``threshold_cache_enabled``), it is computed once for these opened
    inputs and neither read from nor written to memory or disk.
    """
    if not threshold_cache_enabled():
        if ("uncached threshold", device) not in inputs.memo:
            inputs.memo[("uncached threshold", device)] = compute_global_threshold(
                inputs, device=device, progress=progress, rotations=rotations)
        return inputs.memo[("uncached threshold", device)]
    key = threshold_key(inputs, device)
    if key in _MEMORY:
        return _MEMORY[key]
    file = cache_dir() / "thresholds" / f"{key}.json"
    if file.exists():
        try:
            result = GlobalThreshold.from_json(json.loads(file.read_text()))
        except (json.JSONDecodeError, KeyError, ValueError):
            result = None  # a damaged cache entry is recomputed
        if result is not None:
            _MEMORY[key] = result
            return result
    result = compute_global_threshold(inputs, device=device, progress=progress, rotations=rotations)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(result.to_json()))
    os.replace(tmp, file)
    _MEMORY[key] = result
    return result


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

    def score_blocks(name: str):
        """(rows, Fisher, scored delta) of each row block of ``name``."""
        for rows in inputs.row_blocks(name):
            delta = inputs.read_delta(name, device, rows)
            fisher = inputs.tensor_fisher(name, rows).to(device)
            yield rows, fisher, scored_delta(inputs, name, delta, fisher, rows)

    for name in tqdm(names, desc="graft threshold: scoring", disable=not progress, unit="tensor"):
        stage_reached("scoring")
        for rows, fisher, scored in score_blocks(name):
            search.add_coarse(name, scored.scores)
            if rotations is not None and rows is None and scored.rotated is not None:
                _keep_rotation(search, rotations, name, scored, fisher)
    rescore = search.fine_pass_names()  # empty unless the kept scores overflowed spill_limit
    for name in tqdm(rescore, desc="graft threshold: re-scoring", disable=not progress or not rescore, unit="tensor"):
        for _, _, scored in score_blocks(name):
            search.add_fine(name, scored.scores)
    result = search.result()
    if rotations is not None:
        masks = {name: search.masked_positions(name) for name in names}
        rotations.keep_masks({name: positions for name, positions in masks.items() if positions is not None})
    return result


def _keep_rotation(search: ThresholdSearch, rotations: RotationStore, name: str, scored: ScoredDelta,
                   fisher: TensorFisher) -> None:
    """Keep a KFAC weight's candidate pairs for the merge; its whole Δ̃ when its scores were not kept."""
    positions = search.kept_positions(name)
    if positions is None:
        rotations.save(name, scored.rotated)
    else:
        rotations.save_pairs(name, candidate_pairs(scored.rotated, positions, fisher.kfac))
