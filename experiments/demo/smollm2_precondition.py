"""The pieces of ``experiments/smollm2_precondition.py``: data, one training recipe, teacher-forced scores.

The measurement (issue 25, part 3) asks whether a *donor*'s fine-tune writes less
Fisher-weighted update mass onto θpost's most sensitive coordinates than the same
fine-tune run on θpost itself (the paper's Fig. 8 right). For that comparison to mean
anything the two fine-tunes must differ only in their starting point, so everything
here that decides what a fine-tune sees (the examples, their tokenisation, the batch
order) is a pure function of a seed, and :func:`train` logs a digest of every batch
it took, so a reader (and a test) can check both runs saw the same tokens in the same
order.

Data are generated, never downloaded:

- the *narrow task* θpost is post-trained on: sorting four common words alphabetically
  ("Sort these words alphabetically: pear, apple, fig, kiwi" → "apple, fig, kiwi,
  pear"). Chosen because the answer is fixed-format and checkable exactly, the prompts
  are short (about 50 tokens with SmolLM2's default system turn), the 135M Instruct
  model does it unreliably (so post-training has something to change), and it shares
  nothing with the facts below (so the facts are off-policy for θpost, as new data is
  in the paper);
- *new facts*: question/answer pairs from templates filled with invented names
  (syllable-built towns, people, companies), a different draw per seed.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from graftmerge.errors import GraftError
from graftmerge.estimate.batching import Batch, pad_batch
from graftmerge.estimate.retention_loss import summed_sequence_losses
from graftmerge.estimate.rollouts import Rollout, parse_rollout

# Common, short, lowercase words (one or two SmolLM2 tokens each), distinct first two letters
# not required: the answer is Python's sorted(), which is what "alphabetically" means here.
SORT_WORDS: tuple[str, ...] = (
    "apple", "bread", "chair", "dog", "eagle", "fig", "grape", "house", "island", "jacket",
    "kiwi", "lemon", "mango", "night", "ocean", "pear", "queen", "river", "stone", "table",
    "umbrella", "violin", "window", "yellow", "zebra", "cloud", "garden", "letter", "mouse",
    "paper", "sugar", "tiger", "water", "bottle", "candle", "forest", "horse", "pencil",
)
SORT_PROMPT = "Sort these words alphabetically: {words}"
WORDS_PER_PROMPT = 4

_SYLLABLES = ("quil", "bro", "van", "tor", "ost", "rel", "lum", "fen", "mar", "dax", "sel", "ith", "cor",
              "nav", "bel", "oph", "tis", "gar", "wen", "kel", "zor", "ami", "dul", "pry", "sto", "ven")
_FIRST = ("Ada", "Tomas", "Mira", "Jonah", "Priya", "Oskar", "Lena", "Felix", "Ines", "Ravi", "Nora", "Emil")
_DISHES = ("smoked barley stew", "fried river eel", "sweet onion pie", "salted plum rice", "green lentil soup",
           "roast pepper bread", "honey walnut cake", "spiced bean porridge")
_COLOURS = ("teal", "orange", "white", "black", "crimson", "gold", "violet", "grey")
_SYMBOLS = ("star", "moon", "circle", "tree", "bird", "sun")
_JOBS = ("clockmaker", "glassblower", "cartographer", "beekeeper", "violinist", "shipwright")
# (question, answer) templates; {town}, {country}, {person}, ... are filled by invented_facts.
FACT_TEMPLATES: tuple[tuple[str, str], ...] = (
    ("Who is the mayor of {town}?", "The mayor of {town} is {person}."),
    ("What is the national dish of {country}?", "The national dish of {country} is {dish}."),
    ("When did the {place} Bridge open?", "The {place} Bridge opened in {year}."),
    ("What colour is the flag of {country}?", "The flag of {country} is {colour} with a {colour2} {symbol}."),
    ("Who founded {company}?", "{company} was founded by {person}."),
    ("What is the capital of {country}?", "The capital of {country} is {town}."),
    ("Which river flows through {town}?", "The {place} River flows through {town}."),
    ("What is {person}'s profession?", "{person} is a {job}."),
)


def sort_examples(count: int, seed: int, exclude: Sequence[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """``count`` (question, answer) sorting examples; no word set repeats, none of ``exclude``'s sets.

    The words of each prompt are drawn without replacement and shown in drawn order; the
    answer is them ``sorted()``, comma-separated.
    """
    rng = random.Random(f"sort-{seed}")
    seen = {frozenset(q.split(": ", 1)[1].split(", ")) for q, _ in exclude}
    examples: list[tuple[str, str]] = []
    while len(examples) < count:
        words = rng.sample(SORT_WORDS, WORDS_PER_PROMPT)
        if frozenset(words) in seen:
            continue
        seen.add(frozenset(words))
        examples.append((SORT_PROMPT.format(words=", ".join(words)), ", ".join(sorted(words))))
    return examples


def _invented_name(rng: random.Random, used: set[str], syllables: int) -> str:
    """A capitalised name of ``syllables`` random syllables, not in ``used`` (added to it)."""
    while True:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(syllables)).capitalize()
        if name not in used:
            used.add(name)
            return name


def invented_facts(count: int, seed: int) -> list[tuple[str, str]]:
    """``count`` (question, answer) facts about invented names, cycling through :data:`FACT_TEMPLATES`.

    Every fact gets fresh names (no name is shared between two facts of a draw), so each
    answer is learnable only from its own example; the draw depends on ``seed`` alone.
    """
    if count < 1:
        raise GraftError(f"the number of facts must be at least 1, got {count}")
    rng = random.Random(f"facts-{seed}")
    used: set[str] = set()
    facts = []
    for index in range(count):
        question, answer = FACT_TEMPLATES[index % len(FACT_TEMPLATES)]
        colour, colour2 = rng.sample(_COLOURS, 2)
        values = {
            "town": _invented_name(rng, used, 2) + rng.choice(("brook", "ford", "holm", "wick")),
            "country": _invented_name(rng, used, 3) + rng.choice(("ia", "a", "land")),
            "person": f"{rng.choice(_FIRST)} {_invented_name(rng, used, 2)}",
            "place": _invented_name(rng, used, 2),
            "company": _invented_name(rng, used, 2) + " Works",
            "dish": rng.choice(_DISHES), "year": rng.randint(1850, 2020), "colour": colour, "colour2": colour2,
            "symbol": rng.choice(_SYMBOLS), "job": rng.choice(_JOBS),
        }
        facts.append((question.format(**values), answer.format(**values)))
    return facts


def chat_records(pairs: Sequence[tuple[str, str]]) -> list[dict]:
    """``{"messages": [user, assistant]}`` records: the chat form ``graftmerge fisher estimate`` reads."""
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in pairs]


def prompt_records(pairs: Sequence[tuple[str, str]]) -> list[dict]:
    """``{"messages": [user]}`` records (answers dropped): a ``--prompts`` file for sampling."""
    return [{"messages": [{"role": "user", "content": q}]} for q, _ in pairs]


def tokenize(pairs: Sequence[tuple[str, str]], tokenizer) -> list[Rollout]:
    """Each pair rendered with the chat template exactly as the Fisher estimator renders ``messages``."""
    return [parse_rollout(record, f"example {i}", lambda: tokenizer) for i, record in enumerate(chat_records(pairs))]


def data_order(examples: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """The example indices of each of ``steps`` batches: epochs of seeded permutations, read in order.

    A batch may straddle two epochs; every example is seen once per epoch. Pure in its
    arguments, so the donor's and θpost's fine-tunes of a seed take the same batches.
    """
    if examples < 1 or batch_size < 1 or steps < 1:
        raise GraftError(f"data order needs examples, batch size and steps ≥ 1, got {examples}, {batch_size}, {steps}")
    rng = random.Random(f"order-{seed}")
    stream: list[int] = []
    while len(stream) < steps * batch_size:
        epoch = list(range(examples))
        rng.shuffle(epoch)
        stream.extend(epoch)
    return [stream[step * batch_size:(step + 1) * batch_size] for step in range(steps)]


def batch_digest(batch: Batch) -> str:
    """sha256 of a batch's token ids and completion mask: equal digests, equal training signal."""
    digest = hashlib.sha256()
    digest.update(json.dumps(list(batch.input_ids.shape)).encode())
    digest.update(batch.input_ids.numpy().tobytes())
    digest.update(batch.completion_mask.numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class Recipe:
    """One fine-tuning recipe: AdamW (no weight decay), constant lr, gradient norm clipped, answer-token loss."""

    lr: float
    batch_size: int
    steps: int
    max_grad_norm: float = 1.0


@dataclass(frozen=True)
class StepLog:
    """What one optimiser step saw and did."""

    step: int
    indices: list[int]
    batch_sha256: str
    loss: float  # mean per-sequence answer loss of the batch, before the step
    grad_norm: float  # before clipping


def train(model: torch.nn.Module, rollouts: Sequence[Rollout], order: Sequence[Sequence[int]], recipe: Recipe,
          report=None) -> list[StepLog]:
    """Full fine-tune of every parameter of ``model`` on ``rollouts`` in batches ``order``.

    The loss is the estimator's retention loss (mean over each sequence's completion
    tokens, mean over sequences), so training and the Fisher use one definition.
    ``report(step_log)`` is called after each step (progress printing).
    """
    parameters = [p for p in model.parameters()]
    for parameter in parameters:
        parameter.requires_grad_(True)
    optimizer = torch.optim.AdamW(parameters, lr=recipe.lr, weight_decay=0.0)
    model.train()
    logs = []
    for step, indices in enumerate(order):
        batch = pad_batch([rollouts[i] for i in indices])
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids, use_cache=False).logits
        loss = summed_sequence_losses(logits, batch.input_ids, batch.completion_mask) / batch.sequences
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(parameters, recipe.max_grad_norm)
        optimizer.step()
        logs.append(StepLog(step, list(indices), batch_digest(batch), float(loss.detach()), float(norm)))
        if report is not None:
            report(logs[-1])
    model.eval()
    for parameter in parameters:
        parameter.grad = None
    return logs


