"""Throughput of Fisher estimation relative to a plain forward+backward (the floor).

    python benchmarks/bench_fisher_estimate.py            # ~50M-parameter Qwen3-shaped model
    PYTHONPATH=/path/to/kronfluence python benchmarks/bench_fisher_estimate.py --kronfluence

Every mode runs over the same batches of the same generated model in one process:
the floor (forward + backward with parameter gradients, as training would), our
diagonal, KFAC and both, and optionally kronfluence's covariance fitting (its KFAC
factors, true Fisher with sampled labels) as the peer. Modes are interleaved round by
round (a busy moment of a shared machine hits every mode) with one torch thread count
for all (--threads); prints median seconds, tokens/s, the ratio of medians to the floor
and the spread of the per-round ratios; --json writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import small_qwen3

from graftmerge.estimate.accumulator import FisherAccumulator
from graftmerge.estimate.batching import pad_batch, plan_batches
from graftmerge.estimate.retention_loss import summed_sequence_losses
from graftmerge.estimate.rollouts import Rollout


def make_rollouts(args) -> list[Rollout]:
    generator = torch.Generator().manual_seed(1)
    rollouts = []
    for _ in range(args.sequences):
        prompt = int(torch.randint(args.length // 4, args.length // 2, (), generator=generator))
        completion = int(torch.randint(args.length // 2, args.length, (), generator=generator))
        ids = torch.randint(0, args.vocab, (prompt + completion,), generator=generator).tolist()
        rollouts.append(Rollout(tuple(ids[:prompt]), tuple(ids[prompt:])))
    return rollouts


def floor(model, batches) -> None:
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    for batch in batches:
        logits = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        ).logits
        summed_sequence_losses(logits, batch.input_ids, batch.completion_mask).backward()
        model.zero_grad(set_to_none=True)


def ours(kind: str):
    def run(model, batches) -> None:
        with FisherAccumulator(model, kind=kind, dtype=torch.float32) as accumulator:
            for batch in batches:
                accumulator.accumulate(batch)

    return run


def kronfluence_covariances(model, batches) -> None:
    """kronfluence 1.x covariance fitting (activation and gradient covariances of every Linear)."""
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments
    from kronfluence.task import Task

    class RetentionTask(Task):
        def compute_train_loss(self, batch, model, sample=False):
            logits = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
            logits = logits[:, :-1].float()
            if sample:  # true Fisher: labels sampled from the model
                with torch.no_grad():
                    probs = torch.softmax(logits.detach(), dim=-1)
                    labels = torch.multinomial(probs.view(-1, probs.shape[-1]), 1).view(
                        probs.shape[:-1]
                    )
            else:
                labels = batch["input_ids"][:, 1:]
            mask = batch["completion_mask"][:, 1:]
            nll = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), labels, reduction="none"
            )
            return (nll * mask).sum()

        def compute_measurement(self, batch, model):
            return self.compute_train_loss(batch, model)

        def get_influence_tracked_modules(self):
            return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]

        def get_attention_mask(self, batch):
            return batch["attention_mask"]

    rows = []
    for batch in batches:
        for n in range(batch.sequences):
            rows.append({
                "input_ids": batch.input_ids[n],
                "attention_mask": batch.attention_mask[n],
                "completion_mask": batch.completion_mask[n].long(),
            })  # fmt: skip
    task = RetentionTask()
    prepared = prepare_model(model, task)
    with tempfile.TemporaryDirectory() as folder:
        analyzer = Analyzer("bench", prepared, task, output_dir=folder, disable_model_save=True)
        analyzer.fit_covariance_matrices(
            "covariances",
            rows,
            per_device_batch_size=batches[0].sequences,
            factor_args=FactorArguments(strategy="kfac"),
            overwrite_output_dir=True,
        )


def timed(run, model, batches) -> float:
    began = time.perf_counter()
    run(model, batches)
    return time.perf_counter() - began


def interleaved(modes: dict, model, batches, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Wall and process-CPU seconds of every mode, ``repeats`` rounds of all modes in turn.

    CPU seconds leave out the time other processes held the cores (with one thread they
    are the wall time of a quiet machine); a mode that fails is dropped.
    """
    timings: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in modes}
    for _ in range(repeats):
        for name in list(timings):
            cpu = time.process_time()
            try:
                timings[name]["wall"].append(timed(modes[name], model, batches))
            except Exception as error:  # the peer may not run here; say why and go on
                print(f"{name:>26}: failed ({type(error).__name__}: {error})", file=sys.stderr)
                del timings[name]
                continue
            timings[name]["cpu"].append(time.process_time() - cpu)
    return timings


def report(timings: dict[str, dict[str, list[float]]], tokens: int, floor_name: str) -> dict[str, dict]:
    """Print and return each mode's medians, tokens/s, ratios of medians and per-round ratio spread."""
    floor_wall, floor_cpu = timings[floor_name]["wall"], timings[floor_name]["cpu"]
    base, base_cpu = statistics.median(floor_wall), statistics.median(floor_cpu)
    print(f"{'mode':>26} {'median s':>9} {'tokens/s':>9} {'÷ floor':>8} {'(rounds)':>11}"
          f" {'CPU s':>7} {'÷ floor':>8}")  # fmt: skip
    results = {}
    for name, timing in timings.items():
        median, cpu = statistics.median(timing["wall"]), statistics.median(timing["cpu"])
        ratios = [f / s for f, s in zip(floor_wall, timing["wall"], strict=True)]
        results[name] = {"seconds": timing["wall"], "cpu_seconds": timing["cpu"],
                         "median_seconds": median, "tokens_per_second": tokens / median,
                         "ratio_to_floor": base / median, "round_ratios": ratios,
                         "cpu_ratio_to_floor": base_cpu / cpu}  # fmt: skip
        print(f"{name:>26} {median:9.2f} {tokens / median:9.1f} {base / median:8.2f}"
              f" {min(ratios):5.2f}–{max(ratios):4.2f} {cpu:7.2f} {base_cpu / cpu:8.2f}")  # fmt: skip
    return results


def load_average() -> str:
    """The machine's 1/5/15-minute load, printed with every result: ratios are only as good as the quiet."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--length", type=int, default=160, help="about the longest sequence")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--kronfluence", action="store_true", help="also time kronfluence")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, for every mode")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model = small_qwen3(args.hidden, args.layers, args.intermediate, args.vocab)
    parameters = sum(p.numel() for p in model.parameters())
    rollouts = make_rollouts(args)
    plan = plan_batches([r.length for r in rollouts], args.batch_size)
    batches = [pad_batch([rollouts[i] for i in indices]) for indices in plan]
    tokens = sum(b.tokens for b in batches)
    warmup = [pad_batch(rollouts[:2])]
    modes = {
        "floor": floor,
        "diagonal": ours("diagonal"),
        "kfac": ours("kfac"),
        "both": ours("both"),
    }
    if args.kronfluence:
        modes["kronfluence covariances"] = kronfluence_covariances
    print(f"model: {parameters / 1e6:.1f}M parameters; {len(rollouts)} sequences, {tokens} tokens, "
          f"batches of {args.batch_size}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.repeats} rounds interleaved; load average {load_average()}")  # fmt: skip
    for name, run in modes.items():
        if name != "kronfluence covariances":
            run(model, warmup)
    results = report(interleaved(modes, model, batches, args.repeats), tokens, "floor")
    print(f"load average at end: {load_average()}")
    if args.json:
        args.json.write_text(
            json.dumps({"parameters": parameters, "tokens": tokens, "threads": args.threads,
                        "results": results}, indent=1)  # fmt: skip
        )


if __name__ == "__main__":
    main()
