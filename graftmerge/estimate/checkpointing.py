"""Resumable accumulation: each rank saves its sums every N batches, sealed, and checks them all on resume.

The checkpoint lives in a hidden sibling of the output (``.NAME.checkpoint/``), never
in the cache folder itself, so an interrupted run cannot leave anything that looks
like a cache. A checkpoint records a fingerprint of everything that determines the
sums (the model by content, the data's tokens, the estimator's settings, the world
size); a rerun with the same settings resumes from it, any other run refuses it.

Nothing read back is used as it is (:func:`load`): the payload's type and fields, a seal
(sha256 of its own content: an edit is seen), the batch position against this rank's
batches, the counts against the sequences and tokens of the batches before it, every
sum's name, shape and dtype against the run's own accumulators, and their values (finite;
diagonal sums non-negative; factor sums with a non-negative diagonal and within
Cauchy–Schwarz, as a sum of outer products is). Samples drawn from ``--prompts`` are kept
beside the sums with a record of the prompts, model and settings they were drawn with
and the file's sha256 (:func:`kept_rollouts`). Every refusal is one line naming the
checkpoint and what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graftmerge.errors import GraftError
from graftmerge.formats.file_hash import file_sha256

FORMAT = "graftmerge.estimate-checkpoint"
VERSION = 2
FIELDS = {"format", "version", "fingerprint", "rank", "batches_done", "state", "seal"}
ROLLOUTS_NAME = "rollouts.jsonl"
ROLLOUTS_RECORD = "rollouts.json"
STRIP_ROWS = 1024
CAUCHY_SCHWARZ_SLACK = 1e-3  # relative: rounding of a float32 sum of outer products stays far below it


@dataclass(frozen=True)
class Expected:
    """What one rank's checkpoint of this run must hold to be resumed."""

    sums: dict[str, tuple[tuple[int, ...], torch.dtype]]  # every sum, with its shape and dtype
    steps: int  # the rank's number of steps: a checkpoint is saved after 1 … steps − 1 of them
    counts: Callable[[int], tuple[int, int, int]]  # (sequences, tokens, completion tokens) after n steps
    optional: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None  # sums a rank may hold (owned sides)


def checkpoint_folder(output: Path) -> Path:
    """The hidden sibling ``.NAME.checkpoint`` of ``output``, so nothing half-done looks like a cache."""
    return output.parent / f".{output.name}.checkpoint"


def fingerprint(settings: dict[str, Any]) -> str:
    """sha256 of the settings that determine the sums; a checkpoint resumes only the same run."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def _state_file(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank:05d}.pt"


def _redo(folder: Path) -> str:
    return f"pass --restart (or delete {folder}) to start over"


def seal(payload: dict[str, Any]) -> str:
    """sha256 of a payload's content (every field but the seal; each sum's name, dtype, shape and bytes)."""
    digest = hashlib.sha256(json.dumps([payload[k] for k in ("format", "version", "fingerprint", "rank",
                                                              "batches_done")]).encode())
    for key in sorted(payload["state"]):
        tensor = payload["state"][key].detach().cpu().contiguous()
        digest.update(f"\n{key}\0{tensor.dtype}\0{list(tensor.shape)}\0".encode())
        digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else b"")
    return digest.hexdigest()


def save(
    folder: Path, rank: int, print_: str, batches_done: int, state: dict[str, torch.Tensor]
) -> None:
    """Atomically replace this rank's checkpoint (temporary name, then rename), sealed."""
    folder.mkdir(parents=True, exist_ok=True)
    target = _state_file(folder, rank)
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    payload = {"format": FORMAT, "version": VERSION, "fingerprint": print_, "rank": rank,
               "batches_done": batches_done, "state": {k: v.detach().cpu() for k, v in state.items()}}
    payload["seal"] = seal(payload)
    torch.save(payload, tmp)
    os.replace(tmp, target)


