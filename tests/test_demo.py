"""`graftmerge demo` and the experiment's `python -m experiments.demo`: every artefact written and consistent.

`graftmerge demo` runs as a real process; `python -m experiments.demo --tiny` (every stage of `--lm` at a
tiny size) runs its click command in this process (tests.helpers.runners.run_cli, `--jobs 0`: no
worker processes), its own merges and estimates in subprocesses.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from experiments.demo import lm_results_2
from experiments.demo.cli import demo as experiment
from experiments.demo.lm_evaluate import graft_config
from experiments.demo.lm_settings import TINY
from graftmerge.cli import main
from graftmerge.formats.checkpoint import Checkpoint
from tests.helpers.models import read_model
from tests.helpers.references import brute_force_graft
from tests.helpers.runners import mergekit_yaml_model, one_line_error, run_cli

pytestmark = pytest.mark.schedule_first  # each demo trains, estimates and merges for tens of seconds


def test_demo_writes_consistent_artefacts(tmp_path: Path) -> None:
    graftmerge = Path(sys.executable).with_name("graftmerge")
    result = subprocess.run([str(graftmerge), "demo", "--workdir", str(tmp_path)], capture_output=True,
                            text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    for step in ("0.", "1.", "2.", "3.", "4.", "5."):
        assert f"\n{step} " in "\n" + result.stdout, step

    minimal = json.loads((tmp_path / "minimal_model.json").read_text())
    assert (tmp_path / "minimal_model.png").stat().st_size > 0
    assert minimal["eps_donor"] < minimal["eps_post"]
    for method in ("sft", "sft_merge", "graft"):
        start = minimal["curves"][method][0]  # λ = 0 / zero steps: θpost itself
        assert (start["loss_a"], start["loss_b"]) == (
            minimal["post_losses"]["loss_a"],
            minimal["post_losses"]["loss_b"],
        )

    post, grafted = Checkpoint(tmp_path / "post"), Checkpoint(tmp_path / "grafted")
    assert set(post.tensors) == set(grafted.tensors)
    changed = [name for name in post.tensors if not torch.equal(post.read(name), grafted.read(name))]
    assert changed, "the graft changed nothing"
    assert "masked" in result.stdout and "ρ = " in result.stdout
    named = re.findall(re.escape(str(tmp_path)) + r"\S*", result.stdout)  # each path it prints exists after it
    assert str(tmp_path / "minimal_model.png") in named and all(Path(p.rstrip(":")).exists() for p in named), named


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, dict, str]:
    """`python -m experiments.demo --tiny` once (every stage of --lm, tiny), in process: folder, results, stdout."""
    root = tmp_path_factory.mktemp("demo-lm")
    result = run_cli("python -m experiments.demo", "--tiny", "--replay", "own", "--jobs", "0", "--workdir", str(root),
                     env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return root, json.loads((root / "results.json").read_text()), result.stdout


def test_lm_demo_at_tiny_size(tiny_run) -> None:
    """Every stage of `python -m experiments.demo --lm` at a tiny size; consistency, not who wins."""
    root, results, stdout = tiny_run
    assert results["settings"]["replay"] == "own" and "(replay: own)" in stdout
    plots = ("compute.png", "frontier-graft.png", "frontier-SFT-merge-mask.png")
    for plot in plots:
        assert (root / plot).stat().st_size > 0
    assert f"results: {root / 'results.json'}, plots: " + ", ".join(str(root / p) for p in plots) in stdout
    seed = results["seeds"]["0"]
    post = seed["models"]["post"]
    zero = [p for p in seed["points"] if p["lam"] == 0]
    validation = ("old_validation", "new_validation")
    assert zero and all({k: p[k] for k in validation} == {k: post[k] for k in validation} for p in zero)
    assert not any("old_test" in p or "new_test" in p for p in seed["points"])  # selection never sees test
    per_update: dict[tuple, int] = {}
    for p in seed["points"]:  # every update gets the same λ × mask × ρ grid
        key = (p["family"], p["learning_rate"], p["epochs"])
        per_update[key] = per_update.get(key, 0) + 1
    assert set(per_update.values()) == {len(TINY.lambdas) * len(TINY.masks)}
    assert {f for f, _, _ in per_update} == {"sft", "graft@late", "graft@end", "opsd-forward"}
    chosen = results["chosen"]["0.05"]
    assert chosen["SFT + merge + mask"]["configurations"] == chosen["graft@late"]["configurations"] \
        == chosen["OPSD-forward + merge + mask"]["configurations"] == 8
    assert chosen["graft"]["configurations"] == 16  # two donors, the donor chosen on validation too
    for row in chosen.values():  # test scores only for chosen points: exactly those the test job merged again
        for p in row["per_seed"]:
            assert p["name"] == "post" or p["name"] in seed["tested"]
    assert set(seed["tested"]) == {p["name"] for row in chosen.values() for p in row["per_seed"]} - {"post"}
    assert {q["verdict"] for q in results["questions"].values()} == {"too few seeds"}
    assert results["donor_verdict"].startswith("too few seeds") and "cannot rank the methods" in stdout
    gates = results["gates"]["chosen"]  # one replay: one stratum
    assert {name: (row["passed"], row["n"]) for name, row in gates.items()} == {"sensitivity": (False, 1),
                                                                               "interference": (False, 1)}
    assert {"sft", "donor fine-tune", "opsd-forward", "pretraining"} == set(results["compute"])
    assert results["compute"]["opsd-forward"]["sampling_seconds"] > 0
    assert all(0 <= share <= 1 for share in results["top_share"].values())
    manifest = json.loads((root / "seed-0" / "fisher" / "fisher_manifest.json").read_text())
    entries = manifest["entries"]  # estimated by the real CLI, --kind both: KFAC and diagonal for linears
    assert all({"kfac", "diagonal"} <= set(entries[n]) for n in entries if n.endswith("proj.weight"))
    assert manifest["counts"]["sequences"] == 2 * TINY.splits.fisher_prompts
    assert "OPSD go" in stdout and "[donor] graft − SFT + merge + mask" in stdout


def test_graftmerge_eval_scores_the_demo_models_as_the_demo_did(tiny_run, tmp_path: Path) -> None:
    """The demo's models are ordinary HF folders and its tasks a tasks.yml: `graftmerge eval` reproduces its scores."""
    root, results, _ = tiny_run
    seed = root / "seed-0"
    post = results["seeds"]["0"]["models"]["post"]
    for tasks in ("tasks.yml", "diagnostics.yml"):
        out = tmp_path / f"{tasks}.json"
        result = run_cli("graftmerge", "eval", str(seed / "models" / "post"), "--tasks", str(seed / "tasks" / tasks),
                         "--split", "all", "--json", str(out), "--no-progress", env={"HF_HUB_OFFLINE": "1"})
        assert result.returncode == 0, result.stderr[-2000:]
        found = json.loads(out.read_text())
        for split in ("validation", "test"):
            if tasks == "tasks.yml":
                assert found["roles"][split] == {"old": post[f"old_{split}"], "new": post[f"new_{split}"]}
            else:  # the continuous score: a real number, the same up to batching's rounding
                assert found["scores"]["new-facts-nll"][split]["raw"] == pytest.approx(post[f"new_{split}_nll"],
                                                                                      rel=1e-5)
                assert found["scores"]["new-facts-choice"][split]["raw"] == post[f"new_{split}_choice"]


