"""fisher and regmean merges of three ~0.6B Qwen3-shaped models vs mergekit's linear, in one run (CPU).

Measured side by side, medians of --repeats, each merge a fresh `mergekit-yaml` process:
  * wall time and peak RSS of linear, fisher (diagonal caches) and regmean (KFAC caches
    whose input sides are full eigenbases, as `fisher estimate --kind kfac` writes them);
  * regmean's solve time (what the merge reports on stderr) against its FLOP count at this
    machine's float64 matmul rate, measured in the same run.

The generated caches: a random diagonal for every tensor; for every Linear weight a
diagonal output side and a full input side (a random orthonormal basis per input size,
fresh eigenvalues per layer and model; q/k/v and gate/up share theirs, as real caches do).

    python benchmarks/bench_data_aware_merge.py --workdir bench-data-aware [--repeats 1] [--small]
        [--methods linear,fisher] [--compare-with OLD_CHECKOUT]

--compare-with (formerly --fisher-from) times each data-aware merge once more per repeat with
graftmerge imported from another checkout (e.g. a `git worktree` of an earlier commit): a
before/after in one run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import _PEAK_RSS_PROBE, BIN, median, qwen3_config, write_checkpoint

from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.fisher_cache import FisherCacheWriter

MODELS = ("m0", "m1", "m2")
SHARD = 500_000_000


def build_inputs(workdir: Path, config, kfac: bool = True) -> None:
    """Three related models (one base plus noise), each with a diagonal and a KFAC cache."""
    generator = torch.Generator().manual_seed(0)
    for index, name in enumerate(MODELS):
        if not (workdir / name).exists():
            seed = torch.Generator().manual_seed(100 + index)
            write_checkpoint(workdir / name, config,
                             lambda n, s, g=seed: torch.randn(s, generator=g) * 0.02)
        if not (workdir / f"diag-{name}").exists():
            with FisherCacheWriter(workdir / f"diag-{name}", model=workdir / name, max_shard_bytes=SHARD) as w:
                for tensor, info in Checkpoint(workdir / name).tensors.items():
                    w.add_diagonal(tensor, torch.rand(info.shape, generator=generator) ** 4)
        if kfac and not (workdir / f"kfac-{name}").exists():
            write_kfac_cache(workdir / f"kfac-{name}", workdir / name, generator)


def write_kfac_cache(path: Path, model: Path, generator: torch.Generator) -> None:
    """KFAC for every 2-D projection (full input side), diagonal for the rest."""
    bases: dict[int, torch.Tensor] = {}
    tensors = Checkpoint(model).tensors
    with FisherCacheWriter(path, model=model, max_shard_bytes=SHARD) as writer:
        shared: dict[tuple[str, int], torch.Tensor] = {}
        for name, info in sorted(tensors.items()):
            if len(info.shape) != 2 or "proj" not in name:
                writer.add_diagonal(name, torch.rand(info.shape, generator=generator) ** 4)
                continue
            rows, columns = info.shape
            if columns not in bases:
                bases[columns] = torch.linalg.qr(torch.randn(columns, columns, generator=generator,
                                                             dtype=torch.float64))[0]
            layer = name.split(".layers.")[1].split(".")[0]
            group = "mlp" if "gate_proj" in name or "up_proj" in name else name.rsplit(".", 2)[-2]
            group = "qkv" if group in ("q_proj", "k_proj", "v_proj") else group
            values = shared.setdefault((f"{layer}.{group}", columns), torch.rand(columns, generator=generator,
                                                                                 dtype=torch.float64) + 0.01)
            writer.add_kfac_eigen(name, U=None, S=torch.rand(rows, generator=generator, dtype=torch.float64),
                                  V=bases[columns], D=values)


CONFIG = """merge_method: {method}
models:
{models}
{parameters}dtype: float32
out_dtype: bfloat16
"""


def config_text(workdir: Path, method: str) -> str:
    cache = {"linear": None, "fisher": "diag", "regmean": "kfac"}[method]
    entries = []
    for name in MODELS:
        parameters = "{weight: 1.0}" if cache is None else f"{{fisher: {workdir}/{cache}-{name}, weight: 1.0}}"
        entries.append(f"  - model: {workdir}/{name}\n    parameters: {parameters}")
    parameters = "parameters:\n  normalize: true\n" if method == "linear" else ""
    return CONFIG.format(method=method, models="\n".join(entries), parameters=parameters)


def float64_rate(size: int = 2048, repeats: int = 5) -> float:
    """This machine's float64 matmul rate now (FLOP/s), on the shapes regmean multiplies."""
    a = torch.randn(size, size, dtype=torch.float64)
    a @ a
    start = time.perf_counter()
    for _ in range(repeats):
        a @ a
    return repeats * 2 * size**3 / (time.perf_counter() - start)


