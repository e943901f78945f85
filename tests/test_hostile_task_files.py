"""Task files and merge configs are read within bounds (docs/security.md, class 10).

One YAML reader (``pipeline/config_files``) serves both: huge integers, deep nesting, alias
bombs, endless aliases, repeated keys and impossible dates are one line naming the file;
task weights anywhere in (0, 1.8e308] give the weighted mean they mean (checked against
exact decimal arithmetic), larger ones one line. Controls: honest files, anchors and merge
keys used as intended, ordinary weights against the float64 formula.
"""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal, getcontext
from pathlib import Path

import pytest

from graftmerge.errors import GraftError
from graftmerge.evaluation import load_tasks, role_scores
from graftmerge.pipeline.config_files import MAX_YAML_DEPTH, MAX_YAML_NODES, read_merge_config
from tests.helpers.runners import error_line, run_cli

LINE = {"prompt": "The sky is", "answer": " blue"}
ENTRY = "{name: a, role: old, metric: nll, data: d.jsonl%s}"


def alias_bomb(levels: int = 9) -> str:
    """A flow list of anchors, each ten aliases of the one before: 10**levels values in a few hundred bytes."""
    parts = ["&a0 [x, x, x, x, x, x, x, x, x, x]"]
    parts += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "[" + ", ".join(parts) + "]"


def tasks_file(folder: Path, text: str) -> Path:
    (folder / "d.jsonl").write_text(json.dumps(LINE) + "\n")
    path = folder / "tasks.yml"
    path.write_text(text)
    return path


def one_entry(extra: str) -> str:
    return "tasks:\n  - " + ENTRY % extra + "\n"