def test_masked_sft_of_the_demo_is_the_brute_force_graft(tiny_run, tmp_path: Path) -> None:
    """The demo's masked-SFT config (donor = θpost) grafts Δ = θsft − θpost with the same mask as a brute force."""
    root, _, _ = tiny_run
    seed = root / "seed-0"
    post, sft, fisher = seed / "models" / "post", seed / "updates" / "sft-lr0.001-e2", seed / "fisher"
    config = graft_config(post, post, sft, 1.0, "kfac", 0.01, fisher)
    got = mergekit_yaml_model(tmp_path, config, "masked-sft")
    brute = brute_force_graft(post, post, [(sft, 1.0)], fisher, 0.01, mask="kfac")
    assert any(mask.any() for mask in brute.masks.values())
    for name, expected in brute.expected.items():
        assert torch.allclose(got[name], expected, atol=1e-6, rtol=0), name
    plain = mergekit_yaml_model(tmp_path, graft_config(post, post, sft, 0.5, None, 0.0, fisher), "sft-merge")
    post_w, sft_w = read_model(post), read_model(sft)
    for name in post_w:  # unmasked: SFT + merge, θpost + λ (θsft − θpost)
        assert torch.allclose(plain[name], post_w[name] + 0.5 * (sft_w[name] - post_w[name]), atol=1e-6), name


def test_results_page_of_a_one_seed_run_says_it_cannot_rank(tiny_run, tmp_path: Path) -> None:
    """The registration-2 page and figure of one seed: no interval anywhere, the verdict "too few seeds"."""
    _, results, _ = tiny_run
    page = lm_results_2.markdown_report(lm_results_2.check_results(results, "results.json"))
    assert "Intervals: none (one seed)" in page and "too few seeds to test" in page
    rows = lm_results_2.questions_table(results)[2:]
    assert rows and all("[" not in row.split("|")[3] for row in rows)  # a difference of one seed: no interval
    assert lm_results_2.results_figure(results, tmp_path / "r.png").stat().st_size > 0


@pytest.mark.parametrize("flag", ["--lm", "--full"])
def test_demo_points_the_moved_experiment_to_experiments(flag: str) -> None:
    line = one_line_error(CliRunner().invoke(main, ["demo", flag]))
    assert line.startswith(f"error: the small-LM experiment ({flag}) is not part of the installed package")
    assert f"`python -m experiments.demo {flag}`" in line


@pytest.mark.parametrize("option", ["--replay", "--jobs"])
def test_demo_has_no_experiment_options(option: str) -> None:
    result = CliRunner().invoke(main, ["demo", option, "2"])
    assert result.exit_code == 2 and f"No such option '{option}'" in result.output


def test_experiment_rejects_unknown_replay() -> None:
    result = CliRunner().invoke(experiment, ["--lm", "--replay", "0.25"])
    assert result.exit_code == 2 and "'0.25' is not one of 'none', 'offpolicy', 'own'" in result.output


def test_chart_labels_are_words_not_keys():
    """compute.png names each training family in words (results.json keeps the keys)."""
    from experiments.demo.lm_report import in_words

    assert in_words("graft@end-rpown") == "donor fine-tune (end donor)\ntask-A replay"
    assert in_words("sft-rpown") == "SFT of θpost\ntask-A replay"
    assert in_words("opsd-reverse-rpnone") == "OPSD (reverse KL)\nno replay"
    assert in_words("graft@late") == "donor fine-tune (late donor)" and in_words("pretraining") == "pretraining"
