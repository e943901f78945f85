"""The streaming pre-pass that fixes the global mask threshold, and its result cache.

Each merge call sees one tensor, but a global top-ρ mask depends on every
tensor: this pass reads the deltas and the Fisher once before the merge
(see ``global_threshold`` for the rare second look), and stores the result keyed by a
fingerprint of the inputs, the cache and the parameters, so a second run with
the same inputs skips it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch
from tqdm import tqdm

from graftmerge import __version__
from graftmerge.formats.rotation_store import RotationStore
from graftmerge.math.global_threshold import GlobalThreshold, ThresholdSearch
from graftmerge.math.projection import score_delta
from graftmerge.math.selection import masked_count
from graftmerge.pipeline.graft_plan import GraftInputs

_MEMORY: dict[str, GlobalThreshold] = {}


def cache_dir() -> Path:
    """``$GRAFTMERGE_CACHE_DIR``, else ``$XDG_CACHE_HOME/graftmerge``, else ``~/.cache/graftmerge``."""
    if os.environ.get("GRAFTMERGE_CACHE_DIR"):
        return Path(os.environ["GRAFTMERGE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "graftmerge"


def threshold_key(inputs: GraftInputs, device: str) -> str:
    """Fingerprint of everything the threshold depends on (files by path, size and mtime).

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
        "donor": inputs.donor.file_stamps() if inputs.donor is not None else None,
        "fine_tunes": [ft.file_stamps() for ft in inputs.fine_tunes],
        "deltas": [d.file_stamps() for d in inputs.deltas],
        "fisher": inputs.fisher.file_stamps(),
        "device": torch.device(device).type,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def global_threshold(
    inputs: GraftInputs, device: str = "cpu", progress: bool = True, rotations: RotationStore | None = None
) -> GlobalThreshold:
    """The global threshold for a plan: from memory, the on-disk cache, or a fresh pass.

    A fresh pass saves each KFAC weight's Δ̃ into ``rotations`` when given.
    """
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
    """Radix-select the exact ⌈ρ·D⌉-th largest score over all ranked tensors, streaming."""
    names = inputs.ranked_names()
    total = sum(inputs.direction_count(name) for name in names)
    search = ThresholdSearch(k=masked_count(inputs.plan.rho, total), total=total)

    def score_blocks(name: str, keep: bool = False):
        """Scores of each row block of ``name``; with ``keep``, Δ̃ of whole KFAC weights goes to ``rotations``."""
        for rows in inputs.row_blocks(name):
            delta = inputs.read_delta(name, device, rows)
            scored = score_delta(delta, inputs.tensor_fisher(name, rows).to(device))
            if keep and rotations is not None and rows is None and scored.rotated is not None:
                rotations.save(name, scored.rotated)
            yield scored.scores

    for name in tqdm(names, desc="graft threshold: scoring", disable=not progress, unit="tensor"):
        for scores in score_blocks(name, keep=True):
            search.add_coarse(name, scores)
    rescore = search.fine_pass_names()  # empty unless the kept scores overflowed spill_limit
    for name in tqdm(rescore, desc="graft threshold: re-scoring", disable=not progress or not rescore, unit="tensor"):
        for scores in score_blocks(name):
            search.add_fine(name, scores)
    return search.result()
