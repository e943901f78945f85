"""The small-LM comparison: train donor / post / fine-tunes here, then SFT vs merge vs graft.

Per seed: pretrain a Qwen3 on the broad mixture (→ donor), post-train it on task A
(→ θpost), fine-tune both on the new facts + task-A replay with the same optimizer
(→ SFT = post-ft, and donor-ft), estimate θpost's retention Fisher with the real
``graftmerge fisher estimate --kind both`` from its own rollouts on task-A prompts,
ask ``suggest_graft`` for (λ, ρ), then run every merge in one stock ``mergekit-multi``
process (the same ``run_merge`` as ``mergekit-yaml``) and score every output on old-task
exact match and new-task exact match on held-out phrasings.
"""

from __future__ import annotations

import copy
import json
import random
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure
from tqdm import tqdm

from graftmerge.demo.lm import (
    ModelSize,
    TrainSettings,
    build_model,
    load_model,
    parameter_count,
    save_model,
    score,
    train,
)
from graftmerge.demo.world import World
from graftmerge.pipeline.suggest import suggest_graft


@dataclass(frozen=True)
class LmDemoSettings:
    """Everything that decides a comparison: model and world size, each stage's steps and rate, the grids."""

    size: ModelSize = ModelSize()
    known_entities: int = 48
    new_entities: int = 24
    pretrain_examples: int = 20000
    pretrain_steps: int = 1500
    pretrain_lr: float = 2e-3
    post_steps: int = 200
    post_lr: float = 3e-4
    finetune_steps: int = 400
    finetune_lr: float = 1e-3
    replay: float = 0.25
    seeds: tuple[int, ...] = (0,)
    lambdas: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5)
    mask_lambdas: tuple[float, ...] = (1.0,)  # each masked graft's ρ sweep is run at every one of these
    diagonal_rhos: tuple[float, ...] = (0.001, 0.01, 0.1)
    kfac_rhos: tuple[float, ...] = (0.0001, 0.001, 0.01)
    fisher_prompts: int = 64
    old_test: int = 400


QUICK = LmDemoSettings()
FULL = LmDemoSettings(
    size=ModelSize(hidden_size=192, intermediate_size=512), pretrain_steps=2500, seeds=(0, 1, 2),
    lambdas=(0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0),
    diagonal_rhos=(0.0001, 0.001, 0.003, 0.01, 0.03, 0.1), kfac_rhos=(0.00003, 0.0001, 0.0003, 0.001, 0.003, 0.01),
    mask_lambdas=(1.0, 1.5, 2.0),
)
TINY = LmDemoSettings(  # the test suite's size: every stage, seconds
    size=ModelSize(hidden_size=32, num_hidden_layers=1, intermediate_size=64),
    known_entities=8, new_entities=4, pretrain_examples=500, pretrain_steps=30, post_steps=10,
    finetune_steps=10, lambdas=(0.0, 1.0), diagonal_rhos=(0.01,), kfac_rhos=(0.01,), mask_lambdas=(1.0, 2.0),
    fisher_prompts=8,
    old_test=40,
)

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
SFT_MERGE = """merge_method: task_arithmetic
base_model: {post}
models:
  - model: {post_ft}
    parameters: {{weight: {lam}}}
dtype: float32
out_dtype: float32
"""


def graft_config(paths: dict[str, Path], lam: float, rho: float, mask: str | None) -> str:
    """A graft config of the seed's models at (λ, ρ); ``mask`` None = no Fisher, no mask."""
    fisher = "" if mask is None else f"  fisher: {paths['fisher']}\n  mask: {mask}\n  rho_scope: global\n"
    return GRAFT.format(post=paths["post"], donor=paths["donor"], donor_ft=paths["donor_ft"],
                        lam=lam, rho=rho, fisher=fisher)


@dataclass
class Point:
    """One scored model: which method and (λ, ρ) made it, its accuracies and answer NLLs on both tasks."""

    method: str
    lam: float | None
    rho: float | None
    old: float
    new: float
    old_nll: float
    new_nll: float
    note: str = ""


@dataclass
class SeedRun:
    """Everything one seed produced: its scored points, the suggestions, and how donor-ft scored."""

    seed: int
    parameters: int
    points: list[Point] = field(default_factory=list)
    suggestions: dict[str, dict[str, Any]] = field(default_factory=dict)
    donor_ft: dict[str, float] = field(default_factory=dict)


def _train_stage(model, examples, settings: TrainSettings, label: str, echo: Callable[[str], None]):
    with tqdm(total=settings.steps, desc=label, leave=False, disable=None) as bar:
        losses = train(model, examples, settings, progress=bar)
    echo(f"   {label}: {settings.steps} steps, final loss {losses[-1]:.3f}")
    return model


