"""`sweep --eval` on tiny models with a judge that scores a model from its weights (no tokenizer, no tasks).

The judge: old role = closeness to θpost, new role = how far the model moved along the donor's
update, plus a float64 checksum of every weight; on test the planted opposite of validation. Shared
by test_sweep_eval_bookkeeping.py (the rule, resume, outputs) and test_sweep_log.py (the results log
read back checked, DIR left the user's).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from mergekit.options import MergeOptions
from transformers import AutoModelForCausalLM

from graftmerge.adapter import import_hook
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.pipeline.config_files import read_graft_config
from graftmerge.pipeline.sweep_eval import Evaluation, Judge, run_sweep_eval
from tests.helpers.runners import forget_process_state

LAMBDAS, RHOS = [0.5, 1.0], [0.0, 0.05]
CONFIG = """merge_method: graft
base_model: {post}
models:
  - model: {donor}
    parameters: {{role: donor}}
  - model: {donor_ft}
    parameters: {{role: donor_ft}}
parameters:
  lambda: 1.0
  rho: 0.0
  fisher: {fisher}
dtype: float32
out_dtype: bfloat16
"""


class Stopped(Exception):
    """The judge stops the sweep here (as a kill between two points would)."""


class WeightJudge:
    """Scores from weights: old = exp(−‖θ − θpost‖² / ‖Δ‖²), new = ⟨θ − θpost, Δ⟩ / (2‖Δ‖²) (Δ the donor's
    update), and on test the planted opposite 1 − new; ``fail`` call numbers give NaN, ``stop`` raises."""

    def __init__(self, models: dict[str, Path], fail: tuple[int, ...] = (), stop: int | None = None):
        self.post = _weights(models["post"])
        donor, tuned = _weights(models["donor"]), _weights(models["donor_ft"])
        self.update = {name: tuned[name] - donor[name] for name in self.post}
        self.norm = sum(float(u.square().sum()) for u in self.update.values())
        self.fail, self.stop, self.calls = fail, stop, 0

    def score(self, model, splits) -> dict:
        self.calls += 1
        if self.calls == self.stop:
            raise Stopped
        weights = {name: t.detach().double() for name, t in model.state_dict().items() if name in self.post}
        moved = {name: weights[name] - self.post[name] for name in self.post}
        distance = sum(float(m.square().sum()) for m in moved.values()) / self.norm
        along = sum(float((m * self.update[name]).sum()) for name, m in moved.items()) / (2 * self.norm)
        new = math.nan if self.calls in self.fail else along
        scores = {"keep": {}, "learn": {}, "checksum": {}}
        for split in splits:
            scores["keep"][split] = math.exp(-distance)
            scores["learn"][split] = new if split == "validation" else 1 - new
            scores["checksum"][split] = sum(float(t.sum()) for t in weights.values())
        return scores

    @staticmethod
    def roles(scores: dict, split: str) -> dict:
        return {"old": scores["keep"][split], "new": scores["learn"][split]}


class OldRoleOnly(WeightJudge):
    """Tasks of the old role only: no new-role score to choose by."""

    @staticmethod
    def roles(scores: dict, split: str) -> dict:
        return {"old": scores["keep"][split]}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    checkpoint = Checkpoint(folder)
    return {name: checkpoint.read(name).double() for name in checkpoint.tensors}


def load_eval_model(folder: Path, dtype: torch.dtype = torch.float32):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def sweep(setup: dict, out: Path, *, judge: WeightJudge | None = None, lambdas=LAMBDAS, rhos=RHOS,
          tolerance: float = 0.3, keep: str = "best", fingerprint: str = "tasks-1", settings=None, config=None,
          dtype: torch.dtype = torch.float32):
    """run_sweep_eval in this process, θpost loaded as the evaluation model."""
    import_hook.install()
    forget_process_state()
    judge = judge or WeightJudge(setup["models"])
    loaded, source, plan = read_graft_config(str(config or setup["config"]))
    evaluation = Evaluation((str(setup["tasks"]),), fingerprint, settings or {"dtype": "float32"})

    def make_judge() -> Judge:
        return Judge(lambda: load_eval_model(setup["models"]["post"], dtype), judge.score, judge.roles)

    try:
        return run_sweep_eval(loaded, source, plan, lambdas, rhos, str(out), MergeOptions(quiet=True), evaluation,
                              make_judge, tolerance=tolerance, keep=keep)
    finally:
        forget_process_state()


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def without_seconds(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if k != "seconds"} for line in lines]


def make_setup(root: Path, models: dict[str, Path], fisher: Path) -> dict:
    """The graft config and an (empty) task file of the weight-judged sweeps, in ``root``."""
    config = root / "graft.yml"
    config.write_text(CONFIG.format(**models, fisher=fisher))
    tasks = root / "tasks.yml"
    tasks.write_text("tasks: []  # the judge here reads weights; only the file's identity matters\n")
    return {"root": root, "config": config, "tasks": tasks, "models": models}


def brute_force_choice(lines: list[dict], tolerance: float):
    """The rule, written out: the highest new-role validation score with old ≥ θpost's − τ; smaller λ, then ρ."""
    post = next(line for line in lines if line["kind"] == "post")["roles"]["validation"]
    points = [line for line in lines if line["kind"] == "point" and line["splits"] == ["validation"]
              and "error" not in line]
    eligible = [p for p in points if p["roles"]["validation"]["old"] >= post["old"] - tolerance - 1e-9]
    if not eligible:
        return None
    best = max(eligible, key=lambda p: (p["roles"]["validation"]["new"], -p["lambda"], -p["rho"]))
    return {"lambda": best["lambda"], "rho": best["rho"]}
