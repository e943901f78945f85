"""``graftmerge eval``: the table, the JSON, and one ``error:`` line (exit 2) for each kind of bad input."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from graftmerge.cli.eval import jsonable
from graftmerge.evaluation import (
    Evaluator,
    load_model_for_eval,
    load_tasks,
    normalised,
    role_scores,
)
from tests.helpers.hf_cache import place_in_hf_cache
from tests.helpers.models import tree_digest
from tests.helpers.runners import error_line, run_cli, run_process
from tests.helpers.tiny_tokenizer import CHAT_TEMPLATE, save_tiny_chat_model

LINES = [
    {"messages": [{"role": "user", "content": "Name a colour."}], "answer": "Teal.", "split": "validation"},
    {"messages": [{"role": "user", "content": "When did the bridge open?"}], "answer": "In 1987.", "split": "test"},
    {"prompt": "The capital of the country is", "answer": " a large city", "split": "validation"},
]
TASKS = """\
tasks:
  - name: facts            # what was taught
    role: new
    data: new-facts.jsonl
    metric: exact
  - name: keep-format
    role: old
    data: old-task.jsonl
    metric: nll
  - name: pick
    role: old
    data: choice.jsonl
    metric: choice
    weight: 2
"""


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """A tiny chat model, one without a chat template, and a tasks folder in the issue's format."""
    root = tmp_path_factory.mktemp("eval-cli")
    model = save_tiny_chat_model(root / "model", architecture="qwen3", seed=3)
    bare = save_tiny_chat_model(root / "bare", architecture="llama", chat_template=False)
    tasks = root / "tasks"
    tasks.mkdir()
    write_jsonl(tasks / "new-facts.jsonl", LINES)
    write_jsonl(tasks / "old-task.jsonl", LINES)
    write_jsonl(tasks / "choice.jsonl", [{**line, "choices": [line["answer"], "No."]} for line in LINES])
    (tasks / "tasks.yml").write_text(TASKS)
    return {"root": root, "model": model, "bare": bare, "tasks": tasks / "tasks.yml"}


def expected_scores(setup, splits):
    model, tokenizer = load_model_for_eval(setup["model"])
    suite = load_tasks(setup["tasks"])
    scores = Evaluator(suite, tokenizer, progress=False).score(model, splits)
    return suite, scores


