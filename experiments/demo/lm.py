"""Train and score the demo's small causal LM (a real transformers Qwen3, word-level ids).

Training is plain AdamW with the paper's settings (β = (0.9, 0.95), weight decay 0.01,
gradient clip 1.0) under a cosine, constant or warmup-stable-decay schedule, with any
loss (SFT's cross-entropy, OPSD's distillation) and a hook after each step (snapshots).
Scoring is exact match by teacher forcing: an answer counts when the argmax at every
answer position is the answer token, which is exactly "greedy decoding reproduces the
answer" (the paper decodes knowledge greedily), in one forward pass per batch instead of
a decoding loop.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from torch import nn

from experiments.demo.world import BOS, EOS, PAD, Example


@dataclass(frozen=True)
class ModelSize:
    """Shape of the demo model (Qwen3, tied embeddings)."""

    hidden_size: int = 128
    num_hidden_layers: int = 4
    intermediate_size: int = 384
    num_attention_heads: int = 4
    num_key_value_heads: int = 2


def build_model(size: ModelSize, vocab_size: int, seed: int) -> nn.Module:
    """A freshly initialised Qwen3ForCausalLM; ids of the specials set so sampling stops at EOS."""
    config = transformers.Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=size.hidden_size,
        num_hidden_layers=size.num_hidden_layers,
        intermediate_size=size.intermediate_size,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=size.num_key_value_heads,
        head_dim=size.hidden_size // size.num_attention_heads,
        max_position_embeddings=96,
        tie_word_embeddings=True,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        dtype="float32",
    )
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(config)


def load_model(folder: str | Path) -> nn.Module:
    """A saved model (or a merge output) back in float32, in eval mode, ready for :func:`score`."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, trust_remote_code=False
    ).eval()


def save_model(model: nn.Module, folder: str | Path) -> Path:
    """Real sharded safetensors (several shards even for a small model) + config.json."""
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="2MB")
    return Path(folder)


def parameter_count(model: nn.Module) -> int:
    """Number of parameters (tied embeddings counted once), for the demo's report."""
    return sum(p.numel() for p in model.parameters())


def batch_tensors(examples: Sequence[Example], answer_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (ids, labels); labels are -100 where no loss is taken."""
    width = max(len(example.ids) for example in examples)
    ids = torch.full((len(examples), width), PAD, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, example in enumerate(examples):
        ids[row, : len(example.ids)] = torch.tensor(example.ids)
        start = example.answer_start if answer_only else 1
        labels[row, start : len(example.ids)] = ids[row, start : len(example.ids)]
    return ids, labels


@dataclass(frozen=True)
class TrainSettings:
    """One training stage: its length, peak learning rate, learning-rate shape and loss positions.

    ``schedule``: "cosine" (warm-up 10% then cosine to 0), "constant" (warm-up 10% then
    flat: epoch snapshots of one run are then "E epochs at this rate"), or "wsd"
    (warm-up 5%, stable until ``decay_start`` of the steps, then linear decay to 0).
    """

    steps: int
    learning_rate: float
    schedule: str = "cosine"
    decay_start: float = 0.7
    answer_only: bool = True  # SFT trains on answers; pretraining on every token


def learning_rate_factor(settings: TrainSettings, step: int) -> float:
    """The multiplier of the peak learning rate at ``step`` (0-based) under ``settings.schedule``."""
    warmup = max(1, settings.steps // (20 if settings.schedule == "wsd" else 10))
    if step < warmup:
        return (step + 1) / warmup
    if settings.schedule == "constant":
        return 1.0
    if settings.schedule == "wsd":
        decay = round(settings.decay_start * settings.steps)
        return 1.0 if step < decay else max(0.0, (settings.steps - step) / max(1, settings.steps - decay))
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, settings.steps - warmup)))


def epoch_batches(examples: Sequence[Example], batch_size: int, seed: int) -> Iterator[list[Example]]:
    """Shuffled epochs of ``examples`` forever, ``ceil(n / batch_size)`` batches each (the last smaller)."""
    rng = random.Random(seed)
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        for start in range(0, len(order), batch_size):
            yield [examples[i] for i in order[start : start + batch_size]]


def steps_per_epoch(count: int, batch_size: int) -> int:
    """Batches in one epoch of ``count`` examples (see :func:`epoch_batches`)."""
    return -(-count // batch_size)


def cross_entropy(model: nn.Module, batch: Sequence[Example], answer_only: bool = True) -> torch.Tensor:
    """Mean next-token loss of ``batch`` (answer tokens only, or every token after ``<bos>``)."""
    ids, labels = batch_tensors(batch, answer_only)
    return model(input_ids=ids, attention_mask=(ids != PAD).long(), labels=labels).loss


# (model, batch) -> loss; SFT's is cross_entropy, OPSD's samples and distils
LossFunction = Callable[[nn.Module, Sequence[Example]], torch.Tensor]
# (steps done, model) -> None; called after every step (snapshots, donor saves)
StepHook = Callable[[int, nn.Module], None]


@dataclass
class TrainLog:
    """Loss and wall time of every step."""

    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def train(model: nn.Module, batches: Iterator[list[Example]], settings: TrainSettings,
          loss_function: LossFunction | None = None, after_step: StepHook | None = None,
          progress: Callable[[int], None] | None = None) -> TrainLog:
    """AdamW (β = (0.9, 0.95), weight decay 0.01, clip 1.0) for ``settings.steps`` batches of ``batches``."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, betas=(0.9, 0.95), weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: learning_rate_factor(settings, step))
    loss_function = loss_function or (lambda m, b: cross_entropy(m, b, settings.answer_only))
    log = TrainLog()
    for step in range(settings.steps):
        started = time.perf_counter()
        loss = loss_function(model, next(batches))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        log.seconds.append(time.perf_counter() - started)
        log.losses.append(loss.item())
        if after_step is not None:
            after_step(step + 1, model)
        if progress is not None:
            progress(1)
    model.eval()
    return log


@dataclass(frozen=True)
class Score:
    """Exact-match accuracy and mean answer-token NLL of one model on one test set."""

    accuracy: float
    answer_nll: float


@torch.no_grad()
def score(model: nn.Module, examples: Sequence[Example], batch_size: int = 256) -> Score:
    """Teacher-forced exact match (= greedy decoding reproduces every answer token)."""
    model.eval()
    correct = 0
    nll_sum = 0.0
    tokens = 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        ids, labels = batch_tensors(chunk, answer_only=True)
        logits = model(input_ids=ids, attention_mask=(ids != PAD).long()).logits[:, :-1].double()
        targets = labels[:, 1:]
        scored = targets != -100
        hits = (logits.argmax(-1) == targets) | ~scored
        correct += int(hits.all(dim=1).sum())
        log_probs = torch.log_softmax(logits, dim=-1)
        picked = log_probs.gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1)
        nll_sum -= float(picked[scored].sum())
        tokens += int(scored.sum())
    return Score(correct / len(examples), nll_sum / max(tokens, 1))
