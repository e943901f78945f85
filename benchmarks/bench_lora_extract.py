"""`graftmerge delta extract --rank K` (a PEFT LoRA adapter) vs the full delta extract (CPU).

Inputs, generated (bench_graft.py's generator, Qwen3-shaped; ``--small`` = 4 layers,
vocab 32768, hidden 1024, intermediate 3072: 96M parameters, sized for a shared 2-core
machine): base and base-ft, bf16, Δ = Gaussian noise (full rank, so the kept shares
printed say nothing about real fine-tunes; the sizes and times do).

Each run is a fresh `graftmerge delta extract` process, interleaved, medians of
--repeats: the full float32 delta (the peer), and adapters at each --ranks K. Prints
wall time, peak RSS, size on disk and the total kept share, each against the full delta.

    python benchmarks/bench_lora_extract.py --workdir /tmp/bench-lora-extract --small [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from bench_graft import build_inputs
from common import BIN, median, qwen3_config, timed_run


def folder_bytes(folder: Path) -> int:
    """Bytes of every file under ``folder``."""
    return sum(file.stat().st_size for file in folder.rglob("*") if file.is_file())


def main() -> None:
    """Generate the inputs once, time the extracts interleaved, print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--small", action="store_true", help="4 layers, vocab 32768 (96M parameters)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", default="16,64", help="comma-separated K")
    args = parser.parse_args()
    config = qwen3_config(num_hidden_layers=4, vocab_size=32768) if args.small else qwen3_config()
    args.workdir.mkdir(parents=True, exist_ok=True)
    build_inputs(args.workdir, config, with_fisher=False)
    runs = {"full delta": []} | {f"rank {k}": ["--rank", k] for k in args.ranks.split(",")}
    results = {name: {"wall": [], "rss": [], "bytes": 0, "kept": None} for name in runs}
    for repeat in range(args.repeats):
        for name, extra in runs.items():
            out = args.workdir / "out"
            shutil.rmtree(out, ignore_errors=True)
            wall, rss = timed_run([str(BIN / "graftmerge"), "delta", "extract", str(args.workdir / "base"),
                                   str(args.workdir / "base-ft"), "-o", str(out), "-q", *extra])
            results[name]["wall"].append(wall)
            results[name]["rss"].append(rss)
            results[name]["bytes"] = folder_bytes(out)
            if (out / "lora_manifest.json").exists():
                results[name]["kept"] = json.loads((out / "lora_manifest.json").read_text())["total"]["kept_share"]
            shutil.rmtree(out, ignore_errors=True)
            print(f"  run {repeat + 1} {name:12s} {wall:7.1f} s  {rss:8.0f} MB", flush=True)
    peer = results["full delta"]
    print(f"\n{'extract':12s} {'wall s':>8s} {'÷ full':>7s} {'peak MB':>8s} {'size MB':>9s} {'÷ full':>8s} "
          f"{'kept ‖Δ‖²_F':>12s}")
    for name, r in results.items():
        kept = "-" if r["kept"] is None else f"{100 * r['kept']:.2f}%"
        print(f"{name:12s} {median(r['wall']):8.1f} {median(r['wall']) / median(peer['wall']):7.2f} "
              f"{median(r['rss']):8.0f} {r['bytes'] / 1e6:9.1f} {r['bytes'] / peer['bytes']:8.4f} {kept:>12s}")


if __name__ == "__main__":
    main()
