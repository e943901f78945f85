"""`graftmerge search` on tiny models, with the weight judge of the sweep's bookkeeping tests.

The judge scores a model from its weights (tests/helpers/weight_judge.py: old role = closeness to
θpost, new role = how far it moved along the donor's update, a checksum of every weight): a known
objective, so the recorded Pareto set is checked against the non-dominated set of the recorded
trials, the chosen trial against the rule written out, the hypervolume against a brute force over
grid cells. best/ is mergekit-yaml's output of its config, a per-layer schedule included; a search
SIGKILLed mid-study resumes to the results of an uninterrupted one; two worker processes give the
records a single worker gives for the same points; bad input is refused before any work.
The real tasks on SmolLM2 are in test_search_smollm2.py.
"""

from __future__ import annotations

import functools
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.results_log import read_log
from graftmerge.formats.sweep_log import parse_sweep_log
from graftmerge.math.frontier import hypervolume
from graftmerge.pipeline.search import Space
from graftmerge.pipeline.search_study import Study
from tests.helpers.runners import run_cli
from tests.helpers.search_runs import search
from tests.helpers.weight_judge import brute_force_choice, make_setup, records, without_seconds

REPO = Path(__file__).resolve().parents[1]
UNMASKED = Space((0.25, 1.5), None, 0)  # no scoring pass: the cheapest trials


@pytest.fixture(scope="module")
def setup(tied_models, tied_diag_cache, tmp_path_factory) -> dict:
    return make_setup(tmp_path_factory.mktemp("search"), tied_models, tied_diag_cache)


@pytest.fixture(scope="module")
def searched(setup) -> Path:
    """A finished (λ, ρ) search of 7 trials: the 4 grid corners, then TPE."""
    out = setup["root"] / "searched"
    search(setup["models"], setup["config"], setup["tasks"], out, trials=7)
    return out


def tensors(folder: Path) -> dict[str, bytes]:
    checkpoint = Checkpoint(folder)
    return {name: checkpoint.read(name).contiguous().view(torch.uint8).numpy().tobytes() for name in checkpoint.tensors}


def validation_records(lines: list[dict]) -> list[dict]:
    return [line for line in lines if line["kind"] == "point" and line["splits"] == ["validation"]]


def scores(record: dict) -> tuple[float, float]:
    roles = record["roles"]["validation"]
    return roles["old"], roles["new"]


def brute_force_hypervolume(points: list[tuple[float, float]], reference: tuple[float, float]) -> float:
    """The dominated area, cell by cell of the grid every point's coordinates cut the plane into."""
    kept = [(o, n) for o, n in points if math.isfinite(o) and math.isfinite(n)]
    xs = sorted({reference[0], *(o for o, _ in kept if o > reference[0])})
    ys = sorted({reference[1], *(n for _, n in kept if n > reference[1])})
    area = 0.0
    for x0, x1 in zip(xs, xs[1:]):
        for y0, y1 in zip(ys, ys[1:]):
            if any(o >= x1 and n >= y1 for o, n in kept):
                area += (x1 - x0) * (y1 - y0)
    return area


@pytest.mark.parametrize("seed", range(6))
def test_hypervolume_equals_brute_force(seed):
    rng = random.Random(seed)
    points = [(rng.random(), rng.random()) for _ in range(rng.randint(0, 25))]
    points += [points[0]] * 2 if points else []  # repeats
    points += [(rng.choice([0.3, 0.6]), rng.choice([0.2, 0.7])) for _ in range(4)]  # ties in one role
    points += [(math.nan, 0.9), (0.9, math.inf), (-0.5, 0.5)]  # failed, and below the reference
    reference = (rng.choice([0.0, 0.1]), 0.0)
    got = hypervolume([o for o, _ in points], [n for _, n in points], reference)
    assert got == pytest.approx(brute_force_hypervolume(points, reference), rel=1e-12, abs=1e-15)


def test_hypervolume_of_nothing_and_of_one_point():
    assert hypervolume([], []) == 0.0
    assert hypervolume([0.5], [0.25]) == pytest.approx(0.125)
    assert hypervolume([0.5, 0.25], [0.25, 0.5]) == pytest.approx(0.5 * 0.25 + 0.25 * 0.25)


