"""`sweep --eval`'s bookkeeping on tiny models, with a scorer that reads the weights themselves.

No tokenizer here: the judge scores a model from its weights (old role: closeness to θpost;
new role: how far it moved along the donor's update; plus a float64 checksum of every
weight, equal only for equal weights). That is enough to check what does not depend on the
tasks: the rule against brute force over results.jsonl, in-memory scores equal to the written
folders' scores, best/ equal to mergekit-yaml, resuming after a stop or a torn line, failed
(NaN) points, and refusing another sweep's DIR or bad input with nothing left behind. The
real tasks and Evaluator on SmolLM2 are in test_sweep_eval.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from mergekit.options import MergeOptions

from graftmerge.cli import main
from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.pipeline.config_files import read_graft_config
from graftmerge.pipeline.sweep_eval import Evaluation, check_post_scores, run_sweep_eval
from tests.helpers.models import tree_digest
from tests.helpers.runners import one_line_error, run_cli
from tests.helpers.weight_judge import (
    LAMBDAS,
    RHOS,
    OldRoleOnly,
    Stopped,
    WeightJudge,
    brute_force_choice,
    load_eval_model,
    make_setup,
    records,
    sweep,
    without_seconds,
)


@pytest.fixture(scope="module")
def setup(tied_models, tied_diag_cache, tmp_path_factory) -> dict:
    return make_setup(tmp_path_factory.mktemp("sweep-eval-bookkeeping"), tied_models, tied_diag_cache)


def tensors(folder: Path) -> dict[str, bytes]:
    checkpoint = Checkpoint(folder)
    return {name: checkpoint.read(name).contiguous().view(torch.uint8).numpy().tobytes() for name in checkpoint.tensors}


def run_mergekit_yaml(config: Path, out: Path) -> None:
    """The stock mergekit-yaml console command, in this process (graft's import hook installed)."""
    result = run_cli("mergekit-yaml", str(config), str(out))
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def fresh(setup) -> Path:
    """An uninterrupted sweep that keeps every point's folder."""
    out = setup["root"] / "fresh"
    sweep(setup, out, keep="all")
    return out


def test_rule_records_and_outputs(setup, fresh):
    lines = records(fresh)
    header = lines[0]
    assert header["kind"] == "header" and header["grid"] == {"lambda": LAMBDAS, "rho": RHOS}
    assert header["tasks_sha256"] == "tasks-1" and header["settings"] == {"dtype": "float32"}
    assert lines[1]["kind"] == "post" and lines[1]["splits"] == ["validation", "test"]
    validation = [line for line in lines if line["kind"] == "point" and line["splits"] == ["validation"]]
    assert [(p["lambda"], p["rho"]) for p in validation] == [(lam, rho) for lam in LAMBDAS for rho in RHOS]
    assert all(p["seconds"] > 0 and set(p["scores"]) == {"keep", "learn", "checksum"} for p in validation)
    chosen = json.loads((fresh / "chosen.json").read_text())
    assert chosen["chosen"] == brute_force_choice(lines, 0.3) and chosen["chosen"] is not None
    assert chosen["tolerance"] == 0.3 and "θpost" in chosen["rule"]
    # only the frontier and the chosen point are scored on test
    tested = {(p["lambda"], p["rho"]) for p in lines if p["kind"] == "point" and p["splits"] == ["test"]}
    frontier = {(p["lambda"], p["rho"]) for p in chosen["frontier"]}
    assert tested == frontier | {(chosen["chosen"]["lambda"], chosen["chosen"]["rho"])}
    assert chosen["chosen_scores"]["roles"]["test"]["new"] == pytest.approx(
        1 - chosen["chosen_scores"]["roles"]["validation"]["new"])  # the planted test split was scored, not used
    assert (fresh / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in fresh.iterdir()) == sorted(
        ["best", "chosen.json", "frontier.png", "results.jsonl"] + [f"lambda-{lam!r}_rho-{rho!r}" for lam in LAMBDAS
                                                                     for rho in RHOS])


def test_in_memory_scores_equal_the_written_folders_scores(setup, fresh):
    """Each point was scored grafted in memory; its folder, loaded as any model is, scores the same, exactly."""
    judge = WeightJudge(setup["models"])
    for line in records(fresh):
        if line["kind"] == "point" and line["splits"] == ["validation"]:
            folder = fresh / f"lambda-{line['lambda']!r}_rho-{line['rho']!r}"
            assert judge.score(load_eval_model(folder), ("validation",)) == line["scores"], folder.name


def test_in_memory_scores_equal_the_folders_scores_in_bfloat16_too(setup, tmp_path):
    """An evaluation model in bfloat16 (``--eval-dtype``): each graft is cast to out_dtype, then to the model's
    dtype."""
    out = tmp_path / "out"
    sweep(setup, out, keep="all", dtype=torch.bfloat16, settings={"dtype": "bfloat16"})
    judge = WeightJudge(setup["models"])
    for line in records(out):
        if line["kind"] == "point" and line["splits"] == ["validation"]:
            folder = out / f"lambda-{line['lambda']!r}_rho-{line['rho']!r}"
            assert judge.score(load_eval_model(folder, torch.bfloat16), ("validation",)) == line["scores"], folder


def test_best_is_mergekit_yaml_of_its_config_and_links_the_kept_folder(setup, fresh, tmp_path):
    chosen = json.loads((fresh / "chosen.json").read_text())["chosen"]
    run_mergekit_yaml(fresh / "best" / "mergekit_config.yml", tmp_path / "reference")
    assert tensors(fresh / "best") == tensors(tmp_path / "reference")
    kept = fresh / f"lambda-{chosen['lambda']!r}_rho-{chosen['rho']!r}"
    for file in (fresh / "best").iterdir():
        assert file.stat().st_ino == (kept / file.name).stat().st_ino  # no second copy on disk


def test_stopped_then_torn_line_resumes_to_the_same_result(setup, fresh, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(Stopped):
        sweep(setup, out, judge=WeightJudge(setup["models"], stop=3))  # θpost, one point, then stopped
    assert [line["kind"] for line in records(out)] == ["header", "post", "point"]
    assert not (out / "best").exists() and not (out / "chosen.json").exists()
    complete = (out / "results.jsonl").read_bytes()
    with open(out / "results.jsonl", "ab") as file:
        file.write(b'{"kind": "point", "lambda": 0.5, "rho": 0.05, "splits": ["valid')  # killed mid-write
    judge = WeightJudge(setup["models"])
    sweep(setup, out, judge=judge)
    tested = [line for line in records(fresh) if line.get("splits") == ["test"]]
    assert judge.calls == 3 + len(tested)  # the three points left (one of them torn), then frontier and chosen
    assert without_seconds(records(out)) == without_seconds(records(fresh))
    assert (out / "results.jsonl").read_bytes().startswith(complete)
    assert tensors(out / "best") == tensors(fresh / "best")
    assert json.loads((out / "chosen.json").read_text())["chosen"] == json.loads(
        (fresh / "chosen.json").read_text())["chosen"]
    assert sorted(p.name for p in out.iterdir()) == ["best", "chosen.json", "frontier.png", "results.jsonl"]


def test_a_new_tolerance_rechooses_from_the_recorded_scores(setup, fresh, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(fresh, out, ignore=shutil.ignore_patterns("lambda-*"))
    judge = WeightJudge(setup["models"])
    sweep(setup, out, judge=judge, tolerance=1.0, keep="frontier")
    chosen = json.loads((out / "chosen.json").read_text())
    assert chosen["chosen"] == brute_force_choice(records(out), 1.0) != brute_force_choice(records(fresh), 0.3)
    assert judge.calls <= 1  # at most the new choice's test score: nothing is scored on validation again
    frontier = sorted(f"lambda-{p['lambda']!r}_rho-{p['rho']!r}" for p in chosen["frontier"])
    assert sorted(p.name for p in out.glob("lambda-*")) == frontier and chosen["written"] == ["best", *[
        f"lambda-{p['lambda']!r}_rho-{p['rho']!r}" for p in chosen["frontier"]]]


def test_a_failed_evaluation_is_a_failed_point_never_chosen(setup, fresh, tmp_path):
    expected = json.loads((fresh / "chosen.json").read_text())["chosen"]
    order = [(lam, rho) for lam in LAMBDAS for rho in RHOS]
    call = 2 + order.index((expected["lambda"], expected["rho"]))  # call 1 scores θpost
    out = tmp_path / "out"
    sweep(setup, out, judge=WeightJudge(setup["models"], fail=(call,)))
    lines = records(out)
    failed = [line for line in lines if "error" in line]
    assert len(failed) == 1 and (failed[0]["lambda"], failed[0]["rho"]) == (expected["lambda"], expected["rho"])
    assert "NaN" in failed[0]["error"] and failed[0]["scores"]["learn"]["validation"] is None
    chosen = json.loads((out / "chosen.json").read_text())
    assert chosen["chosen"] == brute_force_choice(lines, 0.3) not in (None, expected)
    assert chosen["failed"] == [{**expected, "error": failed[0]["error"]}]
    assert expected not in [{"lambda": p["lambda"], "rho": p["rho"]} for p in chosen["frontier"]]


def test_theta_post_is_chosen_when_no_point_is_within_tolerance(setup, tmp_path):
    out = tmp_path / "out"
    outcome = sweep(setup, out, tolerance=0.0)
    chosen = json.loads((out / "chosen.json").read_text())
    assert outcome.chosen is None and chosen["chosen"] is None and chosen["qualified"] == 0
    assert (chosen["best"]["lambda"], chosen["best"]["rho"]) == (0.0, 0.0)
    post = Checkpoint(setup["models"]["post"])
    best = Checkpoint(out / "best")
    for name in best.tensors:  # the λ = 0 graft: θpost cast to out_dtype
        assert torch.equal(best.read(name), post.read(name).to(torch.bfloat16)), name
    run_mergekit_yaml(out / "best" / "mergekit_config.yml", tmp_path / "reference")
    assert tensors(out / "best") == tensors(tmp_path / "reference")


@pytest.mark.parametrize("change", ["grid", "config", "tasks", "settings"])
def test_another_sweeps_log_in_dir_is_refused_and_left_alone(setup, fresh, tmp_path, change):
    out = tmp_path / "out"
    shutil.copytree(fresh, out, ignore=shutil.ignore_patterns("lambda-*"))
    before = tree_digest(out)
    changed = dict(lambdas=[0.5, 2.0]) if change == "grid" else dict(fingerprint="tasks-2") if change == "tasks" \
        else dict(settings={"dtype": "bfloat16"}) if change == "settings" else {}
    if change == "config":
        changed["config"] = tmp_path / "graft.yml"
        changed["config"].write_text(setup["config"].read_text().replace("lambda: 1.0", "lambda: 0.7"))
    with pytest.raises(GraftError, match="log of another sweep") as error:
        sweep(setup, out, **changed)
    assert {"grid": "grid", "config": "graft config", "tasks": "task file", "settings": "settings"}[change] in str(
        error.value)
    assert tree_digest(out) == before and not (tmp_path / ".out.lock").exists()


@pytest.mark.parametrize("case", ["tolerance-negative", "tolerance-above-1", "tolerance-nan", "keep", "not-empty",
                                  "dir-is-input", "dir-holds-tasks", "post-nan", "one-role", "judge-refuses"])
def test_bad_input_leaves_nothing(setup, tmp_path, case):
    out = tmp_path / "out"
    arguments: dict = {}
    if case.startswith("tolerance"):
        arguments["tolerance"] = {"negative": -0.01, "above-1": 1.5, "nan": math.nan}[case.split("-", 1)[1]]
    elif case == "keep":
        arguments["keep"] = "some"
    elif case == "not-empty":
        out.mkdir()
        (out / "mine.txt").write_text("keep me")
    elif case == "dir-is-input":
        out = setup["models"]["post"]
    elif case == "dir-holds-tasks":
        out = setup["root"]
    elif case == "post-nan":
        arguments["judge"] = WeightJudge(setup["models"], fail=(1,))
    elif case == "one-role":
        arguments["judge"] = OldRoleOnly(setup["models"])
    before = tree_digest(out) if out.exists() else None
    if case == "judge-refuses":
        with pytest.raises(GraftError, match="task"):
            _sweep_with_refusing_judge(setup, out)
    else:
        with pytest.raises(GraftError):
            sweep(setup, out, **arguments)
    assert (tree_digest(out) if out.exists() else None) == before
    assert not list(out.parent.glob(f".{out.name}.*"))


def _sweep_with_refusing_judge(setup: dict, out: Path) -> None:
    """The caller's evaluator refuses the tasks (as Evaluator construction does) once θpost is loaded."""
    loaded, source, plan = read_graft_config(str(setup["config"]))

    def make_judge():
        raise GraftError("tasks.yml:3: task 'facts' has no test examples")

    run_sweep_eval(loaded, source, plan, LAMBDAS, RHOS, str(out), MergeOptions(quiet=True),
                   Evaluation((str(setup["tasks"]),), "tasks-1", {}), make_judge)


def test_tolerance_and_keep_need_eval(setup, tmp_path):
    for option in (["--tolerance", "0.1"], ["--keep", "all"], ["--eval-dtype", "auto"]):
        result = CliRunner().invoke(main, ["sweep", str(setup["config"]), "--lambda", "1", "--rho", "0", "-o",
                                           str(tmp_path / "out"), *option])
        assert "--eval" in one_line_error(result) and not (tmp_path / "out").exists()
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize(("command", "each", "uses_roles"), [("sweep", "point", "the rule compares"),
                                                              ("search", "trial", "the search maximises")])
def test_post_scores_that_are_nan_or_lack_a_role_stop_the_sweep_and_the_search(command, each, uses_roles):
    """One check of θpost's validation scores serves the sweep and the search, each in its own words."""
    good = {"scores": {"known": {"validation": 0.5}, "facts": {"validation": 0.1}},
            "roles": {"validation": {"old": 0.5, "new": 0.1}}}
    check_post_scores(good, command, each, uses_roles)
    nan = {**good, "scores": {"known": {"validation": math.nan}, "facts": {"validation": 0.1}}}
    with pytest.raises(GraftError, match=f"NaN for .*every {each} with θpost, so the {command} cannot choose"):
        check_post_scores(nan, command, each, uses_roles)
    no_new = {"scores": {"known": {"validation": 0.5}}, "roles": {"validation": {"old": 0.5}}}
    with pytest.raises(GraftError, match=f"no new-role score on validation; {uses_roles} old- and new-role"):
        check_post_scores(no_new, command, each, uses_roles)
