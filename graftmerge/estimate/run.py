"""``graftmerge fisher estimate`` as a library call: data → batches → sums → cache.

Works the same in one process and under ``torchrun`` (each rank takes every K-th
batch; sums are all-reduced; rank 0 writes). Rank 0 locks the output path before any
work, and nothing appears there until the cache is complete (the writer renames it into
place, manifest last, replacing an existing cache whole: ``formats.output_folder``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from tqdm.auto import tqdm

from graftmerge import __version__
from graftmerge.errors import GraftError
from graftmerge.estimate import checkpointing, distributed
from graftmerge.estimate.accumulator import FisherAccumulator
from graftmerge.estimate.batching import batches_of_rank, pad_batch, plan_batches, planned_counts
from graftmerge.estimate.model_loading import causal_lm_config, load_causal_lm, tokenizer_loader
from graftmerge.estimate.rollouts import (
    Rollout,
    RolloutStats,
    read_prompts,
    read_rollouts,
    rollouts_sha256,
    validate_rollouts,
    write_rollouts,
)
from graftmerge.estimate.sampling import (
    check_sampling,
    eos_token_ids,
    prompt_generator,
    sample_batch,
)
from graftmerge.formats.file_hash import file_sha256
from graftmerge.formats.fisher_cache import FisherCacheWriter
from graftmerge.formats.model_content import model_fingerprint
from graftmerge.formats.output_folder import NEW, OVERWRITE, OutputFolder

ACCUMULATOR_DTYPES = {"float32": torch.float32, "float64": torch.float64}
SAMPLING_SETTINGS = ("samples_per_prompt", "max_new_tokens", "temperature", "top_p", "seed", "sample_batch_size",
                     "dtype", "attn_implementation", "fsdp")
SUM_SETTINGS = ("kind", "modules", "batch_size", "dtype", "accumulator_dtype", "attn_implementation", "truncate",
                "fsdp")


@dataclass
class EstimateSettings:
    """Everything one estimate run needs: the ``fisher estimate`` options, plus ``extra`` for the estimator record."""

    model: Path
    output: Path
    kind: str = "diagonal"
    rollouts: Path | None = None
    prompts: Path | None = None
    samples_per_prompt: int = 1
    sample_batch_size: int = 16
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    save_rollouts: Path | None = None
    modules: tuple[str, ...] = ()
    batch_size: int = 8
    dtype: str = "auto"
    accumulator_dtype: str = "float32"
    truncate: bool = False
    checkpoint_every: int = 0
    restart: bool = False
    overwrite: bool = False
    device: str | None = None
    source: str | None = None
    revision: str | None = None
    attn_implementation: str = "sdpa"
    progress: bool = True
    trust_remote_code: bool = False  # run the model folder's own code (auto_map); never asked on the terminal
    fsdp: bool = False  # shard the model and the sums with FSDP2 (estimate.sharded_run; under torchrun)
    collective_timeout: float = 1800.0  # --fsdp: seconds before a collective that waits on a lost rank fails
    dry_run: bool = False  # print the memory each rank would need (estimate.memory_plan), run nothing
    extra: dict[str, Any] = field(default_factory=dict)


def _check(settings: EstimateSettings) -> None:
    if (settings.rollouts is None) == (settings.prompts is None):
        raise GraftError("pass exactly one of --rollouts FILE.jsonl or --prompts FILE.jsonl")
    if settings.output.exists() and not settings.overwrite:
        raise GraftError(f"{settings.output} already exists; pass --overwrite to replace it")
    if settings.batch_size < 1:
        raise GraftError("--batch-size must be at least 1")
    if settings.accumulator_dtype not in ACCUMULATOR_DTYPES:
        raise GraftError(
            f"--accumulator-dtype must be float32 or float64, not {settings.accumulator_dtype!r}"
        )
    if settings.checkpoint_every < 0:
        raise GraftError("--checkpoint-every must be ≥ 0")
    if settings.prompts is not None:
        check_sampling(
            settings.temperature,
            settings.top_p,
            settings.samples_per_prompt,
            settings.max_new_tokens,
            settings.sample_batch_size,
        )


def _sample_rollouts(
    settings: EstimateSettings,
    model,
    tokenizer: Callable[[], Any],
    ranks: distributed.Ranks,
    kept: Path | None,
    finish: Callable[[], None] | None = None,
) -> list[Rollout]:
    """Sample this rank's share of prompts; everyone gets all rollouts in prompt order.

    ``kept``: the samples a checkpoint kept, already checked to be this run's
    (``checkpointing.kept_rollouts``); resuming, the sums were made from them.
    ``finish()`` runs once this rank has sampled its prompts, before the ranks exchange
    them (``--fsdp``: join the other ranks' forwards until all are done).
    """
    if kept is not None:
        return read_rollouts(kept, tokenizer)[0]
    prompts = read_prompts(settings.prompts, tokenizer)
    mine = []
    # this rank's prompts, similar lengths together (less padding); each keeps its own
    # generator, so the grouping changes no sample
    indices = sorted(
        range(ranks.rank, len(prompts), ranks.world_size), key=lambda i: len(prompts[i][1])
    )
    size = settings.sample_batch_size
    bar = tqdm(
        total=len(indices),
        desc="sampling",
        unit="prompt",
        disable=not (settings.progress and ranks.is_main),
    )
    eos = eos_token_ids(model)
    for start in range(0, len(indices), size):
        chunk = indices[start : start + size]
        completions = sample_batch(
            model,
            [prompts[index][1] for index in chunk],
            samples=settings.samples_per_prompt,
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            generators=[prompt_generator(settings.seed, index, ranks.device) for index in chunk],
            eos_ids=eos,
        )
        for index, rows in zip(chunk, completions, strict=True):
            where, prompt = prompts[index]
            group = [Rollout(prompt, c, f"{where} sample {k}") for k, c in enumerate(rows)]
            mine.append((index, group))
        bar.update(len(chunk))
    bar.close()
    if finish is not None:
        finish()
    everything = sorted(pair for part in distributed.all_gather(ranks, mine) for pair in part)
    return [rollout for _, group in everything for rollout in group]


def estimate_fisher(
    settings: EstimateSettings, after_batch: Callable[[int], None] | None = None
) -> Path | None:
    """Estimate the retention Fisher and write the cache; returns its path on rank 0 (None elsewhere).

    ``after_batch(i)`` is called after the i-th batch of this rank (tests use it to interrupt).
    """
    if settings.fsdp:
        raise GraftError("estimate_fisher runs data-parallel; call "
                         "graftmerge.estimate.sharded_run.estimate_fisher_sharded for --fsdp")
    ranks = distributed.start(settings.device)
    try:
        with _output_folder(settings, ranks) as output:
            return _estimate(settings, ranks, after_batch, output)
    finally:
        distributed.stop(ranks)


def _output_folder(settings: EstimateSettings, ranks: distributed.Ranks):
    """Rank 0 locks the output before any work (a second run on it fails at once); other ranks write nothing."""
    if not ranks.is_main:
        return contextlib.nullcontext()
    return OutputFolder(settings.output, replace=OVERWRITE if settings.overwrite else NEW,
                        hint="pass --overwrite to replace it", inputs=[
                            ("model", settings.model), ("rollouts file", settings.rollouts),
                            ("prompts file", settings.prompts)])


def _estimate(settings: EstimateSettings, ranks: distributed.Ranks, after_batch,
              output: OutputFolder | None = None) -> Path | None:
    """One rank's run: data, its batches summed, sums all-reduced, the cache written by rank 0."""
    settings.output = Path(settings.output)
    _check(settings)
    config = causal_lm_config(settings.model, trust_remote_code=settings.trust_remote_code)
    load_model = lambda: load_causal_lm(  # noqa: E731
        settings.model,
        dtype=settings.dtype,
        device=ranks.device,
        attn_implementation=settings.attn_implementation,
        progress=settings.progress,
        trust_remote_code=settings.trust_remote_code,
    )
    tokenizer = tokenizer_loader(settings.model, trust_remote_code=settings.trust_remote_code)
    folder = checkpointing.checkpoint_folder(settings.output)
    if settings.restart and ranks.is_main:
        checkpointing.clear(folder)
    distributed.barrier(ranks)
    prints = {"model": model_fingerprint(settings.model, "post model") if settings.checkpoint_every else None}

    model, rollouts, stats, data = _retention_data(settings, ranks, load_model, tokenizer, folder, prints)
    max_length = getattr(config, "max_position_embeddings", None)
    rollouts = validate_rollouts(
        rollouts,
        stats,
        vocab_size=config.get_text_config().vocab_size,
        max_length=max_length,
        truncate=settings.truncate,
    )
    if model is None:  # bad data fails before the weights are read
        model = load_model()
    data["token_sha256"] = rollouts_sha256(rollouts)

    accumulator, seconds = _accumulate(settings, ranks, model, rollouts, data, folder, after_batch, prints)
    state = accumulator.state_dict()
    distributed.all_reduce_sum(ranks, state)
    accumulator.load_state_dict(state)
    if not ranks.is_main:
        distributed.barrier(ranks)
        return None
    try:
        counts = _counts(accumulator, stats)
        estimator = _estimator_record(settings, ranks, model, accumulator, data, max_length, seconds)
        _write_cache(settings, accumulator, counts, estimator, output)
        checkpointing.clear(folder)
    finally:
        distributed.barrier(ranks)
    return settings.output


def _retention_data(
    settings: EstimateSettings,
    ranks: distributed.Ranks,
    load_model: Callable[[], nn.Module],
    tokenizer: Callable[[], Any],
    folder: Path,
    prints: dict[str, str | None],
) -> tuple[nn.Module | None, list[Rollout], RolloutStats, dict[str, Any]]:
    """(model if sampling loaded it, rollouts, stats, the manifest's data record): read or sampled.

    With checkpoints, samples kept by an interrupted run are used only when they were drawn
    from the same prompts (by content), model (by content) and sampling settings
    (``prints["sampling"]``, :func:`sampling_fingerprint`), and are unedited.
    """
    if settings.rollouts is not None:
        rollouts, stats = read_rollouts(settings.rollouts, tokenizer)
        data = {
            "rollouts_file": str(settings.rollouts),
            "rollouts_file_sha256": file_sha256(settings.rollouts),
        }
        return None, rollouts, stats, data
    data = _sampling_record(settings)
    kept = None
    if settings.checkpoint_every:
        prompt_tokens = prompts_token_sha256(read_prompts(settings.prompts, tokenizer))
        prints["sampling"] = sampling_fingerprint(settings, prints["model"], prompt_tokens, ranks.world_size)
        kept = checkpointing.kept_rollouts(folder, prints["sampling"])
    model = load_model()
    rollouts = _sample_rollouts(settings, model, tokenizer, ranks, kept)
    stats = RolloutStats(lines=len(rollouts))
    if ranks.is_main:
        if settings.checkpoint_every and kept is None:
            checkpointing.keep_rollouts(folder, prints["sampling"], rollouts, write_rollouts)
        if settings.save_rollouts is not None:
            write_rollouts(settings.save_rollouts, rollouts, _maybe(tokenizer))
    return model, rollouts, stats, data


def _sampling_record(settings: EstimateSettings) -> dict[str, Any]:
    """How self-sampled rollouts were drawn, for the manifest (enough to draw them again)."""
    return {
        "prompts_file": str(settings.prompts),
        "prompts_file_sha256": file_sha256(settings.prompts),
        "sampled_from": "the post model (true Fisher)",
        "sampling": {
            "samples_per_prompt": settings.samples_per_prompt,
            "max_new_tokens": settings.max_new_tokens,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "top_k": None,
            "seed": settings.seed,
            "sample_batch_size": settings.sample_batch_size,
        },
    }


def prompts_token_sha256(prompts: list[tuple[str, tuple[int, ...]]]) -> str:
    """sha256 of the prompts' token ids (``read_prompts``): their text, chat template and tokenizer, as used."""
    return hashlib.sha256(json.dumps([list(ids) for _, ids in prompts]).encode()).hexdigest()


def sampling_fingerprint(settings: EstimateSettings, model: str, prompt_tokens: str, world_size: int) -> str:
    """Everything samples drawn from ``--prompts`` depend on: the model's content (``model_fingerprint``), the
    prompts file's bytes and tokens, every sampling setting, the weights' dtype, attention, processes."""
    return checkpointing.fingerprint({
        "model": model, "prompts_file_sha256": file_sha256(settings.prompts), "prompt_tokens": prompt_tokens,
        **{key: getattr(settings, key) for key in SAMPLING_SETTINGS}, "world_size": world_size,
    })


def _run_fingerprint(settings: EstimateSettings, ranks: distributed.Ranks, data: dict[str, Any],
                     prints: dict[str, str | None]) -> str:
    """Everything that determines this rank's sums: a checkpoint of another run is refused.

    The model by content (a model saved over the same path is another model), the data's
    tokens, how they were drawn (``prints["sampling"]``), and every estimator setting.
    """
    return checkpointing.fingerprint({
        "model": prints["model"], "data": data["token_sha256"], "sampling": prints.get("sampling"),
        **{key: getattr(settings, key) for key in SUM_SETTINGS}, "world_size": ranks.world_size,
    })


def _accumulate(
    settings: EstimateSettings,
    ranks: distributed.Ranks,
    model: nn.Module,
    rollouts: list[Rollout],
    data: dict[str, Any],
    folder: Path,
    after_batch: Callable[[int], None] | None,
    prints: dict[str, str | None],
) -> tuple[FisherAccumulator, float]:
    """(this rank's sums, seconds): its batches fed to the accumulator, resumed from and saved to checkpoints."""
    plan = plan_batches([r.length for r in rollouts], settings.batch_size)
    mine = batches_of_rank(plan, ranks.rank, ranks.world_size)
    dtype = ACCUMULATOR_DTYPES[settings.accumulator_dtype]
    accumulator = FisherAccumulator(
        model, kind=settings.kind, modules=settings.modules, dtype=dtype
    )
    run_print = _run_fingerprint(settings, ranks, data, prints) if settings.checkpoint_every else ""
    start = 0
    if settings.checkpoint_every:
        expected = checkpointing.Expected(
            sums={k: (tuple(v.shape), v.dtype) for k, v in accumulator.state_dict().items() if k != "counts"},
            steps=len(mine), counts=lambda done: planned_counts(rollouts, mine[:done]))
        resumed = checkpointing.load(folder, ranks.rank, run_print, expected)
        if resumed is not None:
            start, state = resumed
            accumulator.load_state_dict({k: v.to(ranks.device) for k, v in state.items()})

    tokens_total = sum(rollouts[i].length for batch in mine for i in batch)
    tokens_done = sum(rollouts[i].length for batch in mine[:start] for i in batch)
    bar = tqdm(
        total=tokens_total,
        initial=tokens_done,
        unit="tok",
        unit_scale=True,
        desc=f"fisher {settings.kind}",
        disable=not (settings.progress and ranks.is_main),
    )
    began = time.perf_counter()
    with accumulator:
        for index in range(start, len(mine)):
            batch = pad_batch([rollouts[i] for i in mine[index]])
            accumulator.accumulate(batch)
            bar.update(batch.tokens)
            done = index + 1
            if (
                settings.checkpoint_every
                and (done % settings.checkpoint_every == 0)
                and done < len(mine)
            ):
                checkpointing.save(folder, ranks.rank, run_print, done, accumulator.state_dict())
            if after_batch is not None:
                after_batch(index)
    bar.close()
    return accumulator, time.perf_counter() - began


def _counts(accumulator: FisherAccumulator, stats: RolloutStats) -> dict[str, int]:
    """The manifest's counts: what the sums were made of, and what the input lost on the way."""
    return {
        "sequences": accumulator.sequences,
        "tokens": accumulator.tokens,
        "completion_tokens": accumulator.completion_tokens,
        "prompt_tokens": accumulator.tokens - accumulator.completion_tokens,
        "input_lines": stats.lines,
        "skipped_empty_completion": stats.skipped_empty_completion,
        "truncated": stats.truncated,
    }


def _estimator_record(
    settings: EstimateSettings,
    ranks: distributed.Ranks,
    model: nn.Module,
    accumulator: FisherAccumulator,
    data: dict[str, Any],
    max_length: int | None,
    seconds: float,
) -> dict[str, Any]:
    """The manifest's estimator record: tool, definitions and settings, so a cache says how it was made."""
    return {
        "tool": f"graftmerge {__version__}",
        "command": "graftmerge fisher estimate",
        "kind": settings.kind,
        "loss": "per-token mean NLL of completion tokens, per sequence (graftmerge docs/math.md#the-estimator)",
        "diagonal": "mean over sequences of squared per-sequence gradients",
        "kfac": "Q = token mean of a aᵀ, P = sequence mean of token-summed g gᵀ",
        "kfac_diagonal_sides": accumulator.diagonal_sides(),
        "data": data,
        "modules": list(settings.modules) or ["*"],
        "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "accumulator_dtype": settings.accumulator_dtype,
        "batch_size": settings.batch_size,
        "world_size": ranks.world_size,
        "max_length": max_length,
        "truncate": settings.truncate,
        "attn_implementation": settings.attn_implementation,
        "seconds": round(seconds, 3),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        **settings.extra,
    }


def _write_cache(
    settings: EstimateSettings,
    accumulator: FisherAccumulator,
    counts: dict[str, int],
    estimator: dict[str, Any],
    output: OutputFolder | None = None,
) -> None:
    """The means written as a cache; the writer renames it into place only once it is complete."""
    diagonal, kfac = accumulator.means()
    with FisherCacheWriter(
        settings.output,
        model=settings.model,
        source=settings.source,
        revision=settings.revision,
        estimator=estimator,
        counts=counts,
        overwrite=settings.overwrite,
        output=output,
    ) as writer:
        for name, tensor in diagonal.items():
            writer.add_diagonal(name, tensor)
        for name, (rows, columns) in kfac.items():
            writer.add_kfac(name, P=rows, Q=columns)


def _maybe(loader):
    """The tokenizer when the folder has one, else None (pre-tokenised data needs none)."""
    try:
        return loader()
    except GraftError:
        return None


def settings_dict(settings: EstimateSettings) -> dict[str, Any]:
    """``settings`` as JSON-ready values (paths as strings), for records and reports."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()}
