"""The Evaluator's thread policy: the cores left free by the load, a fixed count on request, restored after.

On a shared 2-core machine two threads spinning against other jobs made an evaluation 4×
slower than one thread (issue 39); the policy is pure arithmetic on (cores, load), tested
here, and ``Evaluator.score`` runs under it without its scores depending on the count.
"""

from __future__ import annotations

import json

import pytest
import torch

from graftmerge.errors import GraftError
from graftmerge.evaluation import Evaluator, load_model_for_eval, load_tasks
from graftmerge.evaluation.threads import THREADS_VARIABLE, eval_threads, scoring_threads, usable_cores
from tests.helpers.tiny_tokenizer import save_tiny_chat_model


@pytest.fixture(autouse=True)
def no_thread_settings(monkeypatch):
    monkeypatch.delenv(THREADS_VARIABLE, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("cores", "load", "expected"), [
    (2, 0.0, 2), (2, 1.0, 2), (2, 1.4, 2), (2, 1.6, 1), (2, 14.0, 1),  # the machine: 1 under load
    (16, 1.0, 16), (16, 5.0, 12), (16, 40.0, 1), (1, 0.0, 1),
])
def test_threads_are_the_cores_the_load_leaves_free(cores, load, expected):
    assert eval_threads(cores, load) == expected


def test_the_count_never_exceeds_the_affinity_mask():
    assert 1 <= eval_threads() <= usable_cores()


def test_a_fixed_count_wins_over_the_load(monkeypatch):
    monkeypatch.setenv(THREADS_VARIABLE, "3")
    assert eval_threads(2, 14.0) == 3


@pytest.mark.parametrize("value", ["0", "-1", "two", "", "1.5"])
def test_a_bad_fixed_count_is_one_line_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(THREADS_VARIABLE, value)
    with pytest.raises(GraftError, match=f"{THREADS_VARIABLE}=.*positive whole number"):
        eval_threads(2, 0.0)


def test_omp_num_threads_is_left_to_torch(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    assert eval_threads(16, 0.0) == 1


def test_scoring_threads_sets_and_restores_also_on_error(monkeypatch):
    torch.set_num_threads(2)
    monkeypatch.setenv(THREADS_VARIABLE, "1")
    with pytest.raises(RuntimeError), scoring_threads() as chosen:
        assert chosen == 1 and torch.get_num_threads() == 1
        raise RuntimeError("inside")
    assert torch.get_num_threads() == 2


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-threads")
    model, tokenizer = load_model_for_eval(save_tiny_chat_model(root / "m", architecture="llama", seed=1))
    questions = ["What is the capital?", "Name a colour.", "Who wrote the letter?"]
    lines = [{"messages": [{"role": "user", "content": q}], "answer": "Teal."} for q in questions]
    (root / "g.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (root / "c.jsonl").write_text("".join(json.dumps({**line, "choices": ["Teal.", "No."]}) + "\n" for line in lines))
    (root / "tasks.yml").write_text("tasks:\n  - {name: n, role: old, data: g.jsonl, metric: nll}\n"
                                    "  - {name: c, role: old, data: c.jsonl, metric: choice}\n"
                                    "  - {name: g, role: new, data: g.jsonl, metric: contains, max_new_tokens: 5}\n")
    return model, Evaluator(load_tasks(root / "tasks.yml"), tokenizer, progress=False)


def test_score_runs_with_the_chosen_threads_and_puts_them_back(chat_model, monkeypatch):
    model, evaluator = chat_model
    seen = []
    handle = model.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv(THREADS_VARIABLE, "1")
        evaluator.score(model)
    finally:
        handle.remove()
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == 2


def test_scores_do_not_depend_on_the_thread_count(chat_model, monkeypatch):
    model, evaluator = chat_model
    scores = []
    for threads in ("1", "2"):
        monkeypatch.setenv(THREADS_VARIABLE, threads)
        scores.append(evaluator.score(model))
    assert scores[0].keys() == scores[1].keys() == {"n", "c", "g"}
    for task in scores[0]:
        assert scores[1][task]["validation"] == pytest.approx(scores[0][task]["validation"], rel=1e-6), task