def timed_merge(workdir: Path, method: str, source: Path | None = None) -> tuple[float, float, str]:
    """(wall seconds, peak RSS MB, stderr) of one fresh `mergekit-yaml` process merging with ``method``.

    The peak RSS is the merge process's own, measured as ``common.timed_run`` measures it.
    ``source``: import graftmerge from that checkout instead (PYTHONPATH) for this merge.
    """
    env = None if source is None else {**os.environ, "PYTHONPATH": str(source.resolve())}
    config_file = workdir / "bench.yml"
    config_file.write_text(config_text(workdir.resolve(), method))
    out = workdir / "out"
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory() as scratch:
        peak_file = Path(scratch) / "peak_kb"
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-c", _PEAK_RSS_PROBE, str(peak_file), str(BIN / "mergekit-yaml"),
                                 str(config_file), str(out), "--out-shard-size", "500M"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        wall = time.perf_counter() - start
        if result.returncode != 0:
            raise RuntimeError(f"{method} failed:\n{result.stderr[-2000:]}")
        rss = int(peak_file.read_text()) / 1024
    shutil.rmtree(out, ignore_errors=True)
    return wall, rss, result.stderr


def solve_report(stderr: str) -> tuple[float, float]:
    """(solve seconds, FLOP) from the summary line a regmean merge prints."""
    found = re.search(r"regmean: \d+ linear weights solved .*?; ([\d.]+) s, ([\d.]+) GFLOP", stderr)
    return float(found.group(1)), float(found.group(2)) * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("bench-data-aware"))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--small", action="store_true", help="a 4-layer, 32k-vocab model for a quick look")
    parser.add_argument("--methods", default="linear,fisher,regmean",
                        help="which merges to time (linear always, as the peer): e.g. linear,fisher")
    parser.add_argument("--compare-with", "--fisher-from", dest="compare_with", type=Path, metavar="CHECKOUT",
                        help="also time each data-aware method (fisher, regmean) with graftmerge from this checkout")
    args = parser.parse_args()
    methods = ["linear"] + [m for m in ("fisher", "regmean") if m in args.methods.split(",")]
    sources: dict[str, Path | None] = {m: None for m in methods}
    if args.compare_with is not None:
        if not (args.compare_with / "graftmerge" / "__init__.py").is_file():
            parser.error(f"--compare-with {args.compare_with}: no graftmerge package there")
        for method in methods[1:]:
            sources[f"{method}@{args.compare_with.name}"] = args.compare_with
    config = qwen3_config(**(dict(num_hidden_layers=4, vocab_size=32768) if args.small else {}))
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(f"building inputs in {args.workdir} ...", flush=True)
    build_inputs(args.workdir, config, kfac="regmean" in methods)
    params = sum(info.numel for info in Checkpoint(args.workdir / MODELS[0]).tensors.values())
    print(f"3 models of {params / 1e9:.3f}B parameters (bf16, tied); torch threads {torch.get_num_threads()}")
    results: dict[str, dict[str, list[float]]] = {m: {"wall": [], "rss": []} for m in sources}
    solves, rates = [], [float64_rate()]
    for repeat in range(args.repeats):
        for method in results:
            wall, rss, stderr = timed_merge(args.workdir, method.split("@")[0], sources[method])
            results[method]["wall"].append(wall)
            results[method]["rss"].append(rss)
            if method == "regmean":  # this checkout's: the solve report of the one measured against FLOPs
                solves.append(solve_report(stderr))
            print(f"  run {repeat + 1} {method:14s} {wall:7.1f} s  {rss:8.0f} MB", flush=True)
        rates.append(float64_rate())
    rate = median(rates)
    linear_wall, linear_rss = median(results["linear"]["wall"]), median(results["linear"]["rss"])
    print(f"\nmedians of {args.repeats}")
    print(f"{'method':16s} {'wall s':>8s} {'÷ linear':>9s} {'peak RSS MB':>12s} {'÷ linear':>9s}")
    for method, r in results.items():
        wall, rss = median(r["wall"]), median(r["rss"])
        print(f"{method:16s} {wall:8.1f} {wall / linear_wall:9.2f} {rss:12.0f} {rss / linear_rss:9.2f}")
    if not solves:
        return
    seconds, flops = median([s for s, _ in solves]), median([f for _, f in solves])
    print(f"\nregmean solves: {seconds:.1f} s for {flops / 1e12:.2f} TFLOP; float64 matmul rate {rate / 1e9:.1f} "
          f"GFLOP/s (median of {len(rates)} measures around the merges), so the FLOP count alone takes "
          f"{flops / rate:.1f} s ({seconds / (flops / rate):.2f}× that)")


if __name__ == "__main__":
    main()
