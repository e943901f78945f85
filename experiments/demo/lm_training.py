"""The LM demo's training jobs: pretraining + post-training (one per seed), and each update's run.

Each job is a plain function of (settings, seed, folder) that rebuilds the seed's world
and splits (deterministic), trains with one torch thread, saves models as safetensors
folders and returns JSON-ready timings. Jobs may run in parallel processes: one thread
each, so a seed's results do not depend on how many run at once.
"""

from __future__ import annotations

import copy
import random
import statistics
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers

from experiments.demo.lm import (
    TrainLog,
    TrainSettings,
    build_model,
    epoch_batches,
    load_model,
    parameter_count,
    save_model,
    score,
    steps_per_epoch,
    train,
)
from experiments.demo.lm_settings import LmDemoSettings, Update, replay_of
from experiments.demo.lm_tasks import world_tokenizer, write_task_files
from experiments.demo.opsd import SamplingClock, distillation_loss
from experiments.demo.world import OLD_TASK, Example, Splits, World, make_splits

Progress = Callable[[int], None]


def seed_world(settings: LmDemoSettings, seed: int) -> tuple[World, Splits]:
    """The seed's world (its facts) and every data split, the same in every process."""
    world = World(settings.known_entities, settings.new_entities, seed=seed, balanced_new=settings.balanced_new)
    return world, make_splits(world, settings.splits, seed)


def one_thread() -> None:
    """Pin this process to one torch thread (results must not depend on how many processes run); quiet saves."""
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def donor_steps(settings: LmDemoSettings) -> dict[int, str]:
    """Pretraining step → donor saved there: before the anneal, half-way through it, at the end."""
    decay = round(settings.decay_start * settings.pretrain_steps)
    steps = {decay: "pre_anneal", (decay + settings.pretrain_steps) // 2: "mid_anneal", settings.pretrain_steps: "end"}
    if "late" in settings.donors:
        steps[round(settings.late_donor * settings.pretrain_steps)] = "late"
    return steps


def _pretraining_stream(world: World, settings: LmDemoSettings, splits: Splits,
                        rng: random.Random) -> Iterator[list[Example]]:
    """The broad mixture; in the anneal, ``pretrain_task_a`` of each batch is task A on post-training lists."""
    decay = round(settings.decay_start * settings.pretrain_steps)
    lists, operations = splits.lists["post_train"], list(OLD_TASK)
    for step in range(settings.pretrain_steps):
        share = settings.stable_chat if step < decay else settings.anneal_chat
        batch = world.pretraining_batch(settings.batch_size, share, rng)
        if settings.pretrain_task_a and step >= decay:
            batch = [world.task_a(rng.choice(operations), world.digits(rng.choice(lists)))
                     if rng.random() < settings.pretrain_task_a else example for example in batch]
        yield batch


def _log_summary(log: TrainLog, steps: int) -> dict[str, float]:
    """Final loss and the median seconds per step (the first steps, warming up, included)."""
    return {"steps": steps, "final_loss": log.losses[-1], "step_seconds": statistics.median(log.seconds)}


def pretrain_and_post_train(settings: LmDemoSettings, seed: int, root: Path, progress: Progress | None) -> dict:
    """Pretrain (WSD, chat-heavy anneal; donors saved on the way), then post-train on task A (θpost)."""
    one_thread()
    world, splits = seed_world(settings, seed)
    models = root / "models"
    model = build_model(settings.size, world.vocab_size, seed)
    saves = donor_steps(settings)

    def save_donor(step: int, trained) -> None:
        """Save a donor at the steps of :func:`donor_steps`."""
        if step in saves:
            save_model(trained, models / f"donor-{saves[step]}")

    pretrain = TrainSettings(settings.pretrain_steps, settings.pretrain_lr, schedule="wsd",
                             decay_start=settings.decay_start, answer_only=False)
    log = train(model, _pretraining_stream(world, settings, splits, random.Random(seed)), pretrain,
                after_step=save_donor, progress=progress)
    summary: dict[str, Any] = {"parameters": parameter_count(model), "vocabulary": world.vocab_size,
                               "pretrain": _log_summary(log, settings.pretrain_steps)}
    post = copy.deepcopy(model)
    middle = settings.post_steps // 2

    def save_mid_post(step: int, trained) -> None:
        """Save the mid-post-training donor."""
        if step == middle:
            save_model(trained, models / "donor-mid_post")

    log = train(post, epoch_batches(splits.post_train, settings.batch_size, seed),
                TrainSettings(settings.post_steps, settings.post_lr), after_step=save_mid_post, progress=progress)
    save_model(post, models / "post")
    tokenizer = world_tokenizer(world)
    for folder in models.iterdir():  # every model an ordinary HF folder: `graftmerge eval` scores it as it is
        tokenizer.save_pretrained(folder)
    write_task_files(world, splits, root / "tasks")
    summary["post"] = _log_summary(log, settings.post_steps)
    summary["teacher_new_train"] = score(post, [e.in_context() for e in splits.new_train]).accuracy
    return summary


def update_steps(settings: LmDemoSettings, seed: int) -> int:
    """Steps of one update run: the largest epoch count of the new-fact mixture (the longest replay's)."""
    _, splits = seed_world(settings, seed)
    count = len(splits.new_train) + max(len(splits.replay[r]) for r in settings.replays or (settings.replay,))
    return max(settings.epochs) * steps_per_epoch(count, settings.batch_size)


def train_update(settings: LmDemoSettings, seed: int, root: Path, update: Update, progress: Progress | None) -> dict:
    """One update run on the new facts (+ replay); a snapshot folder after every epoch count of the grid."""
    one_thread()
    torch.manual_seed(zlib.crc32(f"{seed} {update.snapshot(0)}".encode()))  # OPSD's sampling, per run
    _, splits = seed_world(settings, seed)
    mixture = splits.new_train + splits.replay[replay_of(settings, update)]
    per_epoch = steps_per_epoch(len(mixture), settings.batch_size)
    snapshots = {epochs * per_epoch: epochs for epochs in settings.epochs}
    model = load_model(root / "models" / ("post" if update.start == "post" else f"donor-{update.start}"))

    def save_snapshot(step: int, trained) -> None:
        """Save the update's model after each epoch count of the grid."""
        if step in snapshots:
            save_model(trained, root / "updates" / update.snapshot(snapshots[step]))

    clock, loss = SamplingClock(), None
    if update.method == "opsd":
        teacher = load_model(root / "models" / "post")
        loss = lambda student, batch: distillation_loss(  # noqa: E731
            student, teacher, batch, update.divergence, settings.opsd_max_new_tokens, clock)
    log = train(model, epoch_batches(mixture, settings.batch_size, seed), TrainSettings(
        max(snapshots), update.learning_rate, schedule="constant"), loss_function=loss,
        after_step=save_snapshot, progress=progress)
    summary = {"family": update.family, "learning_rate": update.learning_rate, "replay": replay_of(settings, update),
               **_log_summary(log, max(snapshots))}
    if clock.seconds:
        summary["sampling_seconds"] = statistics.median(clock.seconds)
    return summary
