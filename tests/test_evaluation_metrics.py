"""Each metric of a tasks file against a hand computation on a tiny chat model.

The model is a tiny Llama with a real (small) BPE tokenizer and a ChatML template,
taught a few replies by a few hundred optimizer steps, so greedy generation reproduces
some answers (and stops at ``<|im_end|>``) and misses others. The brute force is
written from the definitions in docs/evaluation.md, independently of the scorer:
continuations cut out of the template's own text, one sequence per forward, float64
for log-likelihoods, an explicit greedy loop without a KV cache for replies.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from graftmerge.demo.tiny_models import save_tiny_model
from graftmerge.errors import GraftError
from graftmerge.evaluation import (
    Evaluator,
    load_model_for_eval,
    load_tasks,
    normalised,
    role_scores,
)
from tests.helpers.tiny_tokenizer import save_tiny_chat_model

END = "<|im_end|>"
TAUGHT = [  # (question, reply the model is taught)
    ("What is the capital of Vantoria?", "The capital is Quillbrook."),
    ("Name a colour.", "Teal."),
    ("When did the bridge open?", "In 1987."),
    ("Who wrote the letter?", "The mayor wrote it."),
]
UNTAUGHT = ["Where is the library?", "Yes or no?", "What did the cat buy?"]


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def teach(model, tokenizer, pairs, steps: int = 300) -> None:
    """Full-batch AdamW on the chat renderings of ``pairs`` (every token), until greedy replies repeat them."""
    rows = [tokenizer.apply_chat_template(chat(q) + [{"role": "assistant", "content": a}], tokenize=True,
                                          return_dict=True)["input_ids"] for q, a in pairs]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        labels = ids.masked_fill(mask == 0, -100)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
    model.eval()


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    """A tiny Llama taught TAUGHT, saved (with its tokenizer) and loaded back as the CLI would load it."""
    root = tmp_path_factory.mktemp("eval-metrics")
    folder = save_tiny_chat_model(root / "random", architecture="llama", seed=0)
    model, tokenizer = load_model_for_eval(folder)
    torch.manual_seed(0)
    teach(model, tokenizer, TAUGHT)
    model.save_pretrained(root / "taught")
    tokenizer.save_pretrained(root / "taught")
    model, tokenizer = load_model_for_eval(root / "taught")
    return {"root": root, "folder": root / "taught", "model": model, "tokenizer": tokenizer}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_tasks(folder: Path, text: str) -> Path:
    (folder / "tasks.yml").write_text(text)
    return folder / "tasks.yml"


# ---- the brute force --------------------------------------------------------------------------

def continuation_text(tokenizer, messages: list[dict], answer: str) -> str:
    """What the template writes after the generation prompt for ``answer``, up to and including its end of turn."""
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": answer}], tokenize=False)
    assert full.startswith(prompt)
    suffix = full[len(prompt):]
    return suffix[: suffix.index(END) + len(END)]


def brute_logprobs(model64, tokenizer, messages, answer) -> list[float]:
    """log p of each continuation token, one sequence, float64."""
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(continuation_text(tokenizer, messages, answer), add_special_tokens=False)["input_ids"]
    assert answer_ids[-1] == tokenizer.convert_tokens_to_ids(END)
    ids = torch.tensor([prompt_ids + answer_ids])
    with torch.no_grad():
        logits = model64(input_ids=ids).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    return [float(logp[len(prompt_ids) + j - 1, token]) for j, token in enumerate(answer_ids)]


def brute_greedy(model, tokenizer, messages, max_new_tokens: int) -> str:
    """Greedy decoding by hand: one full forward per new token, stop at <|im_end|>; the decoded reply."""
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    end = tokenizer.convert_tokens_to_ids(END)
    reply = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(input_ids=torch.tensor([ids + reply])).logits[0, -1].argmax())
            if token == end:
                break
            reply.append(token)
    return tokenizer.decode(reply, skip_special_tokens=True)


@pytest.fixture(scope="module")
def model64(taught):
    model = type(taught["model"]).from_pretrained(taught["folder"], dtype=torch.float64)
    return model.eval()


# ---- the metrics ------------------------------------------------------------------------------

def test_taught_model_replies_as_taught(taught):
    """The fixture is what the other tests assume: taught replies come back greedily, ending the turn."""
    for question, answer in TAUGHT:
        assert brute_greedy(taught["model"], taught["tokenizer"], chat(question), 40) == answer


def generation_lines():
    lines = [{"messages": chat(q), "answer": a} for q, a in TAUGHT[:3]]  # exact hits
    lines.append({"messages": chat(TAUGHT[3][0]), "answer": "The mayor"})  # contains hit, exact miss
    lines += [{"messages": chat(q), "answer": "Teal."} for q in UNTAUGHT]  # whatever the model says
    return lines


def test_exact_and_contains_equal_a_hand_greedy_loop(taught, tmp_path):
    lines = generation_lines()
    write_jsonl(tmp_path / "gen.jsonl", lines)
    suite = load_tasks(write_tasks(tmp_path, "tasks:\n"
                                   "  - {name: e, role: new, data: gen.jsonl, metric: exact}\n"
                                   "  - {name: c, role: new, data: gen.jsonl, metric: contains, max_new_tokens: 24}\n"))
    scores = Evaluator(suite, taught["tokenizer"], progress=False).score(taught["model"])
    longest = max(len(taught["tokenizer"](continuation_text(taught["tokenizer"], line["messages"], line["answer"]),
                                          add_special_tokens=False)["input_ids"]) for line in lines)
    replies = [brute_greedy(taught["model"], taught["tokenizer"], line["messages"], 2 * longest + 16) for line in lines]
    exact = sum(reply.strip() == line["answer"].strip() for reply, line in zip(replies, lines)) / len(lines)
    short = [brute_greedy(taught["model"], taught["tokenizer"], line["messages"], 24) for line in lines]
    contains = sum(line["answer"] in reply for reply, line in zip(short, lines)) / len(lines)
    assert scores == {"e": {"validation": exact}, "c": {"validation": contains}}
    assert exact >= 3 / 7 and contains >= 4 / 7  # the taught replies are found


def test_nll_is_the_pooled_mean_over_answer_tokens_with_end_of_turn(taught, model64, tmp_path):
    lines = [{"messages": chat(q), "answer": a} for q, a in TAUGHT] + [
        {"messages": chat(q), "answer": "Teal."} for q in UNTAUGHT]
    lines[1]["messages"] = [{"role": "system", "content": "Give short answers."}] + lines[1]["messages"]
    write_jsonl(tmp_path / "nll.jsonl", lines)
    suite = load_tasks(write_tasks(tmp_path, "tasks:\n  - {name: n, role: old, data: nll.jsonl, metric: nll}\n"))
    got = Evaluator(suite, taught["tokenizer"], progress=False, batch_size=3).score(taught["model"])["n"]["validation"]
    logprobs = [lp for line in lines
                for lp in brute_logprobs(model64, taught["tokenizer"], line["messages"], line["answer"])]
    expected = -sum(logprobs) / len(logprobs)
    assert got == pytest.approx(expected, rel=1e-5)
    per_line = [brute_logprobs(model64, taught["tokenizer"], line["messages"], line["answer"]) for line in lines]
    assert -sum(per_line[0]) / len(per_line[0]) < 0.5 < -sum(per_line[-1]) / len(per_line[-1])  # taught vs not


def test_system_field_is_the_first_message(taught, model64, tmp_path):
    write_jsonl(tmp_path / "s.jsonl", [{"messages": chat(TAUGHT[0][0]), "answer": TAUGHT[0][1]}])
    suite = load_tasks(write_tasks(tmp_path, "tasks:\n  - {name: n, role: old, data: s.jsonl, metric: nll,"
                                   " system: Answer briefly.}\n"))
    got = Evaluator(suite, taught["tokenizer"], progress=False).score(taught["model"])["n"]["validation"]
    messages = [{"role": "system", "content": "Answer briefly."}, *chat(TAUGHT[0][0])]
    logprobs = brute_logprobs(model64, taught["tokenizer"], messages, TAUGHT[0][1])
    assert got == pytest.approx(-sum(logprobs) / len(logprobs), rel=1e-5)


def test_choice_takes_the_highest_total_log_likelihood(taught, model64, tmp_path):
    choices = [a for _, a in TAUGHT]
    lines = [{"messages": chat(q), "choices": choices, "answer": a} for q, a in TAUGHT]
    lines += [{"messages": chat(q), "choices": choices, "answer": choices[i % 4]} for i, q in enumerate(UNTAUGHT)]
    write_jsonl(tmp_path / "choice.jsonl", lines)
    suite = load_tasks(write_tasks(tmp_path,
                                   "tasks:\n  - {name: pick, role: old, data: choice.jsonl, metric: choice}\n"))
    got = Evaluator(suite, taught["tokenizer"], progress=False, batch_size=5).score(taught["model"])
    correct = 0
    for line in lines:
        totals = [sum(brute_logprobs(model64, taught["tokenizer"], line["messages"], c)) for c in choices]
        correct += choices[totals.index(max(totals))] == line["answer"]
    assert got == {"pick": {"validation": correct / len(lines)}}
    assert correct >= 4


def test_plain_text_prompts_score_the_answer_as_written(taught, model64, tmp_path):
    """A "prompt" line: the text with the tokenizer's own special tokens, the answer appended, no end of turn."""
    tokenizer = taught["tokenizer"]
    lines = [{"prompt": "The capital of the country is", "answer": " a large city"},
             {"prompt": "A cat went to the", "answer": " market", "split": "test"}]
    write_jsonl(tmp_path / "plain.jsonl", lines)
    suite = load_tasks(write_tasks(tmp_path, "tasks:\n  - {name: n, role: old, data: plain.jsonl, metric: nll}\n"
                                   "  - {name: e, role: new, data: plain.jsonl, metric: exact}\n"))
    got = Evaluator(suite, tokenizer, progress=False).score(taught["model"], ("validation", "test"))
    for line in lines:
        prompt = tokenizer(line["prompt"])["input_ids"]
        answer = tokenizer(line["answer"], add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model64(input_ids=torch.tensor([prompt + answer])).logits[0], -1)
        expected = -sum(float(logp[len(prompt) + j - 1, t]) for j, t in enumerate(answer)) / len(answer)
        assert got["n"][line.get("split", "validation")] == pytest.approx(expected, rel=1e-5)
        reply = []  # exact on plain text: as many greedy tokens as the answer has
        with torch.no_grad():
            for _ in answer:
                reply.append(int(taught["model"](input_ids=torch.tensor([prompt + reply])).logits[0, -1].argmax()))
        hit = tokenizer.decode(reply, skip_special_tokens=True).strip() == line["answer"].strip()
        assert got["e"][line.get("split", "validation")] == float(hit)


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "gpt2"])
def test_batching_and_padding_change_nothing(architecture, tmp_path):
    """Batch of 1 vs batch of N (left padding, positions per row): the same values, for three layouts."""
    model, tokenizer = load_model_for_eval(save_tiny_chat_model(tmp_path / architecture, architecture=architecture))
    questions = [q for q, _ in TAUGHT] + UNTAUGHT + ["A much longer question about the river, the bridge and the town?"]
    choices = ["Teal.", "In 1987.", "No."]
    lines = [{"messages": chat(q), "answer": choices[i % 3], "choices": choices} for i, q in enumerate(questions)]
    write_jsonl(tmp_path / "c.jsonl", lines)
    write_jsonl(tmp_path / "g.jsonl", [{k: v for k, v in line.items() if k != "choices"} for line in lines])
    suite = load_tasks(write_tasks(tmp_path, "tasks:\n"
                                   "  - {name: n, role: old, data: g.jsonl, metric: nll}\n"
                                   "  - {name: c, role: old, data: c.jsonl, metric: choice}\n"
                                   "  - {name: g, role: new, data: g.jsonl, metric: contains, max_new_tokens: 6}\n"))
    one = Evaluator(suite, tokenizer, batch_size=1, progress=False)
    many = Evaluator(suite, tokenizer, batch_size=len(lines), progress=False)
    batched, single = many.score(model), one.score(model)
    assert batched.keys() == single.keys() == {"n", "c", "g"}
    for name in single:
        assert batched[name]["validation"] == pytest.approx(single[name]["validation"], rel=1e-6), name
    pairs = [(p.prompt_ids, p.continuations[0]) for p in one.prepared["n"]]
    batched = many._logprobs(model, pairs, "")
    for pair, row in zip(pairs, batched):  # every token's log-probability, not only the means
        assert torch.allclose(row, one._logprobs(model, [pair], "")[0], rtol=0, atol=1e-5)
    prompts = [p.prompt_ids for p in one.prepared["g"]]  # greedy replies token for token
    assert many._replies(model, prompts, [6] * len(prompts), [2], "") == [
        one._replies(model, [p], [6], [2], "")[0] for p in prompts]


