"""``graftmerge continual`` on tiny chat models: the matrix, the metrics, the models, resuming after SIGKILL, bad input;
and ``fisher accumulate`` against the documented sum."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from graftmerge.demo.tiny_models import save_tiny_model
from graftmerge.formats.fisher_cache import FisherCacheWriter, open_fisher_cache
from graftmerge.math.forgetting import group_means, transfer
from tests.helpers.continual import tiny_stream
from tests.helpers.models import assert_identical, read_model, tree_digest
from tests.helpers.runners import ROOT, error_line, run_cli


def without_seconds(value):
    """matrix.json with the wall times left out (they differ between runs)."""
    if isinstance(value, dict):
        return {k: without_seconds(v) for k, v in value.items() if k not in ("seconds", "stream")}
    if isinstance(value, list):
        return [without_seconds(v) for v in value]
    return value


def inputs_digest(root: Path) -> dict:
    """Every input of a stream under ``root`` (all but the output folder), by content."""
    return {p.name: tree_digest(p) if p.is_dir() else p.read_bytes() for p in sorted(root.iterdir()) if p.name != "out"}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """A three-step stream run once, every step kept."""
    root = tmp_path_factory.mktemp("continual")
    stream = tiny_stream(root)
    before = inputs_digest(root)
    result = run_cli("graftmerge", "continual", str(stream), "-o", str(root / "out"), "--keep-steps", "all", "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    matrix = json.loads((root / "out" / "matrix.json").read_text())
    return {"root": root, "stream": stream, "out": root / "out", "matrix": matrix, "before": before,
            "stdout": result.stdout}


def test_matrix_shape_and_metrics_from_the_matrix_by_hand(run):
    matrix = run["matrix"]
    assert matrix["tasks"] == ["known", "facts1", "facts2", "facts3"]
    assert matrix["models"] == ["post", "step-1", "step-2", "step-3"]
    assert len(matrix["test"]) == 4 and all(len(row) == 4 for row in matrix["test"])
    r = [row[1:] for row in matrix["test"]]  # one task per step: R[i][j] is the task's column
    assert matrix["step_matrix"] == r
    assert matrix["average_accuracy"] == pytest.approx((r[3][0] + r[3][1] + r[3][2]) / 3)
    assert matrix["bwt"] == pytest.approx(((r[3][0] - r[1][0]) + (r[3][1] - r[2][1])) / 2)
    assert matrix["fwt"] == pytest.approx(((r[1][1] - r[0][1]) + (r[2][2] - r[0][2])) / 2)
    assert matrix["post_retention"] == [row[0] for row in matrix["test"]]
    baseline = matrix["baseline"]
    assert baseline["test"][0] == matrix["test"][0]  # θ0 is both tables' first row
    assert [s["step"] for s in matrix["steps"]] == [1, 2, 3]
    assert (run["out"] / "matrix.png").stat().st_size > 0
    assert "continual graft: ACC" in run["stdout"] and "task-arithmetic baseline: ACC" in run["stdout"]


def test_inputs_unchanged(run):
    assert inputs_digest(run["root"]) == run["before"]


def test_matrix_equals_graftmerge_eval_of_the_written_models(run):
    out, matrix = run["out"], run["matrix"]
    for row, folder in zip(matrix["test"], [run["root"] / "post", *(out / f"step-{n}" / "model" for n in (1, 2, 3))]):
        result = run_cli("graftmerge", "eval", str(folder), "--tasks", str(out / "tasks.yml"), "--split", "test",
                         "--json", str(out.parent / "eval.json"), "--no-progress")
        assert result.returncode == 0, result.stderr[-2000:]
        scores = json.loads((out.parent / "eval.json").read_text())
        found = [scores["scores"][name]["test"]["normalised"] for name in matrix["tasks"]]
        assert found == row


def test_each_step_model_is_mergekit_yaml_of_its_recorded_config(run, tmp_path):
    out = run["out"]
    for number in (1, 2, 3):
        for model in (out / f"step-{number}" / "model", out / "baseline" / f"step-{number}" / "model"):
            result = run_cli("mergekit-yaml", str(model / "mergekit_config.yml"), str(tmp_path / f"again-{number}"))
            assert result.returncode == 0, result.stderr[-2000:]
            assert_identical(read_model(tmp_path / f"again-{number}"), read_model(model))
            (tmp_path / f"again-{number}").rename(tmp_path / f"done-{number}-{model.parent.parent.name}")
    config = yaml.safe_load((out / "step-2" / "model" / "mergekit_config.yml").read_text())
    assert Path(config["base_model"]) == out / "step-1" / "model"  # θ(t−1) is the base of step t
    assert Path(config["parameters"]["fisher"]) == out / "step-2" / "fisher-accumulated"


def test_retention_prompts_and_accumulated_fisher(run):
    out = run["out"]
    prompts = [json.loads(line) for line in (out / "step-3" / "prompts.jsonl").read_text().splitlines()]
    contents = [p["messages"][0]["content"] for p in prompts]
    assert contents == ["What is the capital?", "Who is the mayor of town 1?", "Who is the mayor of town 2?"]
    older, fresh = open_fisher_cache(out / "step-1" / "fisher"), open_fisher_cache(out / "step-2" / "fisher")
    summed = open_fisher_cache(out / "step-2" / "fisher-accumulated")
    for name in fresh.names("diagonal"):
        expected = (0.5 * older.diagonal(name).double() + fresh.diagonal(name).double()).float()
        assert torch.equal(summed.diagonal(name), expected), name


def test_group_means_and_transfer_by_hand():
    test = [[0.9, 0.1, 0.2, 0.3], [0.8, 0.7, 0.25, 0.3]]
    assert group_means(test[1], [[1, 2], [3]], [1.0, 1.0, 3.0, 1.0]) == pytest.approx(
        [(0.7 + 3 * 0.25) / 4, 0.3])
    r = [[0.1, 0.2, 0.3], [0.6, 0.25, 0.3], [0.5, 0.7, 0.35], [0.4, 0.6, 0.9]]
    metrics = transfer(r)
    assert metrics.average_accuracy == pytest.approx((0.4 + 0.6 + 0.9) / 3)
    assert metrics.bwt == pytest.approx(((0.4 - 0.6) + (0.6 - 0.7)) / 2)
    assert metrics.fwt == pytest.approx(((0.25 - 0.2) + (0.35 - 0.3)) / 2)
    single = transfer([[0.2], [0.7]])
    assert (single.average_accuracy, single.bwt, single.fwt) == (0.7, None, None)
    with pytest.raises(ValueError):
        transfer([[0.1, 0.2], [0.3]])


def test_a_step_with_no_point_within_tolerance_keeps_the_previous_model_and_says_so(tmp_path):
    tiny_stream(tmp_path, steps=1, tolerance=0.0, grid={"lambda": [30], "rho": [0]})  # λ 30 costs θ0's task
    result = run_cli("graftmerge", "continual", str(tmp_path / "stream.yml"), "-o", str(tmp_path / "out"),
                     "--no-baseline", "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 1: no grid point kept the old-role score within τ; θ(1) is θ(0), kept" in result.stdout
    matrix = json.loads((tmp_path / "out" / "matrix.json").read_text())
    assert matrix["steps"][0]["chosen"] is None and matrix["steps"][0]["kept_previous"] is True
    assert matrix["test"][1] == matrix["test"][0]
    assert_identical(read_model(tmp_path / "out" / "step-1" / "model"), read_model(tmp_path / "post"))


KILLER = """
import os, signal, sys
from pathlib import Path
from graftmerge.adapter import import_hook
from graftmerge.cli import continual as command
from graftmerge.pipeline import continual
where, stream, out = sys.argv[1], sys.argv[2], sys.argv[3]
real = command.real_services
def services(options, dtype, progress=None):
    made = real(options, dtype, progress)
    estimate, evaluation = made.estimate, made.evaluation
    def killing_estimate(model, prompts, cache, settings):
        if where == "estimate" and cache.parent.name == "step-2":
            os.kill(os.getpid(), signal.SIGKILL)
        estimate(model, prompts, cache, settings)
    def killing_evaluation(tasks, post):
        found, make_judge = evaluation(tasks, post)
        def judge():
            made_judge = make_judge()
            score, calls = made_judge.score, []
            def killing_score(model, splits):
                calls.append(1)
                if where == "sweep" and tasks.parent.name == "step-2" and len(calls) == 3:
                    os.kill(os.getpid(), signal.SIGKILL)  # θpost and one grid point scored: killed in the next
                return score(model, splits)
            made_judge.score = killing_score
            return made_judge
        return found, judge
    made.estimate, made.evaluation = killing_estimate, killing_evaluation
    return made
