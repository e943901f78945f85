"""`graftmerge demo` as the README runs it: the console script, every artefact written and consistent.

The README's `graftmerge demo` runs as a real process; `--lm --tiny` runs the same click
command in this process (conftest.run_cli), its own merges and estimates in subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import one_line_error, run_cli

from graftmerge.cli import main
from graftmerge.formats.checkpoint import Checkpoint

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
        assert (start["loss_a"], start["loss_b"]) == (minimal["post_losses"]["loss_a"], minimal["post_losses"]["loss_b"])

    post, grafted = Checkpoint(tmp_path / "post"), Checkpoint(tmp_path / "grafted")
    assert set(post.tensors) == set(grafted.tensors)
    changed = [name for name in post.tensors if not torch.equal(post.read(name), grafted.read(name))]
    assert changed, "the graft changed nothing"
    assert "masked" in result.stdout and "ρ = " in result.stdout


def test_lm_demo_at_tiny_size(tmp_path: Path) -> None:
    """Every stage of `graftmerge demo --lm` at a tiny size; consistency, not who wins."""
    result = run_cli("graftmerge", "demo", "--tiny", "--replay", "0.5", "--workdir", str(tmp_path),
                     env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["settings"]["replay"] == 0.5 and "task-A replay 0.5 per new example" in result.stdout
    assert (tmp_path / "pareto.png").stat().st_size > 0
    assert f"results: {tmp_path / 'results.json'}, plot: {tmp_path / 'pareto.png'}" in result.stdout
    rows = {(r["method"], r["lam"], r["rho"]): r for r in results["rows"]}
    post = rows["post", 0.0, None]
    for key in (("graft", 0.0, 0.0), ("sft+merge", 0.0, None)):  # λ = 0 is θpost: the same scores exactly
        assert {m: rows[key][m] for m in ("old", "new", "old_nll", "new_nll")} == \
            {m: post[m] for m in ("old", "new", "old_nll", "new_nll")}
    # task_arithmetic at weight 1 is the SFT model itself, up to float rounding of post + (ft − post)
    assert abs(rows["sft+merge", 1.0, None]["new_nll"] - rows["sft", 1.0, None]["new_nll"]) < 1e-4
    methods = {r["method"] for r in results["rows"]}
    assert {"graft+diagonal", "graft+kfac", "suggest diagonal", "suggest kfac"} <= methods
    seed = tmp_path / "seed-0"
    manifest = json.loads((seed / "fisher" / "fisher_manifest.json").read_text())
    entries = manifest["entries"]  # estimated by the real CLI, --kind both: KFAC and diagonal for linears
    assert all({"kfac", "diagonal"} <= set(entries[n]) for n in entries if n.endswith("proj.weight"))
    assert manifest["counts"]["sequences"] == 2 * 8  # 8 task-A prompts × 2 own rollouts
    assert len(list((seed / "merges").iterdir())) == len(results["rows"]) - 2  # every merge but post / sft
    assert "best graft" in result.stdout
    for mask in ("diagonal", "kfac"):  # the suggestion set against the best point of its own ρ sweep
        landing = results["suggestion_vs_sweep"][mask]
        suggested = next(r for r in results["rows"] if r["method"] == f"suggest {mask}")
        assert landing["suggested"] == (suggested["old"] + suggested["new"]) / 2
        assert landing["best"] == max((r["old"] + r["new"]) / 2 for r in results["rows"] if r["method"] == f"graft+{mask}")
        assert landing["measured_nll_increase"] == suggested["old_nll"] - post["old_nll"]
        assert landing["predicted_kl"] == results["suggestions"][0][mask]["predicted_kl"]  # one seed
        assert f"suggest {mask} vs the best of its own ρ sweep" in result.stdout


@pytest.mark.parametrize(("arguments", "expected"), [
    (["--replay", "0.5"], "--replay applies to the small-LM comparison: add --lm or --full"),
    (["--lm", "--replay", "-1"], "--replay -1: expected task-A replay examples per new-fact example in [0, 10]"),
    (["--full", "--replay", "nan"], "--replay nan: expected"),
])
def test_demo_rejects_bad_replay(arguments: list[str], expected: str) -> None:
    line = one_line_error(CliRunner().invoke(main, ["demo", *arguments]))
    assert line.startswith(f"error: {expected}")