def test_non_finite_logits_give_nan_not_an_error(taught, tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [{"messages": chat(q), "answer": a, "choices": [a, "No."]} for q, a in TAUGHT])
    write_jsonl(tmp_path / "g.jsonl", [{"messages": chat(q), "answer": a} for q, a in TAUGHT])
    suite = load_tasks(write_tasks(tmp_path, "tasks:\n"
                                   "  - {name: n, role: old, data: g.jsonl, metric: nll}\n"
                                   "  - {name: c, role: old, data: d.jsonl, metric: choice}\n"
                                   "  - {name: e, role: new, data: g.jsonl, metric: exact}\n"))
    model, _ = load_model_for_eval(taught["folder"])
    with torch.no_grad():
        model.model.norm.weight[3] = float("inf")
    scores = Evaluator(suite, taught["tokenizer"], progress=False).score(model)
    assert all(math.isnan(scores[name]["validation"]) for name in ("n", "c", "e"))
    assert all(math.isnan(v) for v in role_scores(suite, scores, "validation").values())


def test_score_leaves_the_model_as_it_was(taught, tmp_path):
    write_jsonl(tmp_path / "g.jsonl", [{"messages": chat(TAUGHT[0][0]), "answer": TAUGHT[0][1]}])
    suite = load_tasks(write_tasks(tmp_path, "tasks:\n  - {name: n, role: old, data: g.jsonl, metric: nll}\n"))
    model = taught["model"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    try:
        Evaluator(suite, taught["tokenizer"], progress=False).score(model)
        assert model.training
    finally:
        model.eval()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ---- what the tokenizer decides ---------------------------------------------------------------

def test_no_chat_template_says_what_to_do(tmp_path):
    model, tokenizer = load_model_for_eval(save_tiny_chat_model(tmp_path / "m", chat_template=False))
    write_jsonl(tmp_path / "g.jsonl", [{"messages": chat("Hi"), "answer": "Hello."}])
    suite = load_tasks(write_tasks(tmp_path, "tasks:\n  - {name: n, role: old, data: g.jsonl, metric: nll}\n"))
    with pytest.raises(GraftError, match=r"g\.jsonl:1: .*has none.*--chat-template FILE.*\"prompt\""):
        Evaluator(suite, tokenizer)
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hi", "answer": " Hello."}])
    plain = load_tasks(write_tasks(tmp_path, "tasks:\n  - {name: n, role: old, data: p.jsonl, metric: nll}\n"))
    assert math.isfinite(Evaluator(plain, tokenizer, progress=False).score(model)["n"]["validation"])


def test_an_answer_that_tokenizes_to_nothing_is_refused(taught, tmp_path):
    write_jsonl(tmp_path / "g.jsonl", [{"messages": chat("Hi"), "answer": "Hello."},
                                       {"messages": chat("Hi"), "answer": "\u0301"}])
    suite = load_tasks(write_tasks(tmp_path, "tasks:\n  - {name: n, role: old, data: g.jsonl, metric: exact}\n"))
    with pytest.raises(GraftError, match=r"g\.jsonl:2: the answer .* tokenizes to nothing"):
        Evaluator(suite, taught["tokenizer"])
    write_jsonl(tmp_path / "c.jsonl", [{"prompt": "Hi", "answer": "Hello.", "choices": ["Hello.", "\u0301"]}])
    suite = load_tasks(write_tasks(tmp_path, "tasks:\n  - {name: n, role: old, data: c.jsonl, metric: choice}\n"))
    with pytest.raises(GraftError, match=r"c\.jsonl:1: the answer .* tokenizes to nothing"):
        Evaluator(suite, taught["tokenizer"])


def test_an_empty_split_is_refused_before_scoring(taught, tmp_path):
    write_jsonl(tmp_path / "g.jsonl", [{"messages": chat("Hi"), "answer": "Hello.", "split": "validation"}])
    suite = load_tasks(write_tasks(tmp_path, "tasks:\n  - {name: n, role: old, data: g.jsonl, metric: nll}\n"))
    with pytest.raises(GraftError, match=r"tasks\.yml:2: task 'n' has no test examples"):
        Evaluator(suite, taught["tokenizer"], splits=("test",))
    evaluator = Evaluator(suite, taught["tokenizer"], progress=False)
    with pytest.raises(GraftError, match="no test examples"):
        evaluator.score(taught["model"], ("test",))
    assert evaluator.score(taught["model"], ("validation", "test"), only_present=True).keys() == {"n"}


def test_a_sequence_longer_than_the_model_is_refused(taught, tmp_path):
    write_jsonl(tmp_path / "g.jsonl", [{"prompt": "the " * 600, "answer": " end"}])
    suite = load_tasks(write_tasks(tmp_path, "tasks:\n  - {name: n, role: old, data: g.jsonl, metric: nll}\n"))
    with pytest.raises(GraftError, match=r"g\.jsonl:1: .* more than the model's 512 positions"):
        Evaluator(suite, taught["tokenizer"]).score(taught["model"])


def test_chat_continuation_ends_with_the_end_of_turn(taught, tmp_path):
    write_jsonl(tmp_path / "g.jsonl", [{"messages": chat("Hi"), "answer": "Hello."}])
    suite = load_tasks(write_tasks(tmp_path, "tasks:\n  - {name: n, role: old, data: g.jsonl, metric: nll}\n"))
    prepared = Evaluator(suite, taught["tokenizer"]).prepared["n"][0]
    tokenizer = taught["tokenizer"]
    assert tokenizer.decode(list(prepared.continuations[0])) == "Hello." + END  # the template's "\n" after it is not
    assert prepared.end_ids == (tokenizer.convert_tokens_to_ids(END),) and prepared.reply == "Hello."


# ---- roles ------------------------------------------------------------------------------------

def test_role_scores_are_weighted_means_of_normalised_scores(tmp_path):
    write_jsonl(tmp_path / "g.jsonl", [{"prompt": "Hi", "answer": "Hello.", "split": "test"},
                                       {"prompt": "Hi", "answer": "Hello.", "choices": ["Hello.", "No."]}])
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hi", "answer": "Hello."}])
    suite = load_tasks(write_tasks(tmp_path, "tasks:\n"
                                   "  - {name: n, role: old, data: p.jsonl, metric: nll, weight: 3}\n"
                                   "  - {name: x, role: old, data: p.jsonl, metric: exact}\n"
                                   "  - {name: c, role: new, data: p.jsonl, metric: contains}\n"))
    scores = {"n": {"validation": 0.5, "test": 2.0}, "x": {"validation": 0.25}, "c": {"validation": 1.0}}
    assert normalised(suite.task("n"), 0.5) == pytest.approx(math.exp(-0.5))
    assert normalised(suite.task("x"), 0.25) == 0.25
    assert role_scores(suite, scores, "validation") == pytest.approx(
        {"old": (3 * math.exp(-0.5) + 0.25) / 4, "new": 1.0})
    assert role_scores(suite, scores, "test") == pytest.approx({"old": math.exp(-2.0)})  # no new task on test
    scores["x"]["validation"] = math.nan
    assert math.isnan(role_scores(suite, scores, "validation")["old"])
    assert role_scores(suite, scores, "validation")["new"] == 1.0


def test_replies_are_plain_argmax_whatever_the_generation_config_says(taught, tmp_path):
    write_jsonl(tmp_path / "g.jsonl", generation_lines())
    suite = load_tasks(write_tasks(tmp_path, "tasks:\n  - {name: e, role: new, data: g.jsonl, metric: exact}\n"))
    model, _ = load_model_for_eval(taught["folder"])
    evaluator = Evaluator(suite, taught["tokenizer"], progress=False)
    plain = evaluator.score(model)
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.no_repeat_ngram_size = 1
    model.generation_config.suppress_tokens = [taught["tokenizer"].convert_tokens_to_ids(END)]
    assert evaluator.score(model) == plain and plain["e"]["validation"] >= 3 / 7


def test_a_tokenizer_of_another_model_is_refused(taught, tmp_path):
    write_jsonl(tmp_path / "g.jsonl", [{"messages": chat("Hi"), "answer": "Hello."}])
    suite = load_tasks(write_tasks(tmp_path, "tasks:\n  - {name: n, role: old, data: g.jsonl, metric: nll}\n"))
    save_tiny_model(tmp_path / "small", architecture="llama", vocab_size=64, max_shard_size="50MB")
    taught["tokenizer"].save_pretrained(tmp_path / "small")
    small, _ = load_model_for_eval(tmp_path / "small")
    with pytest.raises(GraftError, match=r"g\.jsonl:1: token id \d+ is outside the model's vocabulary \(64\)"):
        Evaluator(suite, taught["tokenizer"]).score(small)
