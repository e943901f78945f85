"""Resumable accumulation: each rank saves its sums every N batches.

The checkpoint lives in a hidden sibling of the output (``.NAME.checkpoint/``), never
in the cache folder itself, so an interrupted run cannot leave anything that looks
like a cache. A checkpoint records a fingerprint of everything that determines the
sums (model, data, kind, batch plan, world size); a rerun with the same settings
resumes from it, any other run refuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from graftmerge.errors import GraftError


def checkpoint_folder(output: Path) -> Path:
    """The hidden sibling ``.NAME.checkpoint`` of ``output``, so nothing half-done looks like a cache."""
    return output.parent / f".{output.name}.checkpoint"


def fingerprint(settings: dict[str, Any]) -> str:
    """sha256 of the settings that determine the sums; a checkpoint resumes only the same run."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def _state_file(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank:05d}.pt"


def save(
    folder: Path, rank: int, print_: str, batches_done: int, state: dict[str, torch.Tensor]
) -> None:
    """Atomically replace this rank's checkpoint (temporary name, then rename)."""
    folder.mkdir(parents=True, exist_ok=True)
    target = _state_file(folder, rank)
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    payload = {
        "fingerprint": print_,
        "batches_done": batches_done,
        "state": {k: v.cpu() for k, v in state.items()},
    }
    torch.save(payload, tmp)
    os.replace(tmp, target)


def load(folder: Path, rank: int, print_: str) -> tuple[int, dict[str, torch.Tensor]] | None:
    """(batches done, sums) when this rank has a checkpoint of the same run, else None."""
    target = _state_file(folder, rank)
    if not target.exists():
        return None
    try:
        payload = torch.load(target, map_location="cpu", weights_only=True)
    except Exception as error:  # a torn or foreign file: say so, do not guess
        raise GraftError(
            f"checkpoint {target} is unreadable ({error}); delete {folder} to start over"
        ) from error
    if payload.get("fingerprint") != print_:
        raise GraftError(
            f"checkpoint {folder} belongs to a run with other settings (model, data, kind, batch size or "
            "number of processes); delete it or pass --restart"
        )
    return int(payload["batches_done"]), payload["state"]


def clear(folder: Path) -> None:
    """Delete the checkpoints (a finished run, or --restart); absent is fine."""
    shutil.rmtree(folder, ignore_errors=True)