def test_records_frontier_and_rule(searched):
    lines = records(searched)
    header, post = lines[0], lines[1]
    assert header["kind"] == "header" and header["search"]["seed"] == 0 and post["kind"] == "post"
    trials = validation_records(lines)
    assert [t["trial"] for t in trials] == list(range(7))
    corners = [(0.25, 0.0), (0.25, 0.3), (1.5, 0.0), (1.5, 0.3)]
    assert [(t["lambda"], t["rho"]) for t in trials[:4]] == corners  # the seeded warm start
    assert all(0.25 <= t["lambda"] <= 1.5 and (t["rho"] == 0 or 0.01 <= t["rho"] <= 0.3) for t in trials)
    chosen = json.loads((searched / "chosen.json").read_text())
    # the recorded Pareto set is the non-dominated set of the recorded trials
    dominated = {t["trial"] for t in trials for u in trials
                 if all(a >= b for a, b in zip(scores(u), scores(t))) and scores(u) != scores(t)}
    assert sorted(p["trial"] for p in chosen["frontier"]) == sorted({t["trial"] for t in trials} - dominated)
    assert {k: chosen["chosen"][k] for k in ("lambda", "rho")} == brute_force_choice(lines, 0.3)
    tested = sorted(line["trial"] for line in lines if line.get("splits") == ["test"])
    assert tested == sorted({p["trial"] for p in chosen["frontier"]} | {chosen["chosen"]["trial"]})
    assert chosen["hypervolume"] == pytest.approx(brute_force_hypervolume([scores(t) for t in trials], (0, 0)))
    assert (searched / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert read_log(searched / "results.jsonl", functools.partial(parse_sweep_log, expected=header)) is not None
    assert sorted(p.name for p in searched.iterdir() if not p.name.startswith(".")) == [
        "best", "chosen.json", "frontier.png", "results.jsonl", "study.journal"]


def test_best_is_mergekit_yaml_of_its_config(searched, tmp_path):
    result = run_cli("mergekit-yaml", str(searched / "best" / "mergekit_config.yml"), str(tmp_path / "reference"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert tensors(searched / "best") == tensors(tmp_path / "reference")


def test_a_finished_search_run_again_changes_nothing(setup, searched):
    before = records(searched)
    search(setup["models"], setup["config"], setup["tasks"], searched, trials=7)
    assert records(searched) == before or without_seconds(records(searched)) == without_seconds(before)


def test_per_layer_schedule_best_is_mergekit_yaml(setup, tmp_path):
    out = tmp_path / "out"
    outcome = search(setup["models"], setup["config"], setup["tasks"], out, trials=2, warm_start="none",
                     space=Space((0.25, 1.5), None, 2), tolerance=1.0)
    trials = validation_records(records(out))
    assert all(len(t["layers"]) == 2 and t["lambda"] == pytest.approx(sum(t["layers"]) / 2) for t in trials)
    assert outcome.chosen is not None and len(set(outcome.chosen.layers)) == 2  # a schedule no grid point is
    config = (out / "best" / "mergekit_config.yml").read_text()
    assert f"- {outcome.chosen.layers[0]!r}" in config or str(outcome.chosen.layers[0]) in config
    result = run_cli("mergekit-yaml", str(out / "best" / "mergekit_config.yml"), str(tmp_path / "reference"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert tensors(out / "best") == tensors(tmp_path / "reference")


def test_per_layer_rho_under_tensor_scope_best_is_mergekit_yaml(setup, tmp_path):
    """rho_scope: tensor: ρ is searched as anchors too; the masked corner ([0.3, 0.3]) is the only trial within
    τ = 0.03 of θpost, so best/ holds a ρ schedule."""
    config = tmp_path / "tensor.yml"
    config.write_text(setup["config"].read_text().replace("  rho: 0.0\n", "  rho: 0.0\n  rho_scope: tensor\n"))
    out = tmp_path / "out"
    outcome = search(setup["models"], config, setup["tasks"], out, trials=2, tolerance=0.03,
                     space=Space((0.25, 1.5), (0.01, 0.3), 2))
    trials = validation_records(records(out))
    assert [(t["layers"], t.get("rho_layers")) for t in trials] == [([0.25, 0.25], None), ([0.25, 0.25], [0.3, 0.3])]
    assert outcome.chosen is not None and outcome.chosen.rho_layers == (0.3, 0.3)
    assert "rho:\n  - 0.3\n  - 0.3" in (out / "best" / "mergekit_config.yml").read_text()
    result = run_cli("mergekit-yaml", str(out / "best" / "mergekit_config.yml"), str(tmp_path / "reference"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert tensors(out / "best") == tensors(tmp_path / "reference")


def test_several_configs_are_one_categorical_choice(setup, tmp_path):
    """Two configs (another fine-tune as donor_ft): the corners of each first, each trial names its config, and
    best/ is mergekit-yaml of the chosen config at the chosen point."""
    other = tmp_path / "other.yml"
    other.write_text(setup["config"].read_text().replace(str(setup["models"]["donor_ft"]),
                                                         str(setup["models"]["donor_ft2"])))
    out = tmp_path / "out"
    outcome = search(setup["models"], setup["config"], setup["tasks"], out, trials=6, space=UNMASKED,
                     more_configs=(other,))
    trials = validation_records(records(out))
    assert [(t["config"], t["lambda"]) for t in trials[:4]] == [(0, 0.25), (0, 1.5), (1, 0.25), (1, 1.5)]
    assert all(t["config"] in (0, 1) for t in trials)
    assert trials[0]["scores"] != trials[2]["scores"]  # the same point of the other config is another model
    chosen = json.loads((out / "chosen.json").read_text())["chosen"]
    assert chosen["config"] == outcome.chosen.config
    donor_ft = setup["models"]["donor_ft2" if outcome.chosen.config else "donor_ft"]
    assert str(donor_ft) in (out / "best" / "mergekit_config.yml").read_text()
    result = run_cli("mergekit-yaml", str(out / "best" / "mergekit_config.yml"), str(tmp_path / "reference"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert tensors(out / "best") == tensors(tmp_path / "reference")


def test_configs_of_different_models_are_refused(setup, tmp_path):
    other = tmp_path / "other.yml"
    other.write_text(setup["config"].read_text().replace(f"base_model: {setup['models']['post']}",
                                                         f"base_model: {setup['models']['donor_ft2']}"))
    with pytest.raises(GraftError, match="must share base_model"):
        search(setup["models"], setup["config"], setup["tasks"], tmp_path / "out", trials=3, space=UNMASKED,
               more_configs=(other,))
    assert not (tmp_path / "out").exists()


def worker_arguments(setup: dict, out: Path, trials: int, kill: int, workers: int) -> list[str]:
    models = setup["models"]
    return [sys.executable, "-m", "tests.helpers.search_runs", str(models["post"]), str(models["donor"]),
            str(models["donor_ft"]), str(setup["config"]), str(setup["tasks"]), str(out), str(trials), "0",
            str(kill), str(workers)]


def run_process(arguments: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(arguments, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def unmasked(setup) -> Path:
    """An uninterrupted search of 5 trials without masks (2 corners, then TPE), in this process."""
    out = setup["root"] / "unmasked"
    search(setup["models"], setup["config"], setup["tasks"], out, trials=5, space=UNMASKED)
    return out


def test_sigkill_mid_study_then_resume_gives_the_same_results(setup, unmasked, tmp_path):
    out = tmp_path / "out"
    killed = run_process(worker_arguments(setup, out, 5, kill=5, workers=1))  # θpost, 3 trials, killed in the 4th
    assert killed.returncode == -9, killed.stderr[-3000:]
    study = Study(out).trials()
    assert [t.state for t in study] == ["complete"] * 3 + ["running"]
    assert not (out / "chosen.json").exists()
    search(setup["models"], setup["config"], setup["tasks"], out, trials=5, space=UNMASKED)
    assert without_seconds(records(out)) == without_seconds(records(unmasked))
    assert tensors(out / "best") == tensors(unmasked / "best")


def test_two_workers_give_a_single_workers_records_for_the_same_trials(setup, tmp_path):
    out = tmp_path / "two"
    finished = run_process(worker_arguments(setup, out, 6, kill=0, workers=2))
    assert finished.returncode == 0, finished.stderr[-3000:]
    trials = validation_records(records(out))
    assert [t["trial"] for t in trials] == list(range(6))
    assert {t.state for t in Study(out).trials()} == {"complete"}
    # one worker, warm-started from those very points, scores each exactly as the two did
    single = tmp_path / "single"
    search(setup["models"], setup["config"], setup["tasks"], single, trials=6, space=UNMASKED,
           warm_start=str(out / "results.jsonl"))
    again = validation_records(records(single))
    key = lambda t: (t["lambda"], t["rho"])  # noqa: E731
    assert sorted(map(key, again)) == sorted(set(map(key, trials)))
    strip = lambda t: {k: v for k, v in t.items() if k not in ("seconds", "trial")}  # noqa: E731
    assert sorted(map(json.dumps, map(strip, again))) == sorted({json.dumps(strip(t)) for t in trials})


def scheduled_config(setup: dict, tmp_path: Path) -> Path:
    path = tmp_path / "scheduled.yml"
    path.write_text(setup["config"].read_text().replace("lambda: 1.0", "lambda: [0.5, 1.0]"))
    return path


BAD = {
    "no trials": (dict(trials=0), "--trials must be at least 1"),
    "negative lambda": (dict(space=Space((-0.5, 1.0), None, 0)), "--lambda-range"),
    "empty lambda range": (dict(space=Space((1.0, 0.5), None, 0)), "--lambda-range"),
    "rho at 1": (dict(space=Space((0.5, 1.0), (0.01, 1.0), 0)), "--rho-range"),
    "rho range from 0": (dict(space=Space((0.5, 1.0), (0.0, 0.1), 0)), "--rho-range"),
    "more anchors than layers": (dict(space=Space((0.5, 1.0), None, 3)), "--per-layer 3"),
    "schedule already fixed": ("scheduled", "already fixes one"),
    "warm start not a log": ("warm", "--warm-start"),
    "tolerance": (dict(tolerance=2.0), "--tolerance"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_refused_before_any_work(setup, tmp_path, case):
    arguments, message = BAD[case]
    config = setup["config"]
    if arguments == "scheduled":
        config, arguments = scheduled_config(setup, tmp_path), dict(space=Space((0.5, 1.0), None, 2))
    elif arguments == "warm":
        (tmp_path / "old.jsonl").write_text("not json\n")
        arguments = dict(warm_start=str(tmp_path / "old.jsonl"))
    out = tmp_path / "out"
    with pytest.raises(GraftError, match=message.replace("-", r"\-")):
        search(setup["models"], config, setup["tasks"], out, **{"trials": 3, **arguments})
    assert not out.exists()


def test_a_study_of_other_tasks_or_space_is_refused_and_left_alone(setup, unmasked):
    before = {p.name: p.stat().st_mtime_ns for p in unmasked.iterdir()}
    with pytest.raises(GraftError, match="task file or task data"):
        search(setup["models"], setup["config"], setup["tasks"], unmasked, trials=5, space=UNMASKED,
               fingerprint="tasks-2")
    with pytest.raises(GraftError, match="search space, seed or warm start"):
        search(setup["models"], setup["config"], setup["tasks"], unmasked, trials=5, space=UNMASKED, seed=1)
    assert {p.name: p.stat().st_mtime_ns for p in unmasked.iterdir()} == before


def test_the_cli_without_optuna_says_how_to_install_it(setup, tmp_path):
    code = ("import sys; sys.modules['optuna'] = None; from graftmerge.cli import main; "
            f"main(['search', {str(setup['config'])!r}, '--eval', {str(setup['tasks'])!r}, '-o', "
            f"{str(tmp_path / 'out')!r}, '--trials', '3'])")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: graftmerge search needs Optuna: pip install 'graftmerge[search]' (or pip install 'optuna>=4,<5')"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arguments, message", [
    (["--trials", "0"], "--trials must be at least 1"),
    (["--trials", "3", "--lambda-range", "-1,1"], "--lambda-range"),
    (["--trials", "3", "--rho-range", "0.1,1"], "--rho-range"),
    (["--trials", "3", "--lambda-range", "1"], "--lambda-range"),
])
def test_cli_bad_options_one_error_line(setup, tmp_path, arguments, message):
    result = run_cli("graftmerge", "search", str(setup["config"]), "--eval", str(setup["tasks"]), "-o",
                     str(tmp_path / "out"), *arguments)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert not (tmp_path / "out").exists()