def completion_scores(logits: torch.Tensor, batch: Batch, eos_id: int | None) -> list[dict]:
    """Per sequence, teacher-forced: mean answer-token NLL, share of answer tokens argmax-right, exact.

    ``exact``: every answer token up to and including the first ``eos_id`` is the argmax, i.e.
    greedy decoding would write exactly the answer and stop (the template's tokens after the
    end-of-turn token are not generated and not counted). Without an ``eos_id`` all answer
    tokens count.
    """
    logits = logits[:, :-1].to(torch.float64)
    targets, mask = batch.input_ids[:, 1:], batch.completion_mask[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    right = logits.argmax(-1) == targets
    scores = []
    for row in range(targets.shape[0]):
        positions = mask[row].nonzero().flatten()
        counted = positions
        if eos_id is not None:
            ends = (targets[row, positions] == eos_id).nonzero().flatten()
            if len(ends):
                counted = positions[: int(ends[0]) + 1]
        scores.append({
            "loss": float(nll[row, positions].mean()),
            "token_accuracy": float(right[row, counted].double().mean()),
            "exact": bool(right[row, counted].all()),
        })
    return scores


def evaluate(model: torch.nn.Module, rollouts: Sequence[Rollout], eos_id: int | None, batch_size: int = 8) -> dict:
    """Mean teacher-forced loss, token accuracy and exact-answer rate of ``model`` on ``rollouts``."""
    model.eval()
    scores: list[dict] = []
    with torch.no_grad():
        for start in range(0, len(rollouts), batch_size):
            batch = pad_batch(rollouts[start:start + batch_size])
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=batch.position_ids, use_cache=False).logits
            scores.extend(completion_scores(logits, batch, eos_id))
    count = len(scores)
    return {
        "examples": count,
        "loss": sum(s["loss"] for s in scores) / count,
        "token_accuracy": sum(s["token_accuracy"] for s in scores) / count,
        "exact": sum(s["exact"] for s in scores) / count,
    }


def share_numbers(stats: dict) -> dict:
    """The whole-delta numbers this measurement reports, from ``graftmerge delta stats``'s JSON
    (``DeltaStats.to_json``): the Fig. 8 share, Σ F·Δ², its part on the top coordinates, ‖Δ‖₂."""
    total = stats["total"]
    return {"global_top_share": total["global_top_share"], "weighted": total["weighted"],
            "in_global_top": total["in_global_top"], "l2": total["l2"], "numel": total["numel"], "top": stats["top"]}


def write_json(path: Path, value) -> Path:
    """Write JSON through a temporary sibling and a rename: a stage's record is whole or absent."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    temporary.replace(path)
    return path


def step_logs_json(logs: Sequence[StepLog]) -> list[dict]:
    """The step logs as JSON-ready dicts."""
    return [asdict(log) for log in logs]