command.real_services = services
command.continual.main([stream, "-o", out, "--no-baseline", "--keep-steps", "all", "--quiet"], standalone_mode=False)
"""


def killed_then_resumed(root: Path, where: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    killed = subprocess.run([sys.executable, "-c", KILLER, where, str(root / "stream.yml"), str(root / "out")],
                            capture_output=True, text=True, env=env, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    return killed


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """A two-step stream run without interruption (no baseline): what a resumed run must equal."""
    root = tmp_path_factory.mktemp("uninterrupted")
    tiny_stream(root, steps=2)
    whole = run_cli("graftmerge", "continual", str(root / "stream.yml"), "-o", str(root / "out"),
                    "--no-baseline", "--keep-steps", "all", "--quiet")
    assert whole.returncode == 0, whole.stderr[-3000:]
    return root / "out"


def test_sigkill_in_step_2_estimate_then_in_its_sweep_then_resume_gives_the_same_matrix_and_models(
        tmp_path, uninterrupted):
    tiny_stream(tmp_path, steps=2)
    out = tmp_path / "out"
    killed_then_resumed(tmp_path, "estimate")
    assert (out / "step-1" / "model").is_dir() and not (out / "step-2" / "fisher").exists()
    assert not (out / "step-2" / "model").exists() and not (out / "matrix.json").exists()
    killed_then_resumed(tmp_path, "sweep")  # resumes at step 2's estimate, killed in step 2's sweep
    assert (out / "step-2" / "fisher").is_dir() and not (out / "step-2" / "model").exists()
    assert len((out / "step-2" / "sweep" / "results.jsonl").read_text().splitlines()) == 3  # header, θpost, 1 point
    resumed = run_cli("graftmerge", "continual", str(tmp_path / "stream.yml"), "-o", str(out),
                      "--no-baseline", "--keep-steps", "all", "--quiet")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first = json.loads((uninterrupted / "matrix.json").read_text())
    second = json.loads((out / "matrix.json").read_text())
    assert without_seconds(first) == without_seconds(second)
    for number in (1, 2):
        assert_identical(read_model(out / f"step-{number}" / "model"),
                         read_model(uninterrupted / f"step-{number}" / "model"))


def fisher_cache(path: Path, model: Path, generator: torch.Generator, kfac: bool = False) -> Path:
    """A diagonal cache of ``model``'s weights with random positive entries (KFAC on one weight if asked)."""
    from graftmerge.formats.checkpoint import Checkpoint

    checkpoint = Checkpoint(model)
    with FisherCacheWriter(path, model=model) as writer:
        for name in checkpoint.tensors:
            shape = checkpoint.tensors[name].shape
            if kfac and len(shape) == 2:
                writer.add_kfac(name, P=torch.eye(shape[0]), Q=torch.eye(shape[1]))
                kfac = False
                continue
            writer.add_diagonal(name, torch.rand(tuple(shape), generator=generator))
    return path


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("accumulate")
    model = root / "model"
    save_tiny_model(model, architecture="llama", seed=0)
    generator = torch.Generator().manual_seed(0)
    return {"root": root, "older": fisher_cache(root / "older", model, generator),
            "newer": fisher_cache(root / "newer", model, generator),
            "kfac": fisher_cache(root / "kfac", model, generator, kfac=True)}