def load(folder: Path, rank: int, print_: str, expected: Expected) -> tuple[int, dict[str, torch.Tensor]] | None:
    """(batches done, sums) when this rank has a checkpoint of the same run, every field checked; else None."""
    target = _state_file(folder, rank)
    if not target.exists():
        return None
    try:
        payload = torch.load(target, map_location="cpu", weights_only=True)
    except Exception as error:  # a torn or foreign file: say so, do not guess
        first = (str(error).splitlines() or [type(error).__name__])[0][:200]
        raise GraftError(f"checkpoint {target} is unreadable ({first}); {_redo(folder)}") from error
    _check_payload(payload, target, folder, print_)
    done = payload["batches_done"]
    if type(done) is not int or type(payload["rank"]) is not int or payload["rank"] != rank:
        raise GraftError(f"checkpoint {target} is damaged (rank {payload['rank']!r}, batches done {done!r}); "
                         f"{_redo(folder)}")
    if not 1 <= done < expected.steps:
        raise GraftError(f"checkpoint {target} says {done} batches were done, but this rank has {expected.steps} "
                         f"steps (a checkpoint is saved after 1 to {expected.steps - 1}); {_redo(folder)}")
    state = payload["state"]
    check_sums(state, expected, target, folder)
    check_counts(state["counts"], expected.counts(done), done, target, folder)
    return done, state


def _check_payload(payload: Any, target: Path, folder: Path, print_: str) -> None:
    """A payload of this format and version, of this run, whose seal matches its content."""
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or set(payload) != FIELDS:
        raise GraftError(f"checkpoint {target} is not a graftmerge estimate checkpoint of this version; "
                         f"{_redo(folder)}")
    if payload["version"] != VERSION or type(payload["version"]) is not int:
        raise GraftError(f"checkpoint {target} has version {payload['version']!r}, this graftmerge resumes "
                         f"version {VERSION}; {_redo(folder)}")
    if payload["fingerprint"] != print_:
        raise GraftError(
            f"checkpoint {folder} belongs to a run with other settings (model content, data, kind, batch size or "
            f"number of processes); {_redo(folder)}"
        )
    state = payload["state"]
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              and v.layout == torch.strided and not v.is_quantized
                                              for k, v in state.items()):
        raise GraftError(f"checkpoint {target} is damaged (its sums are not dense tensors by name); "
                         f"{_redo(folder)}")
    try:
        sealed = seal(payload)
    except (TypeError, ValueError, RuntimeError) as error:
        raise GraftError(f"checkpoint {target} is damaged ({error}); {_redo(folder)}") from error
    if not isinstance(payload["seal"], str) or payload["seal"] != sealed:
        raise GraftError(f"checkpoint {target} was edited or damaged (its content does not match its seal); "
                         f"{_redo(folder)}")


def check_sums(state: dict[str, torch.Tensor], expected: Expected, target: Path, folder: Path) -> None:
    """Every sum this run needs, no other, each with its shape and dtype, finite and possible as a sum."""
    optional = expected.optional or {}
    missing = sorted({*expected.sums, "counts"} - set(state))
    unknown = sorted(set(state) - set(expected.sums) - set(optional) - {"counts"})
    if missing or unknown:
        which = f"lacks {missing[0]!r}" if missing else f"holds {unknown[0]!r}, which this run does not sum"
        raise GraftError(f"checkpoint {target} {which}; {_redo(folder)}")
    for key, tensor in sorted(state.items()):
        if key == "counts":
            continue
        shape, dtype = expected.sums.get(key) or optional[key]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise GraftError(f"checkpoint {target}: sum {key!r} is {tuple(tensor.shape)} {tensor.dtype}, this run's "
                             f"is {shape} {dtype}; {_redo(folder)}")
        problem = sum_problem(key, tensor)
        if problem:
            raise GraftError(f"checkpoint {target}: sum {key!r} {problem}; {_redo(folder)}")


