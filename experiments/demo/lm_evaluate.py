"""The LM demo's evaluation job: θpost's Fisher, every merge through the real tool, every score.

Per seed: ``graftmerge fisher estimate --kind both`` on θpost's own rollouts of the
Fisher-prompt split; one graft config per (update snapshot, λ, mask, ρ), run in stock
``mergekit-multi`` processes (the merges split into parts that run in parallel). SFT's and
OPSD's updates are grafts whose donor is θpost itself (Δ = θft − θpost: SFT + merge, masked
by the same code and the same Fisher); a donor fine-tune's is θft − θdonor. Every output is
scored on the validation splits by :class:`graftmerge.evaluation.Evaluator` from the seed's
tasks.yml (:mod:`experiments.demo.lm_tasks`), as ``graftmerge sweep --eval`` scores a grid
point; only the points a method chooses are merged again and scored on test (and on the
diagnostics: answer NLL, 8-way choice) by :func:`test_chosen`. ``graftmerge delta`` gives
each update's norm and the share of F·Δ² on the top 1% Fisher coordinates (Fig. 8 right).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.demo.lm import load_model, score
from experiments.demo.lm_settings import DONORS, LmDemoSettings, Update, grid, replay_of
from experiments.demo.lm_tasks import DIAGNOSTICS, TASKS, world_tokenizer
from experiments.demo.lm_training import one_thread, seed_world
from experiments.demo.lm_verdict import chosen_names
from experiments.demo.world import Splits
from graftmerge.evaluation import Evaluator, load_tasks, role_scores
from graftmerge.pipeline.delta_extract import extract_delta
from graftmerge.pipeline.delta_report import compute_stats

GRAFT = """merge_method: graft
base_model: {post}
models:
  - model: {donor}
    parameters: {{role: donor}}
  - model: {donor_ft}
    parameters: {{role: donor_ft}}
parameters:
  lambda: {lam}
  rho: {rho}
{fisher}dtype: float32
out_dtype: float32
"""
SCORED_SETS = ("old_validation", "old_test", "new_validation", "new_test")
EVALUATION_BATCH = 256


def graft_config(post: Path, donor: Path, donor_ft: Path, lam: float, mask: str | None, rho: float,
                 fisher: Path) -> str:
    """A graft config; ``donor`` = ``post`` makes it SFT + merge of θft − θpost (masked when ρ > 0)."""
    lines = "" if mask is None or rho == 0 else f"  fisher: {fisher}\n  mask: {mask}\n  rho_scope: global\n"
    return GRAFT.format(post=post, donor=donor, donor_ft=donor_ft, lam=lam, rho=rho if lines else 0, fisher=lines)


def run_tool(command: list[str], what: str) -> None:
    """A console script of this environment, one thread (deterministic), output kept for errors only."""
    tool = str(Path(sys.executable).with_name(command[0]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([tool, *command[1:]], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed ({' '.join(command)}):\n{result.stderr[-3000:]}")


def start_folder(root: Path, update: Update) -> Path:
    """The model an update was trained from (its donor in the graft config)."""
    return root / "models" / ("post" if update.start == "post" else f"donor-{update.start}")


def estimate_fisher(settings: LmDemoSettings, seed: int, root: Path, splits: Splits) -> Path:
    """θpost's retention Fisher (diagonal and KFAC) by the real CLI, from its rollouts on the Fisher prompts."""
    prompts = root / "fisher_prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": ids}) + "\n" for ids in splits.fisher_prompts))
    run_tool(["graftmerge", "fisher", "estimate", str(root / "models" / "post"), "-o", str(root / "fisher"),
              "--kind", "both", "--prompts", str(prompts), "--samples-per-prompt", str(settings.fisher_samples),
              "--max-new-tokens", "12", "--seed", str(seed), "--no-progress"], "fisher estimate")
    return root / "fisher"


