"""The LM demo's experiment, end to end: schedule every seed's jobs, then select, compare and report.

Per seed: pretraining + post-training (one job), then θpost's Fisher and every update run
of the grid (SFT, each donor's fine-tune, OPSD when its teacher passes the go/no-go
check) as parallel jobs, then the merges and their scores in ``jobs`` parallel parts
(points put back in one canonical order) beside one job for the update statistics. Jobs run in ``jobs`` spawned
worker processes of one torch thread each (``jobs = 0``: in this process, one after the
other), so results depend on the seed only. Progress bars count training steps and
scored merges. ``results.json`` and the plots are written under the work folder.
"""

from __future__ import annotations

import json
import multiprocessing
import queue as queue_module
import resource
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from experiments.demo.lm_evaluate import canonical_order, describe_seed, fisher_job, merge_part, score_chosen_on_test
from experiments.demo.lm_plots import plot_frontiers_of_first_seed
from experiments.demo.lm_report import plot_compute
from experiments.demo.lm_settings import FULL, QUICK, TINY, LmDemoSettings, Update, grid, updates
from experiments.demo.lm_training import (
    one_thread,
    pretrain_and_post_train,
    train_update,
    update_steps,
)
from experiments.demo.lm_verdict import summarize

__all__ = ["FULL", "QUICK", "TINY", "clear_previous_run", "run_lm_demo"]


class Reporter:
    """A picklable progress callback: puts (bar, count) on a queue the main process reads."""

    def __init__(self, queue, bar: str):
        self.queue, self.bar = queue, bar

    def __call__(self, count: int) -> None:
        """Count ``count`` more units on this reporter's bar."""
        self.queue.put((self.bar, count))


class InlineExecutor:
    """``submit`` runs the call now, in this process: the ``jobs = 0`` stand-in for a process pool."""

    def submit(self, function: Callable, *arguments) -> Future:
        """Run ``function(*arguments)`` and return a finished future."""
        future: Future = Future()
        future.set_result(function(*arguments))
        return future


def _drain(queue, bars: dict[str, tqdm], stop: threading.Event) -> None:
    while not stop.is_set() or not queue.empty():
        try:
            bar, count = queue.get(timeout=0.2)
        except queue_module.Empty:
            continue
        bars[bar].update(count)


class Seeds:
    """What each seed has produced so far, and how many of its jobs each next stage still waits for."""

    def __init__(self, settings: LmDemoSettings, root: Path):
        self.settings, self.root = settings, root
        self.base: dict[int, dict] = {}
        self.trained: dict[int, list[Update]] = {}
        self.training: dict[int, list[dict]] = {}
        self.waiting: dict[int, int] = {}
        self.parts: dict[int, dict[int, list]] = {}
        self.evaluated: dict[int, dict] = {}

    def folder(self, seed: int) -> Path:
        """Where one seed's models, updates, Fisher and merges go."""
        return self.root / f"seed-{seed}"

    def after_base(self, seed: int, summary: dict, echo: Callable[[str], None]) -> list[Update]:
        """Record the base job; the go/no-go check decides whether OPSD's runs are scheduled."""
        self.base[seed] = summary
        teacher = summary["teacher_new_train"]
        go = teacher >= self.settings.teacher_threshold
        summary["opsd_go"] = go
        echo(f"   seed {seed}: Qwen3 {summary['parameters'] / 1e6:.2f}M parameters; teacher (θpost, fact in context) "
             f"{teacher:.3f} on the new facts: OPSD {'go' if go else 'NO-GO, arm stopped'}")
        self.trained[seed] = [u for u in updates(self.settings) if go or u.method != "opsd"]
        self.training[seed], self.waiting[seed] = [], len(self.trained[seed]) + 1  # + the Fisher
        return self.trained[seed]

    def finish(self, seed: int, parts: int) -> dict:
        """The seed's evaluation: every part's points in one canonical order, with its description."""
        points = [p for part in range(parts) for p in self.parts[seed][part]]
        self.evaluated[seed] = {"seed": seed, "points": canonical_order(points), **self.parts[seed][-1]}
        return self.evaluated[seed]


def _evaluation_jobs(executor, seeds: Seeds, seed: int, parts: int, merged: Reporter) -> dict[Future, tuple]:
    """The seed's merge parts (in parallel) and its description job, once its updates and Fisher exist."""
    settings, folder, trained = seeds.settings, seeds.folder(seed), seeds.trained[seed]
    seeds.parts[seed], seeds.waiting[seed] = {}, parts + 1
    jobs = {executor.submit(merge_part, settings, seed, folder, trained, part, parts, merged): ("part", seed, part)
            for part in range(parts)}
    jobs[executor.submit(describe_seed, settings, seed, folder, trained)] = ("part", seed, -1)
    return jobs