def sum_problem(key: str, tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` cannot be a sum of squares (diagonal) or of outer products (a factor side); None if it can.

    A factor sum need only be right on and above its diagonal blocks (``kfac_factors.add_covariance``),
    so only that part is checked: |A_ij| ≤ √(A_ii A_jj) there, up to rounding.
    """
    if tensor.numel() == 0:
        return None
    if not bool(torch.isfinite(tensor).all()):
        return "holds NaN or Inf"
    if tensor.dim() < 2 or key.startswith("diagonal/"):
        return "holds a negative value, which no sum of squares has" if bool((tensor < 0).any()) else None
    diagonal = tensor.diagonal()
    if bool((diagonal < 0).any()):
        return "has a negative diagonal entry, which no sum of outer products has"
    roots = diagonal.sqrt()
    slack = 1e-6 * float(diagonal.max())
    for start in range(0, tensor.shape[0], STRIP_ROWS):  # by strips: no d × d temporary
        stop = min(start + STRIP_ROWS, tensor.shape[0])
        bound = roots[start:stop, None] * roots[None, start:] * (1 + CAUCHY_SCHWARZ_SLACK) + slack
        excess = tensor[start:stop, start:].abs() - bound
        if bool((torch.triu(excess) > 0).any()):
            return "breaks |A_ij| ≤ √(A_ii·A_jj), which every sum of outer products keeps"
    return None


def check_counts(counts: torch.Tensor, expected: tuple[int, int, int], done: int, target: Path,
                 folder: Path) -> None:
    """The counts are exactly the sequences, tokens and completion tokens of the first ``done`` batches."""
    if counts.dtype != torch.float64 or tuple(counts.shape) != (3,) or counts.tolist() != [float(v) for v in expected]:
        shown = counts.tolist() if counts.numel() <= 3 else f"{tuple(counts.shape)} values"
        raise GraftError(f"checkpoint {target}: counts {shown} are not the (sequences, tokens, completion tokens) "
                         f"{list(expected)} of the first {done} batches; {_redo(folder)}")


def keep_rollouts(folder: Path, print_: str, rollouts: list, write: Callable[[Path, list], None]) -> None:
    """Keep the sampled rollouts with the checkpoint: the file, then its record (what drew them, its sha256)."""
    folder.mkdir(parents=True, exist_ok=True)
    fresh = folder / (ROLLOUTS_NAME + ".new")
    write(fresh, rollouts)
    record = {"format": FORMAT + ".rollouts", "fingerprint": print_, "sha256": file_sha256(fresh)}
    tmp = folder / (ROLLOUTS_RECORD + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, folder / ROLLOUTS_RECORD)
    os.replace(fresh, folder / ROLLOUTS_NAME)


def kept_rollouts(folder: Path, print_: str) -> Path | None:
    """The rollouts file kept with the checkpoint when it was drawn by this run's sampling and is unedited; None
    when none is kept; GraftError for samples of other prompts, model or settings, or an edited file."""
    kept, record_file = folder / ROLLOUTS_NAME, folder / ROLLOUTS_RECORD
    if not kept.exists():
        return None
    try:
        record = json.loads(record_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        record = None
    if not isinstance(record, dict) or record.get("format") != FORMAT + ".rollouts":
        raise GraftError(f"the samples kept in {folder} have no sound record of how they were drawn; "
                         f"{_redo(folder)}")
    if record.get("fingerprint") != print_:
        raise GraftError(f"the samples kept in {folder} were drawn from other prompts, another model or other "
                         f"sampling settings; {_redo(folder)}")
    if record.get("sha256") != file_sha256(kept):
        raise GraftError(f"the samples kept in {kept} were edited since they were drawn; {_redo(folder)}")
    return kept


def clear(folder: Path) -> None:
    """Delete the checkpoints (a finished run, or --restart); absent is fine."""
    shutil.rmtree(folder, ignore_errors=True)