HOSTILE = {  # case: (tasks.yml text, what the one line says)
    "huge integer weight": (one_entry(", weight: " + "9" * 5000), r"tasks\.yml: .*integer of more than 4300 digits"),
    "huge integer name": (one_entry("").replace("name: a", "name: " + "7" * 4400), r"integer of more than 4300"),
    "huge integer top level": ("tasks:\n  - " + ENTRY % "" + "\n" + "x: " + "1" * 4301 + "\n",
                               r"integer of more than 4300 digits"),
    "deep flow lists": (one_entry(", system: " + "[" * 5000 + "]" * 5000), r"nested too deeply or too large"),
    "deep mappings": ("tasks: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", r"nested too deeply or too large"),
    "deep block lists": ("tasks:\n" + "".join("  " * i + "-\n" for i in range(1, 400)) + "  " * 400 + "- 1\n",
                         r"nested more than 32 deep"),
    "nested past the bound": (one_entry(", system: " + "[" * (MAX_YAML_DEPTH + 1) + "]" * (MAX_YAML_DEPTH + 1)),
                              rf"tasks\.yml:2: .*nested more than {MAX_YAML_DEPTH} deep"),
    "alias bomb": (one_entry(", weight: " + alias_bomb()), rf"more than {MAX_YAML_NODES:,} values"),
    "alias bomb in an unknown field": (one_entry(", notes: " + alias_bomb()), rf"more than {MAX_YAML_NODES:,}"),
    "endless alias": ("tasks: &t [*t]\n", r"tasks\.yml:1: .*alias inside its own anchor"),
    "repeated key": (one_entry(", weight: 1, weight: 100"), r"tasks\.yml:2: the key 'weight' is given twice"),
    "repeated tasks list": ("tasks: []\ntasks:\n  - " + ENTRY % "" + "\n", r"tasks\.yml:2: the key 'tasks'"),
    "impossible date": (one_entry(", weight: 2024-13-01"), r"month must be in 1\.\.12"),
    "two documents": (one_entry("") + "---\n" + one_entry(""), r"tasks\.yml:4: .*one YAML document"),
    "weight past float": (one_entry(", weight: 1" + "0" * 400), r"tasks\.yml:2: task 'a': weight must be a "
                                                                   r"positive number of at most 1\.798e\+308, "
                                                                   r"got an integer of 401 digits"),
    "infinite weight": (one_entry(", weight: .inf"), r"weight must be a positive number .*got inf"),
    "nan weight": (one_entry(", weight: .nan"), r"weight must be a positive number .*got nan"),
    "mixed key types": ("tasks:\n  - " + ENTRY % "" + "\n1: x\nb: y\n", r"unknown top-level field"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_tasks_file_is_one_line_naming_it(case, tmp_path):
    text, expected = HOSTILE[case]
    path = tasks_file(tmp_path, text)
    with pytest.raises(GraftError) as raised:
        load_tasks(path)
    message = str(raised.value)
    assert str(path) in message and "\n" not in message, message
    assert re.search(expected, message), message


@pytest.mark.parametrize("case", ["huge integer weight", "alias bomb", "deep mappings", "repeated key"])
def test_the_eval_command_says_it_in_one_line_before_any_model(case, tmp_path):
    path = tasks_file(tmp_path, HOSTILE[case][0])
    line = error_line(run_cli("graftmerge", "eval", str(tmp_path / "no-model"), "--tasks", str(path)))
    assert str(path) in line and re.search(HOSTILE[case][1], line), line


def test_anchors_and_merge_keys_used_honestly_still_read(tmp_path):
    path = tasks_file(tmp_path, "tasks:\n"
                                "  - &base {name: a, role: old, metric: nll, data: d.jsonl, weight: 2}\n"
                                "  - {<<: *base, name: b, role: new}\n")
    suite = load_tasks(path)
    assert [(t.name, t.role, t.weight) for t in suite.tasks] == [("a", "old", 2.0), ("b", "new", 2.0)]
    assert suite.tasks[1].where == f"{path}:3"
    merged = tasks_file(tmp_path, "<<: {tasks: [{name: a, role: old, metric: nll, data: d.jsonl}]}\n")
    assert load_tasks(merged).tasks[0].name == "a"


def exact_mean(weights, values) -> float:
    """Σ w·v / Σ w in 1,000-digit decimal arithmetic (every float is exact there), rounded to float."""
    getcontext().prec = 1000
    total = sum(Decimal(w) for w in weights)
    return float(sum(Decimal(w) * Decimal(v) for w, v in zip(weights, values)) / total)


WEIGHTS = {  # case: weights of three old tasks (their sum overflows, their products vanish, or both)
    "largest twice": ["1.0e+308", "1.0e+308", "1.0e+308"],
    "largest float": ["1.7976931348623157e+308", "1.7976931348623157e+308", "1.0"],
    "smallest denormals": ["5.0e-324", "1.0e-323", "5.0e-324"],
    "denormal beside huge": ["5.0e-324", "1.0e+308", "1.0"],
    "huge integer that fits": ["1" + "0" * 300, "3" + "0" * 300, "1"],
    "ordinary": ["1", "2.5", "0.125"],
}


@pytest.mark.parametrize("case", sorted(WEIGHTS))
def test_extreme_task_weights_give_the_mean_they_mean(case, tmp_path):
    weights = WEIGHTS[case]
    path = tasks_file(tmp_path, "tasks:\n" + "".join(
        f"  - {{name: t{i}, role: old, metric: exact, data: d.jsonl, weight: {w}}}\n" for i, w in enumerate(weights)))
    suite = load_tasks(path)
    values = [0.25, 0.75, 1 / 3]
    scores = {f"t{i}": {"validation": v} for i, v in enumerate(values)}
    got = role_scores(suite, scores, "validation")["old"]
    floats = [t.weight for t in suite.tasks]
    assert got == exact_mean(floats, values)
    assert 0.25 <= got <= 0.75
    if case == "ordinary":  # the float64 formula, where it is good
        assert got == pytest.approx(sum(w * v for w, v in zip(floats, values)) / sum(floats), rel=1e-15)
    scores["t1"]["validation"] = math.nan
    assert math.isnan(role_scores(suite, scores, "validation")["old"])


def test_a_merge_config_is_read_within_the_same_bounds(tmp_path):
    honest = "merge_method: linear\nmodels:\n  - model: ./a\n    parameters: {weight: 1.0}\ndtype: float32\n"
    (tmp_path / "honest.yml").write_text(honest)
    assert read_merge_config(str(tmp_path / "honest.yml"))[0].merge_method == "linear"
    cases = {
        "bomb.yml": (honest.replace("weight: 1.0", "weight: 1.0, junk: " + alias_bomb()),
                     rf"bomb\.yml:4: not a valid merge config \(more than {MAX_YAML_NODES:,} values"),
        "repeated.yml": (honest.replace("dtype: float32", "dtype: float32\ndtype: bfloat16"),
                         r"repeated\.yml:6: the key 'dtype' is given twice"),
        "endless.yml": ("merge_method: linear\nmodels: &m [*m]\n", r"endless\.yml:2: .*alias inside its own anchor"),
    }
    for name, (text, expected) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(GraftError, match=expected):
            read_merge_config(str(tmp_path / name))
        for command in (["mergekit-yaml"], ["graftmerge", "merge"]):
            line = error_line(run_cli(*command, str(tmp_path / name), str(tmp_path / "out")))
            assert re.search(expected, line), line
        assert not (tmp_path / "out").exists()