def _schedule(settings: LmDemoSettings, root: Path, executor, queue, echo: Callable[[str], None],
              parts: int) -> Seeds:
    """Run every job of every seed, each as soon as what it needs is done."""
    seeds = Seeds(settings, root)
    train, merged = Reporter(queue, "train"), Reporter(queue, "merge")
    running = {executor.submit(pretrain_and_post_train, settings, s, seeds.folder(s), train): ("base", s, None)
               for s in settings.seeds}
    while running:
        done, _ = wait(list(running), return_when=FIRST_COMPLETED)
        for future in done:
            kind, seed, detail = running.pop(future)
            result = future.result()
            if kind == "base":
                running[executor.submit(fisher_job, settings, seed, seeds.folder(seed))] = ("trained", seed, None)
                for run in seeds.after_base(seed, result, echo):
                    running[executor.submit(train_update, settings, seed, seeds.folder(seed), run, train)] = \
                        ("trained", seed, run)
            elif kind == "trained":
                if detail is not None:
                    seeds.training[seed].append(result)
                seeds.waiting[seed] -= 1
                if seeds.waiting[seed] == 0:
                    running.update(_evaluation_jobs(executor, seeds, seed, parts, merged))
            elif kind == "part":
                seeds.parts[seed][detail] = result
                seeds.waiting[seed] -= 1
                if seeds.waiting[seed] == 0:
                    finished = seeds.finish(seed, parts)
                    echo(f"   seed {seed}: {len(finished['points'])} merges scored on validation")
                    running[executor.submit(score_chosen_on_test, settings, seed, seeds.folder(seed),
                                            seeds.trained[seed], finished)] = ("tested", seed, None)
            else:
                seeds.evaluated[seed]["tested"] = result
                echo(f"   seed {seed}: {len(result)} chosen points merged again and scored on test")
    return seeds


def clear_previous_run(root: Path) -> None:
    """Remove what an earlier run of the demo left in ``root`` (its seed folders, results and plots) only."""
    for seed in root.glob("seed-*"):
        if (seed / "models").is_dir():
            shutil.rmtree(seed)
    for name in ("raw.json", "results.json", "results.png", "compute.png"):
        (root / name).unlink(missing_ok=True)
    for plot in root.glob("frontier-*.png"):
        plot.unlink()


def _totals(settings: LmDemoSettings) -> tuple[int, int]:
    """Training steps and merges of the whole run (OPSD's counted even if its check stops it)."""
    runs = updates(settings)
    steps = sum(settings.pretrain_steps + settings.post_steps + len(runs) * update_steps(settings, s)
                for s in settings.seeds)
    return steps, len(settings.seeds) * len(runs) * len(settings.epochs) * len(grid(settings))


def resources(started: float) -> dict[str, float]:
    """Wall seconds since ``started``, CPU seconds of this process and its finished children, peak RSS (MB).

    The peak is the largest single process (this one or one child), not a sum.
    """
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall_seconds": time.perf_counter() - started,
            "cpu_seconds": own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime,
            "peak_rss_mb": max(own.ru_maxrss, children.ru_maxrss) / 1024}


def run_lm_demo(settings: LmDemoSettings, root: Path, echo: Callable[[str], None] = print,
                jobs: int = 2) -> dict[str, Any]:
    """The whole experiment under ``root``; writes results.json and the plots; returns the results."""
    started = time.perf_counter()
    steps, merges = _totals(settings)
    echo(f"   {len(settings.seeds)} seed(s), {len(updates(settings))} update runs × {len(settings.epochs)} snapshots "
         f"× {len(grid(settings))} (λ, mask, ρ) per seed: {merges} merges; {jobs or 'no'} worker processes")
    manager = multiprocessing.get_context("spawn").Manager() if jobs else None
    queue = manager.Queue() if manager is not None else queue_module.Queue()
    bars = {"train": tqdm(total=steps, desc="training steps", unit="step", disable=None),
            "merge": tqdm(total=merges, desc="merges scored", unit="merge", disable=None)}
    stop = threading.Event()
    reader = threading.Thread(target=_drain, args=(queue, bars, stop), daemon=True)
    reader.start()
    try:
        if jobs:
            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(jobs, mp_context=context, initializer=one_thread) as pool:
                seeds = _schedule(settings, root, pool, queue, echo, parts=jobs)
        else:
            seeds = _schedule(settings, root, InlineExecutor(), queue, echo, parts=1)
    finally:
        stop.set()
        reader.join()
        for bar in bars.values():
            bar.close()
        if manager is not None:
            manager.shutdown()
    raw = {"base": seeds.base, "training": seeds.training, "evaluated": seeds.evaluated}
    (root / "raw.json").write_text(json.dumps(raw, indent=1))  # kept even if the analysis below fails
    results = summarize(settings, seeds.base, seeds.training, seeds.evaluated)
    results["settings"] = asdict(settings)
    results["resources"] = resources(started)
    (root / "results.json").write_text(json.dumps(results, indent=1))
    plots = [plot_compute(results, root / "compute.png"), *plot_frontiers_of_first_seed(results, root)]
    results["plots"] = [str(p) for p in plots]
    return results