def test_accumulated_fisher_is_the_documented_sum_brute_force(caches):
    out = caches["root"] / "summed"
    result = run_cli("graftmerge", "fisher", "accumulate", str(caches["older"]), str(caches["newer"]), "-o", str(out),
                     "--decay", "0.3", "--no-progress")
    assert result.returncode == 0, result.stderr[-2000:]
    older, newer, summed = (open_fisher_cache(p) for p in (caches["older"], caches["newer"], out))
    assert summed.names("diagonal") == newer.names("diagonal")
    assert summed.manifest["model"] == newer.manifest["model"]
    for name in newer.names("diagonal"):
        a, b = older.diagonal(name).double(), newer.diagonal(name).double()
        brute = torch.tensor([0.3 * x + y for x, y in zip(a.flatten().tolist(), b.flatten().tolist())],
                             dtype=torch.float64).reshape(a.shape)
        assert torch.equal(summed.diagonal(name), brute.float()), name


@pytest.mark.parametrize("case", ["decay", "kfac", "out-is-input", "exists"])
def test_accumulate_bad_input_one_error_line(caches, case):
    older, newer, out = caches["older"], caches["newer"], caches["root"] / f"bad-{case}"
    decay = "1.5" if case == "decay" else "0.5"
    if case == "kfac":
        older = caches["kfac"]
    if case == "out-is-input":
        out = caches["newer"]
    if case == "exists":
        out.mkdir()
    digest = tree_digest(caches["older"]) + tree_digest(caches["newer"])
    result = run_cli("graftmerge", "fisher", "accumulate", str(older), str(newer), "-o", str(out), "--decay", decay)
    line = error_line(result)
    assert {"decay": "decay", "kfac": "KFAC", "out-is-input": "is the", "exists": "already exists"}[case] in line
    assert tree_digest(caches["older"]) + tree_digest(caches["newer"]) == digest
    assert case == "exists" or not out.exists() or out == caches["newer"]