def _run(command: list[str], what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed ({' '.join(command)}):\n{result.stderr[-3000:]}")


def _script(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


# a model -> its (old, new, old_nll, new_nll) scores
_Evaluate = Callable[[Any], tuple[float, float, float, float]]
# name -> (method, mergekit config text, λ, ρ)
_MergeConfigs = dict[str, tuple[str, str, float | None, float | None]]


def run_seed(settings: LmDemoSettings, seed: int, root: Path, echo: Callable[[str], None]) -> SeedRun:
    """Every stage for one seed; models and merges are written under ``root``."""
    torch.manual_seed(seed)
    world = World(settings.known_entities, settings.new_entities, seed=seed)
    rng = random.Random(seed)
    old_test = world.old_task(settings.old_test, random.Random(10_000 + seed))
    new_test = world.new_task_test()
    paths = {name: root / name for name in ("donor", "post", "post_ft", "donor_ft", "fisher")}

    def evaluate(model) -> tuple[float, float, float, float]:
        """(old, new, old_nll, new_nll) of ``model``: the scores of a :class:`Point`."""
        old, new = score(model, old_test), score(model, new_test)
        return old.accuracy, new.accuracy, old.answer_nll, new.answer_nll

    run = _train_models(settings, world, seed, rng, paths, evaluate, echo)
    _estimate_fisher(settings, world, seed, rng, root, paths, echo)
    configs = _merge_configs(settings, paths, root, run)
    _run_merges(configs, root, run, evaluate, echo)
    return run


def _train_models(settings: LmDemoSettings, world: World, seed: int, rng: random.Random, paths: dict[str, Path],
                  evaluate: _Evaluate, echo: Callable[[str], None]) -> SeedRun:
    """Pretrain the donor, post-train θpost, fine-tune both on the new facts; save all four, score three."""
    donor = build_model(settings.size, world.vocab_size, seed)
    run = SeedRun(seed, parameter_count(donor))
    echo(f"   seed {seed}: Qwen3, {run.parameters / 1e6:.2f}M parameters, vocabulary {world.vocab_size}")
    _train_stage(donor, world.pretraining(settings.pretrain_examples, rng),
                 TrainSettings(settings.pretrain_steps, settings.pretrain_lr, answer_only=False, seed=seed),
                 "pretrain (donor)", echo)
    save_model(donor, paths["donor"])
    post = _train_stage(copy.deepcopy(donor), world.old_task(8000, rng),
                        TrainSettings(settings.post_steps, settings.post_lr, seed=seed), "post-train on task A", echo)
    save_model(post, paths["post"])
    mixture = world.new_task_mixture(settings.replay, rng)
    finetune = TrainSettings(settings.finetune_steps, settings.finetune_lr, seed=seed)
    post_ft = _train_stage(copy.deepcopy(post), mixture, finetune, "SFT of post on new facts", echo)
    save_model(post_ft, paths["post_ft"])
    donor_ft = _train_stage(copy.deepcopy(donor), mixture, finetune, "fine-tune donor on new facts", echo)
    save_model(donor_ft, paths["donor_ft"])
    old, new, old_nll, new_nll = evaluate(donor_ft)
    run.donor_ft = {"old": old, "new": new}
    run.points.append(Point("post", 0.0, None, *evaluate(post)))
    run.points.append(Point("sft", 1.0, None, *evaluate(post_ft)))
    return run


def _estimate_fisher(settings: LmDemoSettings, world: World, seed: int, rng: random.Random, root: Path,
                     paths: dict[str, Path], echo: Callable[[str], None]) -> None:
    """θpost's retention Fisher (diagonal and KFAC) by the real CLI, from its own rollouts on task-A prompts."""
    prompts = root / "old_task_prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": ids}) + "\n"
                               for ids in world.old_task_prompts(settings.fisher_prompts, rng)))
    echo(f"   graftmerge fisher estimate --kind both: {settings.fisher_prompts} task-A prompts × 2 own rollouts")
    _run([_script("graftmerge"), "fisher", "estimate", str(paths["post"]), "-o", str(paths["fisher"]),
          "--kind", "both", "--prompts", str(prompts), "--samples-per-prompt", "2", "--max-new-tokens", "16",
          "--seed", str(seed), "--no-progress"], "fisher estimate")