def merge_points(settings: LmDemoSettings, root: Path, trained: list[Update]) -> dict[str, dict[str, Any]]:
    """Every merge of the seed: name → its description (family, rate, epochs, λ, mask, ρ) and config text."""
    merges = {}
    for update in trained:
        for epochs in settings.epochs:
            snapshot = update.snapshot(epochs)
            for lam, mask, rho in grid(settings):
                name = f"{snapshot}-l{lam:g}-{mask or 'none'}-r{rho:g}"
                config = graft_config(root / "models" / "post", start_folder(root, update),
                                      root / "updates" / snapshot, lam, mask, rho, root / "fisher")
                merges[name] = {"name": name, "family": update.family, "replay": replay_of(settings, update),
                                "learning_rate": update.learning_rate, "epochs": epochs,
                                "lam": lam, "mask": mask if rho else None, "rho": rho, "config": config}
    return merges


class Judge:
    """The seed's two Evaluators, built once: tasks.yml (what selection sees) and diagnostics.yml (reported only)."""

    def __init__(self, settings: LmDemoSettings, seed: int, root: Path):
        world, _ = seed_world(settings, seed)
        tokenizer = world_tokenizer(world)
        self.tasks = Evaluator(load_tasks(root / "tasks" / TASKS), tokenizer, batch_size=EVALUATION_BATCH,
                               progress=False)
        self.diagnostics = Evaluator(load_tasks(root / "tasks" / DIAGNOSTICS), tokenizer,
                                     batch_size=EVALUATION_BATCH, progress=False)

    def scores(self, model, splits: tuple[str, ...] = ("validation",), diagnostics: bool = False) -> dict[str, float]:
        """Normalised role scores ("old_validation", "new_test", ...) and, with ``diagnostics``, the new facts'
        answer NLL and 8-way choice accuracy ("new_test_nll", "new_test_choice")."""
        raw = self.tasks.score(model, splits)
        result = {}
        for split in splits:
            roles = role_scores(self.tasks.suite, raw, split)
            result.update({f"old_{split}": roles["old"], f"new_{split}": roles["new"]})
            if diagnostics:
                extra = self.diagnostics.score(model, (split,))
                result[f"new_{split}_nll"] = extra["new-facts-nll"][split]
                result[f"new_{split}_choice"] = extra["new-facts-choice"][split]
        return result


def scores(model, judge: Judge) -> dict[str, float]:
    """Every score of ``model``: both roles on validation and test, and the diagnostics."""
    return judge.scores(model, ("validation", "test"), diagnostics=True)


def merge_part(settings: LmDemoSettings, seed: int, root: Path, trained: list[Update], part: int, parts: int,
               progress: Callable[[int], None] | None) -> list[dict[str, Any]]:
    """Part ``part`` of ``parts`` of the seed's merges in one ``mergekit-multi`` process, each output scored
    (and deleted: its config in merges-<part>.yml rebuilds it). Needs θpost's Fisher and every update."""
    one_thread()
    judge = Judge(settings, seed, root)
    merges = merge_points(settings, root, trained)
    names = list(merges)[part::parts]
    return [{**description, **judge.scores(model)}
            for description, model in _merged(root, merges, names, f"merges-{part}", progress)]


def _merged(root: Path, merges: dict[str, dict], names: list[str], label: str, progress=None):
    """(description, loaded model) of each merge in ``names``, made by one ``mergekit-multi`` run; each
    output folder is deleted once its model is yielded back (its config in ``label``.yml rebuilds it)."""
    documents = [f"name: {name}\n{merges[name]['config']}" for name in names]
    if not documents:
        return
    (root / f"{label}.yml").write_text("---\n".join(documents))
    run_tool(["mergekit-multi", str(root / f"{label}.yml"), "--intermediate-dir", str(root / label)],
             "mergekit-multi")
    for name in names:
        folder = root / label / name
        yield {k: v for k, v in merges[name].items() if k != "config"}, load_model(folder)
        for file in folder.iterdir():
            file.unlink()
        folder.rmdir()
        if progress is not None:
            progress(1)


