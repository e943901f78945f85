"""``python -m experiments.demo``: train a small LM and compare SFT, OPSD and grafts.

It trains its own Qwen3 (warmup-stable-decay pretraining with donors saved on the way,
post-training that creates an old task A), learns new facts by SFT of θpost, by fine-tuning
donors and by on-policy self-distillation, merges every update at the same λ × mask × ρ grid
through mergekit (masked SFT = a graft whose donor is θpost), picks every method's point on
validation by the rule of `graftmerge sweep --eval` and reports test scores.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import click
import transformers

from experiments.demo import lm_pipeline
from experiments.demo.lm_verdict import format_report
from graftmerge.cli import report_errors


@click.command("experiments.demo")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the models, results and plots here [default: demo-out/lm or demo-out/lm-full].")
@click.option("--lm", "size", flag_value="quick", default=True,
              help="One seed, reduced grid, ≤ 5 min on 2 idle cores: it shows the recipe and cannot rank the "
                   "methods (the default).")
@click.option("--full", "size", flag_value="full",
              help="The pre-registered experiment (docs/demo-preregistration-2.md): 12 seeds, a late and the end "
                   "donor, replay none and own, the full grid (≤ 60 min on 2 idle cores).")
@click.option("--tiny", "size", flag_value="tiny", hidden=True)
@click.option("--replay", type=click.Choice(["none", "offpolicy", "own"]), default=None,
              help="What is mixed into the new facts (1 per 5 new-fact sequences, ~17%): none, offpolicy (a "
                   "related task in a teacher's format) or own (θpost's task A) [default: --lm own; --full none "
                   "and own, each method's replay chosen on validation].")
@click.option("--jobs", type=click.IntRange(0, 64), default=None,
              help="Worker processes of one torch thread each [default: CPU count, ≤ 4]. Results do not depend "
                   "on it.")
@report_errors
def demo(workdir: Path | None, size: str, replay: str | None, jobs: int | None) -> None:
    """Train a small LM here and compare SFT, OPSD and grafts, every choice made on validation.

    Writes results.json, frontier plots and compute.png into WORKDIR.
    """
    size = "quick" if size is True else size
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    settings = {"quick": lm_pipeline.QUICK, "full": lm_pipeline.FULL, "tiny": lm_pipeline.TINY}[size]
    if replay is not None:  # one replay instead of the registered ones
        settings = dataclasses.replace(settings, replay=replay, replays=())
    root = workdir or Path("demo-out") / ("lm-full" if size == "full" else "lm")
    lm_pipeline.clear_previous_run(root)
    jobs = min(os.cpu_count() or 1, 4) if jobs is None else jobs
    replays = ", ".join(settings.replays) or settings.replay
    click.echo(f"training a small LM and comparing SFT, OPSD and grafts in {root} (replay: {replays})")
    results = lm_pipeline.run_lm_demo(settings, root, echo=click.echo, jobs=jobs)
    click.echo(format_report(results))
    click.echo(f"   results: {root / 'results.json'}, plots: {', '.join(results['plots'])}")
