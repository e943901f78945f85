"""lm_eval entries: a local harness task (a YAML and JSONL written here) scored offline on a tiny model in memory.

The harness's ``acc`` of a multiple-choice task is the share of documents whose gold choice
has the highest log-likelihood after the context and a space; on the same documents
written as ``prompt`` lines with those choices, graftmerge's own ``choice`` metric (checked
against a brute force in test_evaluation_metrics.py) computes the same thing, so the two
must agree. The test split is built so that its accuracy is 0 (the gold choice is a long
sentence, the other a single word), which shows which split was scored.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from graftmerge.errors import GraftError
from graftmerge.evaluation import Evaluator, load_model_for_eval, load_tasks, normalised
from graftmerge.formats import bounded_template
from tests.helpers.configs import graft_yaml
from tests.helpers.runners import error_line, run_cli
from tests.helpers.tiny_tokenizer import save_tiny_chat_model

QUESTIONS = ["What is the capital?", "Name a colour.", "Who wrote the letter?", "When did the train arrive?",
             "Where is the library?", "Yes or no?", "What did the cat buy?", "Who is the mayor?"]
WORDS = ["red", "green", "blue", "fish", "city", "yes", "no", "bridge"]
LONG = "the mayor of the town opened a new bridge over the river in the spring and then went home"


def harness_task_yaml(task: str, data: Path | str) -> str:
    """A multiple-choice harness task reading ``data``/validation.jsonl and test.jsonl (``data`` may be relative)."""
    return (
        f"task: {task}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    validation: {data}/validation.jsonl\n"
        f"    test: {data}/test.jsonl\n"
        "validation_split: validation\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: \"{{question}}\"\n"
        "doc_to_target: \"{{gold}}\"\n"
        "doc_to_choice: \"{{choices}}\"\n"
        "metric_list:\n"
        "  - metric: acc\n"
        "    aggregation: mean\n"
        "    higher_is_better: true\n"
    )


@pytest.fixture(scope="module")
def harness_setup(tmp_path_factory):
    pytest.importorskip("lm_eval")
    root = tmp_path_factory.mktemp("lm-eval")
    validation = [{"question": q, "choices": [WORDS[i], WORDS[(i + 3) % 8], WORDS[(i + 5) % 8]], "gold": i % 3}
                  for i, q in enumerate(QUESTIONS)]
    test = [{"question": q, "choices": ["no", LONG], "gold": 1} for q in QUESTIONS[:5]]
    (root / "harness").mkdir()
    for name, docs in (("validation", validation), ("test", test)):
        (root / "harness" / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / "harness" / "graft_probe.yaml").write_text(harness_task_yaml("graft_probe", root / "harness"))
    ours = [{"prompt": d["question"], "choices": [" " + c for c in d["choices"]],
             "answer": " " + d["choices"][d["gold"]]}
            for d in validation]
    (root / "ours.jsonl").write_text("".join(json.dumps(line) + "\n" for line in ours))
    (root / "tasks.yml").write_text(
        "tasks:\n"
        "  - name: probe\n    role: old\n    lm_eval: {task: graft_probe, include_path: harness, metric: acc}\n"
        "  - name: ours\n    role: old\n    data: ours.jsonl\n    metric: choice\n")
    folder = save_tiny_chat_model(root / "model", architecture="llama", seed=5)
    model, tokenizer = load_model_for_eval(folder)
    return {"root": root, "folder": folder, "model": model, "tokenizer": tokenizer}


def test_harness_accuracy_equals_our_choice_metric_on_the_same_documents(harness_setup):
    suite = load_tasks(harness_setup["root"] / "tasks.yml")
    evaluator = Evaluator(suite, harness_setup["tokenizer"], batch_size=4, progress=False)
    probe = evaluator.suite.task("probe")
    assert probe.splits == ("validation", "test") and probe.higher_is_better and probe.lm_eval.metric == "acc"
    scores = evaluator.score(harness_setup["model"], ("validation", "test"), only_present=True)
    assert scores["probe"]["validation"] == scores["ours"]["validation"]
    assert 0 < scores["probe"]["validation"] < 1  # a random model: some right, some wrong
    assert scores["probe"]["test"] == 0.0  # the test split, not the validation one
    assert normalised(probe, scores["probe"]["validation"]) == scores["probe"]["validation"]


def test_one_evaluator_scores_model_after_model_as_a_sweep_does(harness_setup, tmp_path):
    """No state carried over: A, then B, then A again gives A's numbers (the split override is undone)."""
    evaluator = Evaluator(load_tasks(harness_setup["root"] / "tasks.yml"), harness_setup["tokenizer"], progress=False)
    other, _ = load_model_for_eval(save_tiny_chat_model(tmp_path / "other", architecture="llama", seed=11))
    first = evaluator.score(harness_setup["model"], ("validation", "test"), only_present=True)
    second = evaluator.score(other, ("validation", "test"), only_present=True)
    assert evaluator.score(harness_setup["model"], ("validation", "test"), only_present=True) == first
    assert second["probe"]["validation"] == second["ours"]["validation"] and second["probe"]["test"] == 0.0
    assert evaluator.harness["probe"].harness_task.config.test_split == "test"


