"""The demo world as a user's model and task files: a real tokenizer, a chat template, tasks.yml.

The demo's models are ordinary Hugging Face folders: a word-level ``PreTrainedTokenizerFast``
over the world's vocabulary (ids unchanged, so the trained embeddings still match) with a
chat template that renders ``<bos> <user> question <assistant> answer <eos>``, the demo's
chat format, token for token. Its old and new tasks are written as the JSONL + tasks.yml
that ``graftmerge eval`` and ``graftmerge sweep --eval`` read (docs/evaluation.md), so the
demo scores every model with :class:`graftmerge.evaluation.Evaluator`, as a user would.

``tasks.yml`` is what selection judges: old = task A (exact), new = the new facts (exact).
``diagnostics.yml`` scores the new facts two more ways, reported beside accuracy and never
used to choose: ``nll`` (mean per-token NLL of the answer, a continuous score) and
``choice`` (the answer's log-likelihood against the relation's 8 values: 8-way accuracy).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from experiments.demo.world import ANSWER, ASSISTANT, EOS, RELATIONS, SPECIALS, USER, Example, Splits, World

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}<user> {{ message['content'] }} "
    "{% elif message['role'] == 'assistant' %}<assistant> {{ message['content'] }} <eos>"
    "{% else %}{{ raise_exception('the demo model knows user and assistant turns only') }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
TASKS, DIAGNOSTICS = "tasks.yml", "diagnostics.yml"


def world_tokenizer(world: World) -> PreTrainedTokenizerFast:
    """A word-level fast tokenizer whose ids are the world's (``world.encode``), with the demo's chat template."""
    backend = Tokenizer(models.WordLevel(vocab=dict(world.index), unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", additional_special_tokens=SPECIALS[3:])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def chat_line(world: World, example: Example, split: str) -> dict:
    """A chat example (``<bos> <user> q <assistant> a <eos>``, no article) as a data line of a task file."""
    ids = example.ids
    if ids[1] != USER or ids[example.answer_start - 1] != ASSISTANT or ids[-1] != EOS:
        raise ValueError("only chat examples without an article can be written as task lines")
    question = world.decode(ids[2 : example.answer_start - 1])
    return {"messages": [{"role": "user", "content": question}], "answer": world.decode(ids[example.answer_start:-1]),
            "split": split}


def _choices(world: World, line: dict) -> dict:
    """A new-fact line with the 8 answers its relation allows (the true one among them)."""
    relation = next(r for r in RELATIONS if f" {r} " in f" {line['answer']} ")
    return {**line, "choices": [ANSWER.format(r=relation, v=v) for v in RELATIONS[relation]]}


def _reply_tokens(examples: list[Example]) -> int:
    """The longest answer with its ``<eos>``: a reply cut there is right exactly when teacher forcing of
    every answer token and the ``<eos>`` is (anything longer is wrong either way), at a fraction of the cost."""
    return max(len(e.ids) - e.answer_start for e in examples)


def _write_jsonl(path: Path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def write_task_files(world: World, splits: Splits, folder: Path) -> tuple[Path, Path]:
    """tasks.yml (old: task A, new: the new facts; exact) and diagnostics.yml (new facts: nll, choice) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    old = [chat_line(world, e, "validation") for e in splits.old_validation]
    old += [chat_line(world, e, "test") for e in splits.old_test]
    new = [chat_line(world, e, "validation") for e in splits.new_validation]
    new += [chat_line(world, e, "test") for e in splits.new_test]
    _write_jsonl(folder / "old-task-a.jsonl", old)
    _write_jsonl(folder / "new-facts.jsonl", new)
    _write_jsonl(folder / "new-facts-choices.jsonl", [_choices(world, line) for line in new])
    (folder / TASKS).write_text(
        "tasks:\n"
        f"  - name: task-a\n    role: old\n    data: old-task-a.jsonl\n    metric: exact\n"
        f"    max_new_tokens: {_reply_tokens(splits.old_validation + splits.old_test)}\n"
        f"  - name: new-facts\n    role: new\n    data: new-facts.jsonl\n    metric: exact\n"
        f"    max_new_tokens: {_reply_tokens(splits.new_validation + splits.new_test)}\n")
    (folder / DIAGNOSTICS).write_text(
        "tasks:\n"
        "  - name: new-facts-nll\n    role: new\n    data: new-facts.jsonl\n    metric: nll\n"
        "  - name: new-facts-choice\n    role: new\n    data: new-facts-choices.jsonl\n    metric: choice\n")
    return folder / TASKS, folder / DIAGNOSTICS