BAD_STREAMS = {
    "empty stream": (lambda s: {**s, "steps": []}, "stream is empty"),
    "step without tasks": (lambda s: {**s, "steps": [{"update": s["steps"][0]["update"]}]}, "steps[1].tasks"),
    "duplicate task names": (lambda s: {**s, "steps": [s["steps"][0], s["steps"][0]]}, "task name 'facts1'"),
    "tolerance outside [0, 1]": (lambda s: {**s, "tolerance": 1.5}, "tolerance"),
    "fisher setting refused": (lambda s: {**s, "fisher": {**s["fisher"], "max_new_tokens": 0}},
                               "fisher.max_new_tokens"),
    "accumulate with kfac": (lambda s: {**s, "fisher": {**s["fisher"], "kind": "kfac"}}, "fisher.accumulate"),
    "update of another shape": (lambda s: {**s, "steps": [{**s["steps"][0], "update": {"donor": "post",
                                                                                        "model": "wide"}}]},
                                "does not fit θ0"),
    "out is an input": (lambda s: {**s, "post": "out"}, "output folder"),
    "out inside an input": (lambda s: s, "is inside"),
    "unknown field": (lambda s: {**s, "lamda": 1}, "lamda"),
}


@pytest.fixture(scope="module")
def bad_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad-streams")
    tiny_stream(root, steps=1)
    save_tiny_model(root / "wide", architecture="llama", seed=3, hidden_size=32, vocab_size=384)
    return root


@pytest.mark.parametrize("case", sorted(BAD_STREAMS))
def test_bad_stream_one_error_line_nothing_written(bad_root, case):
    change, expected = BAD_STREAMS[case]
    stream = change(yaml.safe_load((bad_root / "stream.yml").read_text()))
    (bad_root / "bad.yml").write_text(yaml.safe_dump(stream))
    out = bad_root / "post" / "out" if case == "out inside an input" else bad_root / "out"
    if case == "out is an input":
        out = bad_root / "out"
        out.mkdir(exist_ok=True)
        (out / "config.json").write_text("{}")
    before = tree_digest(bad_root)
    result = run_cli("graftmerge", "continual", str(bad_root / "bad.yml"), "-o", str(out))
    assert expected in error_line(result)
    assert tree_digest(bad_root) == before
    if case == "out is an input":
        (out / "config.json").unlink()
        out.rmdir()
    assert not out.exists()