def score_chosen_on_test(settings: LmDemoSettings, seed: int, root: Path, trained: list[Update],
                evaluated: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Merge again every point some method chose on validation, and score it on test and the diagnostics.

    Its validation scores must come out as recorded (the merges and the Evaluator are deterministic).
    """
    one_thread()
    judge = Judge(settings, seed, root)
    recorded = {p["name"]: p for p in evaluated["points"]}
    names = chosen_names(settings, evaluated["points"], evaluated["models"]["post"])
    tested = {}
    for description, model in _merged(root, merge_points(settings, root, trained), names, "merges-chosen"):
        found = scores(model, judge)
        for key in ("old_validation", "new_validation"):
            if found[key] != recorded[description["name"]][key]:
                raise RuntimeError(f"{description['name']}: {key} {found[key]} on the second merge, "
                                   f"{recorded[description['name']][key]} on the first")
        tested[description["name"]] = found
    return tested


def fisher_job(settings: LmDemoSettings, seed: int, root: Path) -> str:
    """θpost's Fisher, as a job of its own (it needs θpost only, so it runs beside the update runs)."""
    one_thread()
    _, splits = seed_world(settings, seed)
    return str(estimate_fisher(settings, seed, root, splits))


def update_statistics(settings: LmDemoSettings, root: Path, fisher: Path,
                      trained: list[Update]) -> dict[str, dict[str, float]]:
    """Per update snapshot: ‖Δ‖ and the share of F·Δ² on θpost's top-1% Fisher coordinates (`delta stats`).

    Also each donor's distance to θpost, ‖θpost − θdonor‖ (under the key ``post-from-<donor>``).
    """
    pairs = {update.snapshot(e): (start_folder(root, update), root / "updates" / update.snapshot(e))
             for update in trained for e in settings.epochs}
    pairs.update({f"post-from-{d}": (root / "models" / f"donor-{d}", root / "models" / "post")
                  for d in DONORS if (root / "models" / f"donor-{d}").is_dir()})
    result = {}
    for name, (donor, fine_tune) in pairs.items():
        delta = root / "deltas" / name
        if not delta.exists():
            extract_delta(donor, fine_tune, delta, progress=False)
        total = compute_stats(delta, fisher, top=settings.stats_top, progress=False).total()
        result[name] = {"norm": total.l2, "top_share": total.global_top_share}
    return result


def model_scores(root: Path, splits: Splits, judge: Judge) -> dict[str, dict[str, float]]:
    """θpost, every donor, and the teacher (θpost with the new fact's article in context)."""
    result = {}
    for name in ("post", *(f"donor-{d}" for d in DONORS)):
        if (root / "models" / name).is_dir():
            result[name] = scores(load_model(root / "models" / name), judge)
    post = load_model(root / "models" / "post")
    result["teacher"] = {name: score(post, [e.in_context() for e in getattr(splits, name)]).accuracy
                         for name in ("new_validation", "new_test")}
    result["teacher"]["new_train"] = score(post, [e.in_context() for e in splits.new_train]).accuracy
    return result


def describe_seed(settings: LmDemoSettings, seed: int, root: Path, trained: list[Update]) -> dict[str, Any]:
    """θpost's, the donors' and the teacher's scores, and every update's statistics."""
    one_thread()
    _, splits = seed_world(settings, seed)
    return {"models": model_scores(root, splits, Judge(settings, seed, root)),
            "updates": update_statistics(settings, root, root / "fisher", trained)}


def canonical_order(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Points in one fixed order (family, rate, epochs, λ, mask, ρ), whatever parts they were merged in."""
    return sorted(points, key=lambda p: (p["family"], p.get("replay") or "", p["learning_rate"], p["epochs"],
                                         p["lam"], p["mask"] or "", p["rho"]))
