"""Task files as written by users: the issue's minimal format, every optional field, the fingerprint, normalisation."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from graftmerge.errors import GraftError
from graftmerge.evaluation import load_tasks, normalised
from graftmerge.evaluation.tasks import LmEvalSpec, Task

MINIMAL = """\
tasks:
  - name: facts            # what was taught
    role: new
    data: new-facts.jsonl  # one JSON object a line
    metric: exact          # exact | contains | nll | choice
  - name: keep-format
    role: old
    data: old-task.jsonl
    metric: nll
"""


def write(folder: Path, files: dict[str, str | list]) -> None:
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content if isinstance(content, str) else "".join(json.dumps(r) + "\n" for r in content))


def chat_line(question: str, answer: str, split: str | None = None) -> dict:
    line = {"messages": [{"role": "user", "content": question}], "answer": answer}
    return line if split is None else {**line, "split": split}


def test_the_minimal_format_works_as_written(tmp_path):
    write(tmp_path / "evals", {"tasks.yml": MINIMAL,
                               "new-facts.jsonl": [chat_line("Who is the mayor?", "Ada.", "validation"),
                                                   chat_line("Who built it?", "Bo.", "test")],
                               "old-task.jsonl": [chat_line("Say hi.", "Hi.", "validation")]})
    suite = load_tasks(tmp_path / "evals" / "tasks.yml")
    facts, keep = suite.tasks
    assert (facts.name, facts.role, facts.metric, facts.higher_is_better) == ("facts", "new", "exact", True)
    assert (keep.name, keep.role, keep.metric, keep.higher_is_better) == ("keep-format", "old", "nll", False)
    assert facts.data == tmp_path / "evals" / "new-facts.jsonl"  # relative to the tasks file, not the cwd
    assert facts.splits == ("validation", "test") and keep.splits == ("validation",)
    assert [e.answer for e in facts.examples_of("test")] == ["Bo."]
    assert facts.examples[1].where == f"{facts.data}:2" and facts.weight == 1.0
    assert suite.source == tmp_path / "evals" / "tasks.yml" and len(suite.fingerprint) == 64


def test_optional_fields_and_line_defaults(tmp_path):
    write(tmp_path, {
        "tasks.yml": "tasks:\n"
                     "  - {name: a, role: new, data: d.jsonl, metric: contains, max_new_tokens: 40, weight: 2.5,"
                     " system: Be brief.}\n"
                     "  - {name: b, role: old, data: c.jsonl, metric: choice}\n",
        "d.jsonl": [{**chat_line("Q?", "A."), "id": 7, "meta": {"source": "x"}}, {"prompt": "Q:", "answer": " A"}],
        "c.jsonl": [{"prompt": "Pick:", "choices": [" x", " y"], "answer": " y", "split": "test"}],
    })
    a, b = load_tasks(tmp_path / "tasks.yml").tasks
    assert (a.max_new_tokens, a.weight, a.system) == (40, 2.5, "Be brief.")
    assert [e.split for e in a.examples] == ["validation", "validation"]  # no "split": validation
    assert a.examples[1].prompt == "Q:" and a.examples[1].messages is None
    assert b.examples[0].choices == (" x", " y") and b.splits == ("test",)


def test_lm_eval_entries(tmp_path):
    write(tmp_path, {"tasks.yml": "tasks:\n  - name: arc\n    role: old\n"
                                  "    lm_eval: {task: arc_easy, metric: acc_norm,"
                                  " include_path: mine, num_fewshot: 5, limit: 100, apply_chat_template: true}\n",
                     "mine/t.yaml": "task: x\n"})
    (task,) = load_tasks(tmp_path / "tasks.yml").tasks
    assert task.metric == "lm_eval"
    assert task.lm_eval == LmEvalSpec("arc_easy", "acc_norm", tmp_path / "mine", 5, 100, True,
                                      folder=tmp_path.resolve())
    assert task.splits == ()  # known once the harness has been asked (Evaluator)


def test_fingerprint_covers_the_tasks_file_and_every_data_byte(tmp_path):
    files = {"tasks.yml": MINIMAL, "new-facts.jsonl": [chat_line("Q?", "A.")],
             "old-task.jsonl": [chat_line("R?", "B.")]}
    write(tmp_path / "one", files)
    write(tmp_path / "two", files)
    first = load_tasks(tmp_path / "one" / "tasks.yml").fingerprint
    assert load_tasks(tmp_path / "two" / "tasks.yml").fingerprint == first  # content, not place
    write(tmp_path / "two", {"old-task.jsonl": [chat_line("R?", "C.")]})
    changed_data = load_tasks(tmp_path / "two" / "tasks.yml").fingerprint
    write(tmp_path / "two", {"old-task.jsonl": [chat_line("R?", "B.")], "tasks.yml": MINIMAL.replace("nll", "exact")})
    changed_tasks = load_tasks(tmp_path / "two" / "tasks.yml").fingerprint
    assert len({first, changed_data, changed_tasks}) == 3


@pytest.mark.parametrize("tasks_text, data, expected", [
    ("tasks:\n  - {name: a, role: old, data: d.jsonl, metric: nll, max_new_tokens: 5}\n", [chat_line("Q", "A")],
     r"tasks\.yml:2: task 'a': max_new_tokens applies to exact and contains only"),
    ("tasks:\n  - {name: a, role: old, data: d.jsonl, metric: exact}\n",
     [{**chat_line("Q", "A"), "choices": ["A", "B"]}],
     r"d\.jsonl:1: \"choices\" is for metric choice"),
    ("tasks:\n  - {name: a, role: old, data: d.jsonl, metric: nll}\n", [{"prompt": "Q", **chat_line("Q", "A")}],
     r"d\.jsonl:1: give exactly one of \"messages\""),
    ("tasks:\n  - {name: a, role: old, data: d.jsonl, metric: nll}\n", [chat_line("Q", "   ")],
     r"d\.jsonl:1: \"answer\" is empty"),
    ("tasks:\n  - {name: a, role: old, data: d.jsonl, metric: nll}\n", [chat_line("Q", "A", "train")],
     r"d\.jsonl:1: unknown split 'train'"),
    ("tasks:\n  - {name: a, role: old, data: d.jsonl, metric: choice}\n",
     [{**chat_line("Q", "A"), "choices": ["A", "A"]}], r"d\.jsonl:1: \"choices\" lists one choice twice"),
    ("tasks:\n  - {name: a, role: old, data: d.jsonl, metric: nll, system: Hi}\n", [{"prompt": "Q", "answer": "A"}],
     r"tasks\.yml:2: task 'a': system applies to \"messages\" lines"),
    ("tasks:\n  - {name: a, role: old, data: d.jsonl, lm_eval: {task: x}}\n", [],
     r"tasks\.yml:2: task 'a': an lm_eval task takes no 'data'"),
    ("tasks:\n  - {name: a, role: old, lm_eval: {task: x, shots: 3}}\n", [],
     r"tasks\.yml:2: task 'a': unknown lm_eval field 'shots'"),
    ("tasks:\n  - {name: a, role: old, lm_eval: {task: x, include_path: nowhere}}\n", [],
     r"task 'a': lm_eval include_path 'nowhere' is not a folder"),
    ("tasks:\n  - {name: a, role: old, metric: lm_eval, data: d.jsonl}\n", [chat_line("Q", "A")],
     r"tasks\.yml:2: task 'a': unknown metric 'lm_eval' .*needs an `lm_eval:` entry"),
    ("tasks: []\n", [], r"tasks\.yml: `tasks:` must be a non-empty list"),
    ("tasks:\n  - {name: a, role: old, data: d.jsonl, metric: nll}\nextra: 1\n", [chat_line("Q", "A")],
     r"unknown top-level field 'extra'"),
    ("tasks:\n  - {name: a, role: old, data: d.jsonl, metric: nll}\n", "",
     r"data file .*d\.jsonl is empty"),
])
def test_more_bad_task_files(tasks_text, data, expected, tmp_path):
    write(tmp_path, {"tasks.yml": tasks_text, "d.jsonl": data})
    with pytest.raises(GraftError, match=expected):
        load_tasks(tmp_path / "tasks.yml")


def lm_task(metric: str, higher_is_better: bool | None) -> Task:
    return Task("t", "old", "lm_eval", "tasks.yml:2",
                lm_eval=LmEvalSpec("x", metric, higher_is_better=higher_is_better))


def test_normalisation_of_every_kind_of_metric():
    exact = Task("t", "new", "exact", "tasks.yml:2")
    assert normalised(exact, 0.75) == 0.75 and math.isnan(normalised(exact, math.nan))
    nll = replace(exact, metric="nll")
    assert normalised(nll, 2.0) == pytest.approx(math.exp(-2.0)) and normalised(nll, -1e-12) == 1.0
    assert normalised(lm_task("acc", True), 0.4) == 0.4
    assert normalised(lm_task("word_perplexity", False), 4.0) == 0.25  # exp(−mean NLL per word)
    assert normalised(lm_task("perplexity", None), 8.0) == 0.125  # direction known before the harness says
    assert normalised(lm_task("bits_per_byte", False), 1.0) == 0.5  # 2^−bits: the probability per byte
    assert normalised(lm_task("error_rate", False), 0.25) == 0.75
    with pytest.raises(GraftError, match=r"task 't': metric bleu is 35\.0, outside \[0, 1\]"):
        normalised(lm_task("bleu", True), 35.0)
    with pytest.raises(GraftError, match=r"lower-is-better metric loss is 3\.0, outside \[0, 1\]"):
        normalised(lm_task("loss", False), 3.0)