def test_lm_eval_entry_through_the_cli(harness_setup):
    result = run_cli("graftmerge", "eval", str(harness_setup["folder"]), "--tasks",
                     str(harness_setup["root"] / "tasks.yml"), "--split", "test", "--no-progress")
    assert result.returncode == 2  # "ours" has no test lines
    assert "task 'ours' has no test examples" in error_line(result)
    result = run_cli("graftmerge", "eval", str(harness_setup["folder"]), "--tasks",
                     str(harness_setup["root"] / "tasks.yml"), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^probe\s+old\s+lm_eval:graft_probe/acc\s+validation\s+0\.\d{4}", result.stdout, re.M)


def test_no_progress_silences_the_harness_bars_and_puts_its_tqdm_back(harness_setup, capsys):
    """``--no-progress`` reaches the harness's own bars (request building, scoring), and only for the call."""
    import lm_eval.api.task
    import lm_eval.models.huggingface

    originals = (lm_eval.api.task.tqdm, lm_eval.models.huggingface.tqdm)
    suite = load_tasks(harness_setup["root"] / "tasks.yml")
    for progress in (True, False):
        evaluator = Evaluator(suite, harness_setup["tokenizer"], batch_size=4, progress=progress)
        capsys.readouterr()
        evaluator.score(harness_setup["model"], ("validation",), only_present=True)
        err = capsys.readouterr().err
        bars = re.findall(r"[^\r\n]*\d+%\|", err)
        assert bool(bars) == progress, bars
    assert (lm_eval.api.task.tqdm, lm_eval.models.huggingface.tqdm) == originals


def test_relative_data_files_are_read_from_the_tasks_files_folder_whatever_the_cwd(harness_setup, tmp_path,
                                                                                 monkeypatch):
    """A harness task's ``data_files: harness/validation.jsonl`` means the file next to the tasks file.

    Run from an unrelated folder holding a decoy with the same relative path (documents whose
    every answer is right), the scores are the absolute-path task's, and the working directory is back.
    """
    project = tmp_path / "project"
    (project / "harness").mkdir(parents=True)
    for split in ("validation", "test"):
        (project / "harness" / f"{split}.jsonl").write_bytes((harness_setup["root"] / "harness" / f"{split}.jsonl")
                                                              .read_bytes())
    (project / "harness" / "graft_probe_rel.yaml").write_text(harness_task_yaml("graft_probe_rel", "harness"))
    (project / "tasks.yml").write_text("tasks:\n  - name: probe\n    role: old\n"
                                       "    lm_eval: {task: graft_probe_rel, include_path: harness}\n")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "harness").mkdir(parents=True)
    decoy = [{"question": q, "choices": ["yes"], "gold": 0} for q in QUESTIONS]
    for split in ("validation", "test"):
        (elsewhere / "harness" / f"{split}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in decoy))
    monkeypatch.chdir(elsewhere)
    evaluator = Evaluator(load_tasks(Path("..") / "project" / "tasks.yml"), harness_setup["tokenizer"],
                          batch_size=4, progress=False)
    assert Path.cwd() == elsewhere
    scores = evaluator.score(harness_setup["model"], ("validation", "test"), only_present=True)
    reference = Evaluator(load_tasks(harness_setup["root"] / "tasks.yml"), harness_setup["tokenizer"],
                          batch_size=4, progress=False).score(harness_setup["model"], ("validation", "test"),
                                                              only_present=True)
    assert scores["probe"] == reference["probe"] and scores["probe"]["validation"] < 1


def test_a_metric_the_task_does_not_report_is_refused(harness_setup, tmp_path):
    (tmp_path / "tasks.yml").write_text(
        f"tasks:\n  - name: probe\n    role: old\n    lm_eval: {{task: graft_probe, include_path: "
        f"{harness_setup['root'] / 'harness'}, metric: f1}}\n")
    with pytest.raises(GraftError, match=r"tasks\.yml:2: lm-eval task 'graft_probe' reports no metric 'f1' "
                                         r"\(it reports: acc\)"):
        Evaluator(load_tasks(tmp_path / "tasks.yml"), harness_setup["tokenizer"])


def test_a_task_the_harness_does_not_have_is_one_error_line(harness_setup, tmp_path):
    """Looked up in include_path, then among the harness's own tasks (which takes a while to index)."""
    (tmp_path / "tasks.yml").write_text(
        f"tasks:\n  - name: probe\n    role: old\n    lm_eval: {{task: no_such_task_xyz, include_path: "
        f"{harness_setup['root'] / 'harness'}}}\n")
    line = error_line(run_cli("graftmerge", "eval", str(harness_setup["folder"]), "--tasks",
                              str(tmp_path / "tasks.yml"), "--no-progress"))
    assert re.fullmatch(r"error: .*tasks\.yml:2: lm-eval task 'no_such_task_xyz' does not exist \(not among the "
                        r"harness's \d+ tasks or in .*harness\)", line), line


def test_without_lm_eval_installed_the_error_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what an environment without the extra looks like
    (tmp_path / "tasks.yml").write_text("tasks:\n  - {name: arc, role: old, lm_eval: {task: arc_easy}}\n")
    suite = load_tasks(tmp_path / "tasks.yml")
    folder = save_tiny_chat_model(tmp_path / "model")
    _, tokenizer = load_model_for_eval(folder)
    with pytest.raises(GraftError,
                       match=r"lm-evaluation-harness, which is not installed .*pip install graftmerge\[eval\]"):
        Evaluator(suite, tokenizer)
    line = error_line(run_cli("graftmerge", "eval", str(folder), "--tasks", str(tmp_path / "tasks.yml")))
    assert line.endswith("pip install graftmerge[eval]")


# ---- few-shot documents, checked before the model is loaded (docs/security.md, class 14) ----------------------

def broken_weights_copy(folder: Path, to: Path) -> Path:
    """The tiny model with its weights file cut short: anything that loads it fails with a different error."""
    shutil.copytree(folder, to)
    weights = next(to.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    return to


@pytest.mark.parametrize("shots, extra_yaml", [(20, ""), (8, ""), (None, "num_fewshot: 50\n")])
def test_num_fewshot_beyond_the_documents_is_one_line_before_the_model_loads(harness_setup, tmp_path, shots,
                                                                            extra_yaml):
    """8 validation documents: scoring validation draws num_fewshot + 1 of them (the scored one is left out)."""
    include = tmp_path / "include"
    include.mkdir()
    (include / "graft_many.yaml").write_text(harness_task_yaml("graft_many", harness_setup["root"] / "harness")
                                             + extra_yaml)
    fewshot = "" if shots is None else f", num_fewshot: {shots}"
    (tmp_path / "tasks.yml").write_text(f"tasks:\n  - name: probe\n    role: old\n"
                                        f"    lm_eval: {{task: graft_many, include_path: include{fewshot}}}\n")
    shots = shots or 50
    expected = (rf"tasks\.yml:2: lm-eval task 'graft_many' has 8 few-shot documents \(.*\), and num_fewshot "
                rf"{shots} needs {shots + 1} to score its validation split; lower num_fewshot to at most 7")
    with pytest.raises(GraftError, match=expected):
        Evaluator(load_tasks(tmp_path / "tasks.yml"), harness_setup["tokenizer"], progress=False)
    model = broken_weights_copy(harness_setup["folder"], tmp_path / "model")
    line = error_line(run_cli("graftmerge", "eval", str(model), "--tasks", str(tmp_path / "tasks.yml"),
                              "--split", "all", "--no-progress"))
    assert re.search(expected, line), line


def test_num_fewshot_the_documents_allow_scores_both_splits(harness_setup, tmp_path):
    """Control: 7 shots from 8 documents on validation (7 + the scored one), 7 of the 8 on test."""
    (tmp_path / "tasks.yml").write_text(f"tasks:\n  - name: probe\n    role: old\n    lm_eval: {{task: graft_probe, "
                                        f"include_path: {harness_setup['root'] / 'harness'}, num_fewshot: 7}}\n")
    evaluator = Evaluator(load_tasks(tmp_path / "tasks.yml"), harness_setup["tokenizer"], batch_size=4,
                          progress=False)
    scores = evaluator.score(harness_setup["model"], ("validation", "test"))
    assert set(scores["probe"]) == {"validation", "test"}
    assert all(0 <= value <= 1 for value in scores["probe"].values())


# ---- apply_chat_template: true renders through the bounded renderer (docs/security.md, class 18) -------------

def chat_tasks_file(harness_setup, folder: Path) -> Path:
    """A tasks file with one chat-templated lm-eval entry, two shots as multi-turn chat."""
    (folder / "tasks.yml").write_text(f"tasks:\n  - name: probe\n    role: old\n    lm_eval: {{task: graft_probe, "
                                      f"include_path: {harness_setup['root'] / 'harness'}, num_fewshot: 2, "
                                      "apply_chat_template: true}\n")
    return folder / "tasks.yml"


def test_a_chat_task_renders_in_one_bounded_batch_exactly_as_the_harness_does(harness_setup, tmp_path, monkeypatch):
    """Every prompt in one child process; contexts and score the same as the harness's own rendering gives."""
    import lm_eval.evaluator
    from lm_eval.models.huggingface import HFLM

    batches = []
    real_render = bounded_template.render_conversations
    monkeypatch.setattr(bounded_template, "render_conversations",
                        lambda tokenizer, conversations: batches.append(len(conversations))
                        or real_render(tokenizer, conversations))
    evaluator = Evaluator(load_tasks(chat_tasks_file(harness_setup, tmp_path)), harness_setup["tokenizer"],
                          batch_size=4, progress=False)
    ours = evaluator.score(harness_setup["model"], ("test",))["probe"]["test"]
    assert [size for size in batches if size] == [5]  # the test split's 5 documents, one prompt each, one fork
    task = evaluator.harness["probe"].harness_task
    bounded = [instance.args for instance in task.instances]
    assert all(context.startswith("<|im_start|>user\n") and context.endswith("<|im_start|>assistant\n")
               and context.count("<|im_start|>user") == 3 for context, _ in bounded)  # two shots, then the question
    task.set_fewshot_seed(seed=1234)
    lm = HFLM(pretrained=harness_setup["model"], tokenizer=harness_setup["tokenizer"], batch_size=4)
    results = lm_eval.evaluator.evaluate(lm=lm, task_dict={"tasks": {"graft_probe": task}}, bootstrap_iters=0,
                                         apply_chat_template=True, fewshot_as_multiturn=True)
    assert [instance.args for instance in task.instances] == bounded  # the harness's own rendering, to the byte
    assert results["results"]["graft_probe"]["acc,none"] == ours


def test_a_chat_template_past_its_budget_is_one_line_naming_its_file(harness_setup, tmp_path, monkeypatch):
    monkeypatch.setattr(bounded_template, "RENDER_SECONDS", 1.0)
    folder = shutil.copytree(harness_setup["folder"], tmp_path / "model")
    (folder / "chat_template.jinja").write_text("{% for i in range(100000) %}{% for j in range(100000) %}"
                                                "{% endfor %}{% endfor %}")
    result = run_cli("graftmerge", "eval", str(folder), "--tasks", str(chat_tasks_file(harness_setup, tmp_path)),
                     "--json", str(tmp_path / "scores.json"), "--no-progress")
    line = error_line(result)
    assert line.startswith(f"error: {folder / 'chat_template.jinja'}: the chat template ran past its budget "
                           "(more than 1 s for one conversation"), line
    assert "lm-eval task 'graft_probe'" in line and result.stdout == "" and not (tmp_path / "scores.json").exists()


# ---- a task's include_path: fingerprinted without bytecode, never a sweep's DIR (docs/security.md, class 14) ------

def test_the_fingerprint_covers_the_task_files_not_the_bytecode_the_harness_writes(harness_setup, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # as a user's Python (the suite runs without bytecode)
    include = tmp_path / "include"
    include.mkdir()
    for split in ("validation", "test"):
        shutil.copy(harness_setup["root"] / "harness" / f"{split}.jsonl", include / f"{split}.jsonl")
    (include / "keep_all.py").write_text("def keep(dataset):\n    return dataset\n")
    (include / "graft_fn.yaml").write_text(harness_task_yaml("graft_fn", include)
                                           + "process_docs: !function keep_all.keep\n")
    (tmp_path / "tasks.yml").write_text("tasks:\n  - name: probe\n    role: old\n"
                                        "    lm_eval: {task: graft_fn, include_path: include}\n")
    first = load_tasks(tmp_path / "tasks.yml")
    assert first.inputs == (tmp_path / "tasks.yml", include)
    Evaluator(first, harness_setup["tokenizer"], progress=False)  # the harness imports keep_all.py
    assert list(include.glob("__pycache__/*.pyc"))  # ... and caches its bytecode beside it
    assert load_tasks(tmp_path / "tasks.yml").fingerprint == first.fingerprint
    (include / "keep_all.py").write_text("def keep(dataset):\n    return dataset.select(range(4))\n")
    assert load_tasks(tmp_path / "tasks.yml").fingerprint != first.fingerprint
    (include / "keep_all.py").write_text("def keep(dataset):\n    return dataset\n")
    with open(include / "test.jsonl", "a") as handle:
        handle.write(json.dumps({"question": "Why?", "choices": ["no", LONG], "gold": 1}) + "\n")
    assert load_tasks(tmp_path / "tasks.yml").fingerprint != first.fingerprint


@pytest.mark.parametrize("where", ["inside", "is", "contains"])
def test_a_sweep_folder_inside_a_task_include_path_is_refused(tied_models, tmp_path, where):
    """The sweep's own outputs there would change the suite's fingerprint: it could never resume."""
    project = tmp_path / "project"
    include = project / "tasks" / "include"
    include.mkdir(parents=True)
    (include / "graft_x.yaml").write_text(harness_task_yaml("graft_x", include))
    (project / "new.jsonl").write_text(json.dumps({"prompt": "2 + 2 =", "answer": " 4"}) + "\n")
    tasks = project / "tasks.yml"
    tasks.write_text("tasks:\n  - {name: probe, role: old, lm_eval: {task: graft_x, include_path: tasks/include}}\n"
                     "  - {name: sums, role: new, metric: nll, data: new.jsonl}\n")
    m = tied_models
    (tmp_path / "graft.yml").write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)]))
    out = {"inside": include / "sweep", "is": include, "contains": project / "tasks"}[where]
    before = sorted(p.relative_to(project) for p in project.rglob("*"))
    line = error_line(run_cli("graftmerge", "sweep", str(tmp_path / "graft.yml"), "--lambda", "1", "--rho", "0",
                              "--eval", str(tasks), "-o", str(out)))
    how = {"inside": "is inside", "is": "is", "contains": "contains"}[where]
    assert f"output folder {out} {how} the task data {include}" in line, line
    assert sorted(p.relative_to(project) for p in project.rglob("*")) == before
