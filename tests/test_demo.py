"""`graftmerge demo` as the README runs it: the console script, every artefact written and consistent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from graftmerge.checkpoint import Checkpoint


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
