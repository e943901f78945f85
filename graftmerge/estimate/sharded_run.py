"""``fisher estimate --fsdp``: the estimate sharded with FSDP2 over ``torchrun`` ranks.

Each rank builds the model on the meta device and reads only its own rows
(:mod:`sharded_loading`), takes every K-th batch as in a data-parallel run, and keeps
only the sums it owns (:mod:`sharded_accumulator`); the cache is written by all ranks
into one staging folder and published by rank 0 (:mod:`sharded_writer`).

Every failure that can be seen before the work starts is agreed first: each rank checks
the arguments, the model and the rollouts, and the ranks exchange their verdicts and
fingerprints in one all-gather, so bad input ends every rank with the same one-line
error and no rank waits on a collective another has left. Collectives time out after
``--collective-timeout`` seconds; a rank that dies mid-run makes the others fail at
their next collective (torchrun also stops them), and no cache is published.

``$GRAFTMERGE_TEST_STOP_AT=fisher-step:N`` (``formats.output_folder.stage_reached``) stops
each rank after its N-th step, checkpoint saved, so a test can kill one there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import math
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from graftmerge.errors import GraftError, OutOfMemory
from graftmerge.estimate import checkpointing, distributed, kfac_factors
from graftmerge.estimate.batching import batches_of_rank, pad_batch, plan_batches, planned_counts
from graftmerge.estimate.model_loading import causal_lm_config, tokenizer_loader
from graftmerge.estimate.rollouts import (
    Rollout,
    RolloutStats,
    read_prompts,
    read_rollouts,
    rollouts_sha256,
    validate_rollouts,
    write_rollouts,
)
from graftmerge.estimate.run import (
    ACCUMULATOR_DTYPES,
    _check,
    _counts,
    _estimator_record,
    _maybe,
    _sample_rollouts,
    _sampling_record,
    prompts_token_sha256,
    sampling_fingerprint,
    settings_dict,
)
from graftmerge.estimate.sharded_accumulator import ShardedFisherAccumulator
from graftmerge.estimate.sharded_loading import checked_meta_model, model_dtype, shard_and_fill
from graftmerge.estimate.sharded_sampling import LockstepModel
from graftmerge.estimate.sharded_writer import RankShardWriter, model_record, write_manifest
from graftmerge.formats.file_hash import file_sha256
from graftmerge.formats.model_content import model_fingerprint
from graftmerge.formats.output_folder import NEW, OVERWRITE, OutputFolder, stage_reached
from graftmerge.math.ownership import balanced_owners

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 1 << 20
PROBE_NAME = "shared-folder-probe"
OUT_OF_MEMORY = ("can't allocate memory", "out of memory", "Cannot allocate memory")
LOST_CONTACT = ("Connection reset", "Connection closed", "Connection refused", "Broken pipe", "Timed out",
                "timed out", "gloo", "NCCL")  # a collective whose peer died or hung
NOT_PER_RANK = ("device", "progress", "extra")  # settings that may differ between ranks


@dataclass
class Prepared:
    """What every rank agreed on before any work: data, the staging folder, the run's fingerprint."""

    config: Any
    rollouts: list[Rollout] | None  # None until sampled (--prompts)
    stats: RolloutStats | None
    data: dict[str, Any]
    staging: Path
    fingerprint: str
    sampling: str | None  # --prompts: what the samples depend on (run.sampling_fingerprint)


def start(device: str | None, timeout: float) -> distributed.Ranks:
    """Join the torchrun process group (created here if needed, with ``timeout`` on every collective)."""
    missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
    if missing:
        raise GraftError(
            f"--fsdp needs one process per device under torchrun (${missing[0]} is not set): "
            "torchrun --nproc-per-node N -m graftmerge fisher estimate MODEL ... --fsdp"
        )
    keep_large_buffers_off_the_heap()
    target = distributed.rank_device(device)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group(backend="nccl" if target.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=timeout))
    return distributed.Ranks(dist.get_rank(), dist.get_world_size(), target, started)


