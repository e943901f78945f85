"""Peak memory of every process: ``fisher estimate`` in one process vs ``--fsdp`` over N ranks.

    python benchmarks/bench_fsdp_estimate.py --workdir /tmp/bench-fsdp       # ~216M parameters, 2 ranks

Generates a Qwen3-shaped model (float32, untied, a small vocabulary so the decoder layers
hold most of the weights, as in large models), random rollouts, then runs, one after the
other: ``--dry-run``, the one-process estimate (with glibc's default allocator, then with
the 1 MiB mmap threshold ``--fsdp`` sets for itself, like for like), and the ``--fsdp`` estimate with each rank
its own process joined by env:// (as torchrun joins them). Each process's peak resident
set is its ``ru_maxrss`` from ``wait4``. Prints per-process peaks, the ratio of each rank's
peak to the one-process peak (goal < 0.65 for 2 ranks), the dry-run's estimates against the
measured peaks, the wall times, and the largest difference between the two caches.
Heavy (several GB in all): run it once, on a quiet machine if you have one.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from graftmerge.demo.tiny_models import save_tiny_model
from graftmerge.formats.fisher_cache import open_fisher_cache

GIB = 1 << 30


def make_inputs(args) -> tuple[Path, Path]:
    """The generated model and rollouts under the work folder (made once, reused)."""
    work = Path(args.workdir)
    model = work / "model"
    if not (model / "config.json").exists():
        save_tiny_model(model, seed=0, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        intermediate_size=args.intermediate, vocab_size=args.vocab, num_attention_heads=16,
                        num_key_value_heads=8, tie_word_embeddings=False, max_shard_size="500MB")
    generator = torch.Generator().manual_seed(1)
    rollouts = work / "rollouts.jsonl"
    with open(rollouts, "w") as handle:
        for _ in range(args.sequences):
            ids = torch.randint(0, args.vocab, (args.length,), generator=generator).tolist()
            cut = args.length // 4
            handle.write(json.dumps({"prompt_ids": ids[:cut], "completion_ids": ids[cut:]}) + "\n")
    return model, rollouts


def command(model: Path, rollouts: Path, output: Path, args, *extra: str) -> list[str]:
    return [sys.executable, "-m", "graftmerge", "fisher", "estimate", str(model), "-o", str(output),
            "--rollouts", str(rollouts), "--kind", args.kind, "--batch-size", str(args.batch_size),
            "--no-progress", "--overwrite", *extra]


def run_measured(commands: list[list[str]], envs: list[dict[str, str]]) -> tuple[list[int], float]:
    """Start every command at once; (peak RSS bytes of each, wall seconds until the last exits)."""
    began = time.perf_counter()
    processes = [subprocess.Popen(c, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for c, e in zip(commands, envs, strict=True)]
    peaks = []
    for process in processes:
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            raise SystemExit(f"{' '.join(process.args)} failed:\n{process.stderr.read().decode()[-3000:]}")
        peaks.append(usage.ru_maxrss * 1024)
    return peaks, time.perf_counter() - began


def dry_run(model: Path, rollouts: Path, args) -> tuple[float, float, str]:
    """(one-process, per-rank) peak estimates in GiB, and the printed table."""
    done = subprocess.run(command(model, rollouts, Path(args.workdir) / "dry", args, "--dry-run", "--world-size",
                                  str(args.world)), capture_output=True, text=True, check=True)
    peak = next(line for line in done.stdout.splitlines() if line.startswith("peak"))
    one, each = (float(v) for v in peak.replace("G", "").split()[-2:])
    return one, each, done.stdout


def largest_difference(a: Path, b: Path) -> float:
    """Largest relative difference of the two caches' diagonals."""
    x, y = open_fisher_cache(a), open_fisher_cache(b)
    worst = 0.0
    for name in x.names("diagonal"):
        p, q = x.diagonal(name), y.diagonal(name)
        worst = max(worst, float((p - q).abs().max() / p.abs().max().clamp_min(1e-30)))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--kind", default="diagonal", choices=["diagonal", "kfac", "both"])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model, rollouts = make_inputs(args)
    base = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    one_estimate, rank_estimate, table = dry_run(model, rollouts, args)
    print(table)
    (single,), single_wall = run_measured([command(model, rollouts, work / "single", args)], [base])
    # like for like: the one process with the glibc mmap threshold --fsdp sets for itself (1 MiB)
    (alike,), alike_wall = run_measured([command(model, rollouts, work / "single", args)],
                                        [{**base, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}])
    port = str(free_port())
    envs = [{**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(args.world), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": port} for r in range(args.world)]
    ranks, fsdp_wall = run_measured([command(model, rollouts, work / "fsdp", args, "--fsdp")] * args.world, envs)
    print(f"\nmeasured peak RSS ({args.kind}, {args.sequences}×{args.length} tokens, batch {args.batch_size}, "
          f"{args.threads} thread(s) per process)")
    for label, peak, wall in (("one process, default glibc", single, single_wall),
                              ("one process, mmap threshold 1 MiB", alike, alike_wall)):
        print(f"  {label:36}{peak / GIB:6.2f} GiB   (dry run {one_estimate:.2f}: "
              f"{one_estimate / (peak / GIB) - 1:+.0%})   wall {wall:.1f} s")
    for rank, peak in enumerate(ranks):
        print(f"  --fsdp rank {rank:<24}{peak / GIB:6.2f} GiB = {peak / single:.2f} × default, {peak / alike:.2f} × "
              f"like for like   (dry run {rank_estimate:.2f}: {rank_estimate / (peak / GIB) - 1:+.0%})")
    print(f"  --fsdp wall {fsdp_wall:.1f} s; largest relative difference of the diagonals: "
          f"{largest_difference(work / 'single', work / 'fsdp'):.2g}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