def _merge_configs(settings: LmDemoSettings, paths: dict[str, Path], root: Path, run: SeedRun) -> _MergeConfigs:
    """Every merge of the sweep, plus each mask's suggested point (recorded in ``run.suggestions``)."""
    configs: _MergeConfigs = {}
    for lam in settings.lambdas:
        configs[f"sft_merge-l{lam:g}"] = ("sft+merge", SFT_MERGE.format(post=paths["post"], post_ft=paths["post_ft"],
                                                                        lam=lam), lam, None)
        configs[f"graft-l{lam:g}"] = ("graft", graft_config(paths, lam, 0, None), lam, 0.0)
    for mask, rhos in (("diagonal", settings.diagonal_rhos), ("kfac", settings.kfac_rhos)):
        for lam in settings.mask_lambdas:
            for rho in rhos:
                configs[f"graft_{mask}-r{rho:g}-l{lam:g}"] = (f"graft+{mask}", graft_config(paths, lam, rho, mask),
                                                             lam, rho)
        probe = root / f"suggest-{mask}.yml"
        probe.write_text(graft_config(paths, 1.0, 0.01, mask))
        suggestion = suggest_graft(str(probe), progress=False)
        run.suggestions[mask] = {"lam": suggestion.lam, "rho": suggestion.rho, "reason": suggestion.rho_reason,
                                 "predicted_kl": suggestion.predicted_kl}
        configs[f"suggested_{mask}"] = (f"suggest {mask}", graft_config(paths, suggestion.lam, suggestion.rho, mask),
                                        suggestion.lam, suggestion.rho)
    return configs


def _run_merges(configs: _MergeConfigs, root: Path, run: SeedRun, evaluate: _Evaluate,
                echo: Callable[[str], None]) -> None:
    """All merges in one stock ``mergekit-multi`` process, then every output scored into ``run.points``."""
    echo(f"   mergekit-multi: {len(configs)} merges (task_arithmetic and graft)")
    documents = [f"name: {name}\n{text}" for name, (_, text, _, _) in configs.items()]
    (root / "merges.yml").write_text("---\n".join(documents))
    _run([_script("mergekit-multi"), str(root / "merges.yml"), "--intermediate-dir", str(root / "merges")],
         "mergekit-multi")
    for name, (method, _, lam, rho) in configs.items():
        run.points.append(Point(method, lam, rho, *evaluate(load_model(root / "merges" / name))))


def check_lambda_zero(run: SeedRun) -> None:
    """λ = 0 merges are θpost bit for bit, so they must score exactly as θpost."""
    post = next(p for p in run.points if p.method == "post")
    for point in run.points:
        if point.lam == 0 and point.method in ("graft", "sft+merge"):
            got = (point.old, point.new, point.old_nll, point.new_nll)
            if got != (post.old, post.new, post.old_nll, post.new_nll):
                raise AssertionError(f"{point.method} at λ = 0 scores {got}, θpost scores differently")


def aggregate(runs: list[SeedRun]) -> list[dict[str, Any]]:
    """Mean and spread (population sd) over seeds of every (method, λ, ρ) point."""
    groups: dict[tuple, list[Point]] = {}
    for run in runs:
        for point in run.points:
            key = (point.method, point.lam, point.rho) if not point.method.startswith("suggest") else (point.method,)
            groups.setdefault(key, []).append(point)
    rows = []
    for points in groups.values():
        row: dict[str, Any] = {"method": points[0].method, "lam": points[0].lam, "rho": points[0].rho,
                               "seeds": len(points)}
        for metric in ("old", "new", "old_nll", "new_nll"):
            values = [getattr(p, metric) for p in points]
            row[metric] = statistics.fmean(values)
            row[f"{metric}_sd"] = statistics.pstdev(values) if len(values) > 1 else 0.0
        if points[0].method.startswith("suggest"):
            row["lam"] = statistics.fmean(p.lam for p in points)
            row["rho"] = statistics.fmean(p.rho for p in points)
        rows.append(row)
    return rows