def keep_large_buffers_off_the_heap() -> None:
    """Have glibc map every buffer of 1 MiB or more on its own, so freeing one returns it to the system.

    A sharded run makes and frees a full-size buffer per parameter and per layer every
    batch. glibc's default threshold grows to the largest buffer freed so far (up to
    32 MiB), after which such buffers come from the heap, which fragments and never
    shrinks: on the 216M-parameter benchmark each rank's peak was 2.5–2.8 GiB instead of
    1.7 GiB. ``MALLOC_MMAP_THRESHOLD_`` set by the user wins; other C libraries are left alone.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except OSError:
        pass


def agree(ranks: distributed.Ranks, error: str | None, record: Any = None) -> list[Any]:
    """Every rank's ``record``; GraftError with the lowest failing rank's message on every rank if any failed."""
    gathered = distributed.all_gather(ranks, (error, record))
    errors = [e for e, _ in gathered if e]
    if errors:
        raise GraftError(errors[0])
    return [r for _, r in gathered]


def attempt(action: Callable[[], Any]) -> tuple[str | None, Any]:
    """(None, result) or (the GraftError's message, None): a failure to share before anyone waits."""
    try:
        return None, action()
    except GraftError as error:
        return str(error), None


def estimate_fisher_sharded(settings, after_batch: Callable[[int], None] | None = None) -> Path | None:
    """The ``--fsdp`` estimate: returns the cache's path on rank 0, None on the others."""
    ranks = start(settings.device, settings.collective_timeout)
    output: OutputFolder | None = None
    try:
        group = dist.new_group(backend="gloo" if ranks.device.type == "cpu" else "nccl",
                               timeout=timedelta(seconds=settings.collective_timeout))
        output, prepared = prepare(settings, ranks)
        return _run(settings, ranks, group, output, prepared, after_batch)
    except (MemoryError, torch.OutOfMemoryError) as error:
        raise OutOfMemory(out_of_memory(ranks, error)) from error
    except dist.DistError as error:
        raise GraftError(lost_contact(ranks, error)) from error
    except RuntimeError as error:
        if any(sign in str(error) for sign in OUT_OF_MEMORY):
            raise OutOfMemory(out_of_memory(ranks, error)) from error
        if any(sign in str(error) for sign in LOST_CONTACT):
            raise GraftError(lost_contact(ranks, error)) from error
        raise
    finally:
        if output is not None:
            output.close()  # unpublished staging is removed, the lock released
        distributed.stop(ranks)


def out_of_memory(ranks: distributed.Ranks, error: BaseException) -> str:
    """The one line a rank that ran out of memory prints."""
    first = (str(error).splitlines() or [type(error).__name__])[0]
    return (f"rank {ranks.rank} ({socket.gethostname()}) ran out of memory ({first}); no cache was written. "
            "Use more ranks, a smaller --batch-size, or see what each rank needs with --dry-run")


def lost_contact(ranks: distributed.Ranks, error: BaseException) -> str:
    """The one line a rank prints when another rank died, hung or timed out."""
    first = (str(error).splitlines() or [type(error).__name__])[0][:200]
    return (f"rank {ranks.rank} lost contact with the other ranks ({first}); one of them failed or was "
            "killed (its own output says why); no cache was written")


def prepare(settings, ranks: distributed.Ranks) -> tuple[OutputFolder | None, Prepared]:
    """Check everything on every rank and agree: the same verdict everywhere, then a shared staging folder."""
    settings.output = Path(settings.output)
    error, found = attempt(lambda: _checked_data(settings, _check))
    output = None
    if ranks.is_main and error is None:
        error, output = attempt(lambda: _open_output(settings))
    probe = secrets.token_hex(16)
    if output is not None:
        (output.root / PROBE_NAME).write_text(probe)
    staging = str(output.staging) if output is not None else None
    fingerprint = found[4] if found is not None else None
    records = agree(ranks, error, (fingerprint, staging, probe, socket.gethostname()))
    _check_same(records)
    staging, probe, host = records[0][1], records[0][2], records[0][3]
    seen = _probe_error(Path(staging), probe, host, ranks)
    agree(ranks, seen)
    if settings.restart and ranks.is_main:
        checkpointing.clear(checkpointing.checkpoint_folder(settings.output))
    distributed.barrier(ranks)
    config, rollouts, stats, data, _ = found
    run_print = checkpointing.fingerprint({**fingerprint, "world_size": ranks.world_size, "fsdp": True})
    sampling = (sampling_fingerprint(settings, fingerprint["model"], data["prompts_token_sha256"], ranks.world_size)
                if settings.prompts is not None else None)
    return output, Prepared(config, rollouts, stats, data, Path(staging), run_print, sampling)


def _fsdp_checks(settings) -> None:
    """What --fsdp does not do: one line each."""
    if settings.dry_run:
        raise GraftError("--dry-run estimates memory without starting ranks: run it without torchrun")


def _checked_data(settings, check: Callable) -> tuple:
    """The settings checked, then (config, rollouts, stats, data record, fingerprints) read from the files."""
    check(settings)
    _fsdp_checks(settings)
    found = _read_data(settings)
    return (*found, _fingerprints(settings, found))


def _read_data(settings) -> tuple[Any, list[Rollout] | None, RolloutStats | None, dict[str, Any]]:
    """(config, validated rollouts, stats, the manifest's data record): read by every rank from the shared files.

    With ``--prompts`` the rollouts are sampled later (None here); the prompts are read now, so a
    bad prompts file fails before any work, and their tokens stand in for the rollouts' hash.
    """
    config = causal_lm_config(settings.model, trust_remote_code=settings.trust_remote_code)
    tokenizer = tokenizer_loader(settings.model, trust_remote_code=settings.trust_remote_code)
    if settings.prompts is not None:
        data = {**_sampling_record(settings),
                "prompts_token_sha256": prompts_token_sha256(read_prompts(settings.prompts, tokenizer))}
        return config, None, None, data
    rollouts, stats = read_rollouts(settings.rollouts, tokenizer)
    rollouts = validate_rollouts(
        rollouts, stats, vocab_size=config.get_text_config().vocab_size,
        max_length=getattr(config, "max_position_embeddings", None), truncate=settings.truncate,
    )
    data = {"rollouts_file": str(settings.rollouts), "rollouts_file_sha256": file_sha256(settings.rollouts),
            "token_sha256": rollouts_sha256(rollouts)}
    return config, rollouts, stats, data


def _open_output(settings) -> OutputFolder:
    """Rank 0 locks OUT and opens its staging folder before any work (a second run on it fails at once)."""
    return OutputFolder(settings.output, replace=OVERWRITE if settings.overwrite else NEW,
                        hint="pass --overwrite to replace it",
                        inputs=[("model", settings.model), ("rollouts file", settings.rollouts),
                                ("prompts file", settings.prompts)]).open()


def _fingerprints(settings, found) -> dict[str, str]:
    """sha256 of this rank's arguments, model (by content: ``model_fingerprint``, as the one-process path) and
    rollout tokens: ranks must agree on all three, and a checkpoint resumes only the same three."""
    arguments = {k: v for k, v in settings_dict(settings).items() if k not in NOT_PER_RANK}
    return {
        "arguments": hashlib.sha256(json.dumps(arguments, sort_keys=True, default=str).encode()).hexdigest(),
        "model": model_fingerprint(settings.model, "post model"),
        "rollouts": found[3].get("token_sha256") or found[3]["prompts_token_sha256"],
    }


def _check_same(records: list[tuple]) -> None:
    """GraftError (the same on every rank) when two ranks read different arguments, models or rollouts."""
    for what in ("arguments", "model", "rollouts"):
        seen = [record[0][what] for record in records]
        other = next((rank for rank, value in enumerate(seen) if value != seen[0]), None)
        if other is not None:
            raise GraftError(
                f"ranks disagree on the {what}: rank 0 ({records[0][3]}) has {seen[0][:12]}…, rank {other} "
                f"({records[other][3]}) has {seen[other][:12]}…; every rank must run the same command on the "
                "same files (a shared file system, or identical copies)"
            )


def _probe_error(staging: Path, probe: str, host: str, ranks: distributed.Ranks) -> str | None:
    """None when this rank sees the probe rank 0 wrote beside the staging folder; else the one-line error."""
    try:
        if (staging.parent / PROBE_NAME).read_text() == probe:
            return None
    except OSError:
        pass
    return (f"the output folder is not shared: rank {ranks.rank} ({socket.gethostname()}) cannot see "
            f"{staging.parent}, which rank 0 ({host}) made beside --output; every rank writes its part of "
            "the cache there, so put --output on a file system every node mounts")


def _run(settings, ranks: distributed.Ranks, group, output: OutputFolder | None, prepared: Prepared,
         after_batch) -> Path | None:
    """Load this rank's shards, accumulate, write what it owns; rank 0 writes the manifest and publishes."""
    dtype = model_dtype(prepared.config, settings.dtype)
    error, built = attempt(lambda: checked_meta_model(
        settings.model, prepared.config, dtype=dtype, attn_implementation=settings.attn_implementation,
        trust_remote_code=settings.trust_remote_code))
    agree(ranks, error)
    model = shard_and_fill(built[0], built[1], device=ranks.device, rank=ranks.rank, world_size=ranks.world_size)
    if prepared.rollouts is None:
        agree(ranks, attempt(lambda: _sample(settings, ranks, group, model, prepared))[0])
    error, accumulator = attempt(lambda: ShardedFisherAccumulator(
        model, rank=ranks.rank, world_size=ranks.world_size, group=group, kind=settings.kind,
        modules=settings.modules, dtype=ACCUMULATOR_DTYPES[settings.accumulator_dtype]))
    agree(ranks, error)
    seconds = _accumulate(settings, ranks, accumulator, prepared, after_batch)
    totals = dict(zip(("sequences", "tokens", "completion_tokens"), accumulator.total_counts(), strict=True))
    parts = _write_owned(ranks, group, accumulator, prepared.staging, totals)
    error = None
    if ranks.is_main:
        error, _ = attempt(lambda: _publish(settings, ranks, model, accumulator, prepared, parts, totals, seconds,
                                            output))
    agree(ranks, error)
    if ranks.is_main:
        checkpointing.clear(checkpointing.checkpoint_folder(settings.output))
        return settings.output
    return None


def _sample(settings, ranks: distributed.Ranks, group, model, prepared: Prepared) -> None:
    """--prompts: every rank samples its prompts with the sharded weights, in step; all get every rollout."""
    folder = checkpointing.checkpoint_folder(settings.output)
    kept = checkpointing.kept_rollouts(folder, prepared.sampling) if settings.checkpoint_every else None
    tokenizer = tokenizer_loader(settings.model, trust_remote_code=settings.trust_remote_code)
    lockstep = LockstepModel(model, group)
    rollouts = _sample_rollouts(settings, lockstep, tokenizer, ranks, kept, finish=lockstep.finish)
    stats = RolloutStats(lines=len(rollouts))
    rollouts = validate_rollouts(
        rollouts, stats, vocab_size=prepared.config.get_text_config().vocab_size,
        max_length=getattr(prepared.config, "max_position_embeddings", None), truncate=settings.truncate,
    )
    if ranks.is_main:
        if settings.checkpoint_every and kept is None:
            checkpointing.keep_rollouts(folder, prepared.sampling, rollouts, write_rollouts)
        if settings.save_rollouts is not None:
            write_rollouts(settings.save_rollouts, rollouts, _maybe(tokenizer))
    prepared.data["token_sha256"] = rollouts_sha256(rollouts)
    prepared.rollouts, prepared.stats = rollouts, stats


def _accumulate(settings, ranks: distributed.Ranks, accumulator: ShardedFisherAccumulator, prepared: Prepared,
                after_batch) -> float:
    """Every rank runs the same number of steps (a rank out of batches adds nothing); checkpoints every N steps."""
    rollouts = prepared.rollouts
    plan = plan_batches([r.length for r in rollouts], settings.batch_size)
    mine = batches_of_rank(plan, ranks.rank, ranks.world_size)
    steps = -(-len(plan) // ranks.world_size)
    folder = checkpointing.checkpoint_folder(settings.output)
    expected = checkpointing.Expected(
        sums={f"diagonal/{k}": (tuple(v.shape), v.dtype) for k, v in accumulator.owned_diagonal.items()},
        optional={f"factor/{which}/{name}": (shape, ACCUMULATOR_DTYPES[settings.accumulator_dtype])
                  for which in ("rows", "columns") for name, shape in accumulator.shapes[which].items()},
        steps=steps, counts=lambda done: planned_counts(rollouts, mine[:done]))
    start = _resume(settings, ranks, accumulator, (prepared.fingerprint, expected), folder)
    bar = tqdm(total=sum(rollouts[i].length for batch in mine for i in batch), unit="tok", unit_scale=True,
               initial=sum(rollouts[i].length for batch in mine[:start] for i in batch),
               desc=f"fisher {settings.kind} (fsdp)", disable=not (settings.progress and ranks.is_main))
    began = time.perf_counter()
    with accumulator:
        for index in range(start, steps):
            if index < len(mine):
                batch = pad_batch([rollouts[i] for i in mine[index]])
                accumulator.accumulate(batch)
                bar.update(batch.tokens)
            else:
                accumulator.accumulate_nothing()
            done = index + 1
            if settings.checkpoint_every and done % settings.checkpoint_every == 0 and done < steps:
                checkpointing.save(folder, ranks.rank, prepared.fingerprint, done, accumulator.state_dict())
            stage_reached("fisher-step")  # test hook ($GRAFTMERGE_TEST_STOP_AT=fisher-step:N): stop after step N
            if after_batch is not None and index < len(mine):
                after_batch(index)
    bar.close()
    return time.perf_counter() - began


def _resume(settings, ranks: distributed.Ranks, accumulator: ShardedFisherAccumulator,
            expected: tuple[str, checkpointing.Expected], folder: Path) -> int:
    """The step every rank resumes from (0 without checkpoints), each rank's checkpoint (``expected``: the run's
    fingerprint and what its sums must be) checked field by field
    (``checkpointing.load``); a bad one, or ranks whose checkpoints disagree, are one error on every rank."""
    if not settings.checkpoint_every:
        return 0
    error, resumed = attempt(lambda: checkpointing.load(folder, ranks.rank, *expected))
    starts = agree(ranks, error, 0 if resumed is None else resumed[0])
    if len(set(starts)) > 1:
        raise GraftError(f"the checkpoints in {folder} stop at different steps on different ranks ({starts}); "
                         "pass --restart to start over")
    if resumed is not None:
        accumulator.load_state_dict(resumed[1])
    return starts[0]


def _write_owned(ranks: distributed.Ranks, group, accumulator: ShardedFisherAccumulator, staging: Path,
                 totals: dict[str, int]) -> list[dict[str, Any]]:
    """Each diagonal gathered to one writer (balanced by size), each owned side eigendecomposed: all records."""
    writer = RankShardWriter(staging, ranks.rank)
    errors: list[str | None] = []
    shapes = accumulator.shapes["diagonal"]
    names = sorted(accumulator.owned_diagonal)
    owners = balanced_owners([math.prod(shapes[name]) for name in names], ranks.world_size)
    for name, owner in zip(names, owners, strict=True):
        shard = accumulator.owned_diagonal.pop(name)
        parts = [torch.empty_like(shard) for _ in range(ranks.world_size)] if ranks.rank == owner else None
        dist.gather(shard, parts, dst=dist.get_global_rank(group, owner), group=group)
        if parts is not None:
            whole = torch.cat(parts)[: shapes[name][0]] / totals["sequences"]
            errors.append(attempt(lambda whole=whole, name=name: writer.add_diagonal(name, whole))[0])
    means = _side_means(ranks, accumulator, totals)
    for side in sorted(means):
        which, name = side.split("/", 1)
        where = f"KFAC factor {'P' if which == 'rows' else 'Q'} for {name!r}"
        errors.append(attempt(lambda side=side, where=where: writer.add_side(
            f"kfac/{side.split('/', 1)[1]}/{side.split('/', 1)[0]}", means.pop(side), where))[0])
    errors.append(attempt(writer.flush)[0])
    return agree(ranks, next((e for e in errors if e), None), writer.records())


def _side_means(ranks: distributed.Ranks, accumulator: ShardedFisherAccumulator,
                totals: dict[str, int]) -> dict[str, torch.Tensor]:
    """This rank's owned KFAC sides as means (docs/math.md#the-estimator), less those equal to an earlier side.

    Bit-identical sides (GPT-2's token and position embeddings get the same output
    gradient) are stored once, under the first weight, as the one-process writer does:
    owners exchange digests and every rank marks the later ones as aliases.
    """
    means, digests = {}, {}
    for side in list(accumulator.owned_factors):
        total = accumulator.owned_factors.pop(side)
        if total.dim() == 2:
            kfac_factors.mirror(total)
        which, name = side.split("/", 1)
        per_token = (which == "rows") == (accumulator.kfac_kind[name] == "embedding")
        means[side] = total.div_(totals["tokens"] if per_token else totals["sequences"])
        digests[side] = hashlib.sha256(means[side].to(torch.float64).contiguous().numpy().tobytes()).hexdigest()
    everyone = {side: digest for part in distributed.all_gather(ranks, digests) for side, digest in part.items()}
    first: dict[str, str] = {}
    for name in accumulator.kfac_kind:  # the order the one-process writer adds sides in
        for which in ("rows", "columns"):
            side = accumulator.stored_side(f"{which}/{name}")
            kept = first.setdefault(everyone[side], side)
            if kept != side:
                accumulator.factor_alias[side] = kept
                means.pop(side, None)
    return means


def cache_entries(accumulator: ShardedFisherAccumulator) -> dict[str, dict[str, Any]]:
    """The manifest's entries: each weight's diagonal key and KFAC sides (a shared side under its first weight)."""
    entries: dict[str, dict[str, Any]] = {}
    for name in accumulator.shapes["diagonal"]:
        entries.setdefault(name, {})["diagonal"] = {"key": name}
    for name in accumulator.kfac_kind:
        sides = {}
        for which in ("rows", "columns"):
            stored = accumulator.stored_side(f"{which}/{name}")
            sides[which] = f"kfac/{stored.split('/', 1)[1]}/{which}"
        entries.setdefault(name, {})["kfac"] = sides
    for entry in entries.values():
        entry["representation"] = "kfac" if "kfac" in entry else "diagonal"
    return entries


def _publish(settings, ranks: distributed.Ranks, model, accumulator: ShardedFisherAccumulator, prepared: Prepared,
             parts: list[dict[str, Any]], totals: dict[str, int], seconds: float, output: OutputFolder) -> None:
    """Rank 0: the manifest, last, then one rename puts the whole cache in place."""
    summed = SimpleNamespace(**totals)
    max_length = getattr(prepared.config, "max_position_embeddings", None)
    estimator = _estimator_record(settings, ranks, model, accumulator, prepared.data, max_length, seconds)
    estimator["fsdp"] = {"world_size": ranks.world_size, "shard": "dim 0 per decoder layer and root (FSDP2)"}
    write_manifest(prepared.staging, model=model_record(settings.model, settings.source, settings.revision),
                   estimator=estimator, counts=_counts(summed, prepared.stats), entries=cache_entries(accumulator),
                   ranks=parts)
    (prepared.staging.parent / PROBE_NAME).unlink(missing_ok=True)
    output.publish()