def test_eval_prints_the_table_and_writes_json(setup, tmp_path):
    before = tree_digest(setup["tasks"].parent), tree_digest(setup["model"])
    out = tmp_path / "scores.json"
    result = run_cli("graftmerge", "eval", str(setup["model"]), "--tasks", str(setup["tasks"]),
                     "--json", str(out), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    suite, scores = expected_scores(setup, ("validation",))
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["task", "role", "metric", "split", "raw", "normalised"]
    for task, line in zip(suite.tasks, lines[1:4]):
        raw = scores[task.name]["validation"]
        assert line.split() == [task.name, task.role, task.metric, "validation", f"{raw:.4f}",
                                f"{normalised(task, raw):.4f}"]
    roles = role_scores(suite, scores, "validation")
    assert lines[4] == f"role scores (validation): old {roles['old']:.4f}, new {roles['new']:.4f}"
    record = json.loads(out.read_text())
    assert record["fingerprint"] == suite.fingerprint and record["model"] == str(setup["model"])
    assert record["scores"]["keep-format"]["validation"]["raw"] == pytest.approx(scores["keep-format"]["validation"])
    assert record["roles"]["validation"] == pytest.approx(roles)
    assert record["tasks"]["pick"] == {"role": "old", "metric": "choice", "weight": 2.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scores.json"]  # nothing half-written beside it
    assert (tree_digest(setup["tasks"].parent), tree_digest(setup["model"])) == before


def test_eval_as_a_real_process_with_every_split(setup, tmp_path):
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")]))}
    result = run_process("graftmerge", "eval", str(setup["model"]), "--tasks", str(setup["tasks"]),
                         "--split", "all", "--json", str(tmp_path / "s.json"), env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    suite, scores = expected_scores(setup, ("validation", "test"))
    record = json.loads((tmp_path / "s.json").read_text())
    assert record["scores"].keys() == scores.keys()
    for name, by_split in scores.items():
        for split, raw in by_split.items():
            assert record["scores"][name][split]["raw"] == pytest.approx(raw, rel=1e-6)
    assert set(record["roles"]) == {"validation", "test"}
    assert "role scores (test):" in result.stdout


def test_chat_template_option_supplies_a_missing_template(setup, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    result = run_cli("graftmerge", "eval", str(setup["bare"]), "--tasks", str(setup["tasks"]),
                     "--chat-template", str(template), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "role scores (validation): old" in result.stdout


def test_help_teaches_the_file_format():
    result = run_cli("graftmerge", "eval", "--help")
    assert result.returncode == 0
    for words in ("tasks:", "role: new", "metric: nll", "lm_eval:", '"answer"', '"choices"', "--split"):
        assert words in result.stdout, words


def test_json_has_no_nan():
    assert jsonable({"a": {"b": math.nan, "c": 1.0}}) == {"a": {"b": None, "c": 1.0}}


# ---- bad input: one error line, exit 2 ------------------------------------------------------

GOOD_LINE = {"messages": [{"role": "user", "content": "Hi"}], "answer": "Hello."}
BAD_TASK_FILES = {  # case: (tasks.yml, {data file: lines}, expected part of the error line)
    "missing field": ("tasks:\n  - name: a\n    data: d.jsonl\n    metric: exact\n", {"d.jsonl": [GOOD_LINE]},
                      r"tasks\.yml:2: task is missing the field 'role'"),
    "missing metric": ("tasks:\n  - name: a\n    role: old\n    data: d.jsonl\n", {"d.jsonl": [GOOD_LINE]},
                       r"tasks\.yml:2: task 'a' is missing the field 'metric'"),
    "unknown field": ("tasks:\n  - name: a\n    role: old\n    data: d.jsonl\n    metric: exact\n    metrc: nll\n",
                      {"d.jsonl": [GOOD_LINE]}, r"tasks\.yml:6: unknown task field 'metrc'"),
    "unknown role": ("tasks:\n  - {name: a, role: older, data: d.jsonl, metric: exact}\n", {"d.jsonl": [GOOD_LINE]},
                     r"tasks\.yml:2: task 'a': unknown role 'older'"),
    "unknown metric": ("tasks:\n  - name: a\n    role: old\n    data: d.jsonl\n    metric: bleu\n",
                       {"d.jsonl": [GOOD_LINE]}, r"tasks\.yml:5: task 'a': unknown metric 'bleu'"),
    "duplicate names": ("tasks:\n  - {name: a, role: old, data: d.jsonl, metric: nll}\n"
                        "  - {name: a, role: new, data: d.jsonl, metric: exact}\n", {"d.jsonl": [GOOD_LINE]},
                        r"tasks\.yml:3: task name 'a' is used twice"),
    "missing data file": ("tasks:\n  - {name: a, role: old, data: nowhere.jsonl, metric: nll}\n", {},
                          r"tasks\.yml:2: task 'a': data file .*nowhere\.jsonl does not exist"),
    "malformed JSON line": ("tasks:\n  - {name: a, role: old, data: d.jsonl, metric: nll}\n",
                            {"d.jsonl": [GOOD_LINE, '{"messages": [}']}, r"d\.jsonl:2: invalid JSON"),
    "choice without choices": ("tasks:\n  - {name: a, role: old, data: d.jsonl, metric: choice}\n",
                               {"d.jsonl": [GOOD_LINE]}, r"d\.jsonl:1: metric choice needs \"choices\""),
    "answer not a choice": ("tasks:\n  - {name: a, role: old, data: d.jsonl, metric: choice}\n",
                            {"d.jsonl": [{**GOOD_LINE, "choices": ["Yes.", "No."]}]},
                            r"d\.jsonl:1: the answer 'Hello\.' is not one of the choices"),
    "no answer": ("tasks:\n  - {name: a, role: old, data: d.jsonl, metric: nll}\n",
                  {"d.jsonl": [{"prompt": "Hi"}]}, r"d\.jsonl:1: missing \"answer\""),
    "unknown line field": ("tasks:\n  - {name: a, role: old, data: d.jsonl, metric: nll}\n",
                           {"d.jsonl": [{**GOOD_LINE, "anwser": "x"}]}, r"d\.jsonl:1: unknown field 'anwser'"),
    "assistant last": ("tasks:\n  - {name: a, role: old, data: d.jsonl, metric: nll}\n",
                       {"d.jsonl": [{"messages": [{"role": "user", "content": "Hi"},
                                                  {"role": "assistant", "content": "Yo"}],
                                     "answer": "x"}]}, r"d\.jsonl:1: the last message is the assistant's"),
    "not YAML": ("tasks:\n  - {name: a, role: old\n", {}, r"tasks\.yml:3: not valid YAML"),
    "no tasks list": ("name: a\n", {}, r"tasks\.yml: expected a mapping with a `tasks:` list"),
    "bad weight": ("tasks:\n  - {name: a, role: old, data: d.jsonl, metric: nll, weight: -1}\n",
                   {"d.jsonl": [GOOD_LINE]}, r"tasks\.yml:2: task 'a': weight must be a positive number"),
    "empty split": ("tasks:\n  - {name: a, role: old, data: d.jsonl, metric: nll}\n", {"d.jsonl": [GOOD_LINE]},
                    r"tasks\.yml:2: task 'a' has no test examples"),
    "answer tokenizes to nothing": ("tasks:\n  - {name: a, role: new, data: d.jsonl, metric: exact}\n",
                                    {"d.jsonl": [GOOD_LINE, {**GOOD_LINE, "answer": "\u0301"}]},
                                    r"d\.jsonl:2: the answer .* tokenizes to nothing"),
}


@pytest.mark.parametrize("case", sorted(BAD_TASK_FILES))
def test_bad_task_files(case, setup, tmp_path):
    tasks_text, data, expected = BAD_TASK_FILES[case]
    (tmp_path / "tasks.yml").write_text(tasks_text)
    for name, lines in data.items():
        write_jsonl(tmp_path / name, lines)
    split = ["--split", "test"] if case == "empty split" else []
    result = run_cli("graftmerge", "eval", str(setup["model"]), "--tasks", str(tmp_path / "tasks.yml"), *split,
                     "--no-progress")
    line = error_line(result)
    assert re.search(expected, line), line


def test_bad_models_and_options(setup, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.bin").write_bytes(b"x")
    tasks = str(setup["tasks"])
    cases = {
        str(tmp_path / "nowhere"): r"model folder .*nowhere does not exist",
        str(tmp_path / "empty"): r"empty is not a Hugging Face model folder \(no config\.json\)",
        str(tmp_path / "file.bin"): r"model .*file\.bin is a file",
        "someone/not-cached-model": r"not in the local Hugging Face cache",
    }
    for model, expected in cases.items():
        line = error_line(run_cli("graftmerge", "eval", model, "--tasks", tasks))
        assert re.search(expected, line), line
    line = error_line(run_cli("graftmerge", "eval", str(setup["bare"]), "--tasks", tasks, "--no-progress"))
    assert "has none" in line and "--chat-template FILE" in line and '"prompt"' in line
    line = error_line(run_cli("graftmerge", "eval", str(setup["model"]), "--tasks", tasks, "--json", tasks))
    assert "is the tasks file" in line
    line = error_line(run_cli("graftmerge", "eval", str(setup["model"]), "--tasks", str(tmp_path / "no.yml")))
    assert "tasks file" in line and "does not exist" in line
    line = error_line(run_cli("graftmerge", "eval", str(setup["model"]), "--tasks", tasks, "--split", "train"))
    assert "--split" in line


def test_a_hub_id_is_read_from_the_local_cache_offline(setup, tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    place_in_hf_cache(cache, "acme/tiny-chat", setup["model"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    result = run_cli("graftmerge", "eval", "acme/tiny-chat", "--tasks", str(setup["tasks"]), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    local = run_cli("graftmerge", "eval", str(setup["model"]), "--tasks", str(setup["tasks"]), "--no-progress")
    assert result.stdout == local.stdout