def pareto(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows not dominated on (old, new) accuracy, by increasing new-task accuracy."""
    keep = [r for r in rows if not any(o["old"] >= r["old"] and o["new"] >= r["new"] and
                                       (o["old"], o["new"]) != (r["old"], r["new"]) for o in rows)]
    return sorted(keep, key=lambda r: r["new"])


def best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The sweep's best point by the mean of old and new accuracy (one number, said in the table)."""
    return max(rows, key=lambda r: (r["old"] + r["new"]) / 2)


def suggestion_vs_sweep(rows: list[dict[str, Any]], runs: list[SeedRun]) -> dict[str, dict[str, float]]:
    """Where each mask's suggested point lands against the best point of that mask's ρ sweep.

    Also sets the suggestion's predicted old-task KL (its quadratic model, mean over seeds)
    beside the measured increase of θpost's old-task answer NLL per token, a proxy for
    that KL when θpost answers task A (nearly) deterministically.
    """
    post = next(r for r in rows if r["method"] == "post")
    landings = {}
    for mask in ("diagonal", "kfac"):
        suggested = next(r for r in rows if r["method"] == f"suggest {mask}")
        top = best([r for r in rows if r["method"] == f"graft+{mask}"])
        landings[mask] = {
            "suggested": (suggested["old"] + suggested["new"]) / 2,
            "best": (top["old"] + top["new"]) / 2,
            "best_rho": top["rho"],
            "predicted_kl": statistics.fmean(run.suggestions[mask]["predicted_kl"] for run in runs),
            "measured_nll_increase": suggested["old_nll"] - post["old_nll"],
        }
    return landings


def format_table(rows: list[dict[str, Any]]) -> str:
    """The aggregated rows as an aligned text table; ± the spread over seeds when there are several."""
    lines = [f"   {'method':18s} {'λ':>6s} {'ρ':>8s}  {'old task A':>14s}  {'new (held-out)':>14s}"]
    for r in rows:
        lam = "" if r["lam"] is None else f"{r['lam']:.3g}"
        rho = "" if r["rho"] is None else f"{r['rho']:.3g}"
        spread = r["seeds"] > 1
        old = f"{r['old']:.3f}" + (f"±{r['old_sd']:.3f}" if spread else "")
        new = f"{r['new']:.3f}" + (f"±{r['new_sd']:.3f}" if spread else "")
        lines.append(f"   {r['method']:18s} {lam:>6s} {rho:>8s}  {old:>14s}  {new:>14s}")
    return "\n".join(lines)


# θpost and SFT drawn on top (the merges at λ = 0 and 1 sit on them); a suggestion in its mask's colour
PLOT_STYLES: dict[str, dict[str, Any]] = {
    "post": {"marker": "*", "s": 160, "color": "black", "zorder": 3},
    "sft": {"marker": "X", "s": 90, "color": "tab:orange", "zorder": 3},
    "sft+merge": {"s": 25, "color": "tab:blue"},
    "graft": {"s": 25, "color": "tab:red"},
    "graft+diagonal": {"s": 25, "color": "tab:green"},
    "suggest diagonal": {"marker": "D", "s": 60, "color": "tab:green", "edgecolors": "black", "zorder": 3},
    "graft+kfac": {"s": 25, "color": "tab:purple"},
    "suggest kfac": {"marker": "D", "s": 60, "color": "tab:purple", "edgecolors": "black", "zorder": 3},
}


def plot(rows: list[dict[str, Any]], path: Path, replay: float) -> Path:
    """A PNG of old- vs new-task accuracy, every method's points and its Pareto frontier.

    Drawn on a bare :class:`~matplotlib.figure.Figure` (no pyplot): no GUI backend is
    chosen or needed, and no global pyplot state is touched.
    """
    figure = Figure(figsize=(7, 5))
    axes = figure.subplots()
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for method in methods:
        points = [r for r in rows if r["method"] == method]
        style = PLOT_STYLES.get(method, {"s": 25})
        axes.scatter([p["new"] for p in points], [p["old"] for p in points], label=method, **style)
        front = pareto(points)
        if len(front) > 1:  # the frontier in its method's colour
            axes.plot([p["new"] for p in front], [p["old"] for p in front], alpha=0.6, color=style.get("color"))
    axes.set_xlabel("new task: exact match on held-out phrasings")
    axes.set_ylabel("old task A: exact match")
    axes.set_title(f"graftmerge demo: new vs old task, task-A replay {replay:g} (per-method Pareto frontiers)",
                   fontsize=10)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def run_lm_demo(settings: LmDemoSettings, root: Path, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """All seeds; writes results.json and pareto.png under ``root``; returns the results."""
    runs = []
    for seed in settings.seeds:
        run = run_seed(settings, seed, root / f"seed-{seed}", echo)
        check_lambda_zero(run)
        runs.append(run)
    rows = aggregate(runs)
    sweep = [r for r in rows if r["method"] in ("graft", "graft+diagonal", "graft+kfac")]
    results = {
        "settings": asdict(settings),
        "rows": rows,
        "best_graft": best(sweep),
        "best_sft_merge": best([r for r in rows if r["method"] == "sft+merge"]),
        "suggestion_vs_sweep": suggestion_vs_sweep(rows, runs),
        "suggestions": [run.suggestions for run in runs],
        "donor_ft": [run.donor_ft for run in runs],
        "parameters": runs[0].parameters,
        "lambda0_equals_post": True,  # check_lambda_zero raised otherwise
    }
    (root / "results.json").write_text(json.dumps(results, indent=1))
    plot(rows, root / "pareto.png", settings.replay)
    return results

