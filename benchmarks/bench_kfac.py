"""KFAC projection speed, and a whole-model KFAC graft vs mergekit's task_arithmetic (CPU).

Part 1: projection of one 3072×1024 weight (Δ̃ = UᵀΔV, scores, mask, Δ − U(1_S⊙Δ̃)Vᵀ):
the FLOPs actually done per second ÷ this machine's float32 matmul FLOP/s on the same
shapes, measured in the same run (the back-rotation is restricted to the rows and
columns of Δ̃ holding masked pairs, so "nominal" counts all four matmuls at full size).

Part 1b (also alone: --orthonormal-only): the full orthonormality check every read of a
KFAC side runs (max |VᵀV − I|, one float32 matmul) at the 0.6B model's side sizes
1024, 2048 and 3072, the sha256 that lets a second read of the same tensor skip it, and
the whole-model extrapolation (28 layers × 14 sides, every side a distinct basis).

Part 2: on the ~0.6B checkpoint of bench_graft.py (reuses --workdir), with a generated
KFAC cache (random orthonormal bases, decaying spectra, one entry per Linear weight):
wall time of `mergekit-yaml` graft rho=0.001 global KFAC ÷ task_arithmetic, the number of
Δ̃ computations per weight per merge, and the share of the merge spent in matmuls.

    python benchmarks/bench_kfac.py --workdir bench-work [--repeats 3] [--skip-model] [--orthonormal-only]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
from bench_graft import CONFIGS, build_inputs
from common import qwen3_config, time_merges

from graftmerge.formats.fisher_cache import KfacFactors, check_orthonormal
from graftmerge.math.projection import TensorFisher, remove_masked, score_delta
from graftmerge.math.selection import mask_from_threshold


def best_seconds(fn, repeats: int = 9) -> float:
    """Fastest of ``repeats`` runs: the machine's clock varies, the work does not."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def random_basis(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(n, n, generator=generator))[0].contiguous()


def decaying_spectrum(n: int, generator: torch.Generator) -> torch.Tensor:
    """Eigenvalues spanning ~6 decades, like real KFAC factors."""
    return torch.logspace(0, -6, n) * (0.5 + torch.rand(n, generator=generator))


def projection_benchmark(d_out: int = 3072, d_in: int = 1024) -> None:
    g = torch.Generator().manual_seed(0)
    U, V = random_basis(d_out, g), random_basis(d_in, g)
    S, D = decaying_spectrum(d_out, g), decaying_spectrum(d_in, g)
    delta = torch.randn(d_out, d_in, generator=g) * 1e-3
    fisher = TensorFisher(kfac=KfacFactors(U, S, V, D))
    big, tall, square = torch.randn(d_out, d_out), torch.randn(d_out, d_in), torch.randn(d_in, d_in)
    matmul_flops = 2 * d_out * d_out * d_in + 2 * d_out * d_in * d_in
    peak = matmul_flops / (best_seconds(lambda: big @ tall) + best_seconds(lambda: tall @ square))
    nominal = 2 * matmul_flops  # rotate + back-rotate, both at full size
    print(f"threads {torch.get_num_threads()}; fp32 matmul on these shapes: {peak / 1e9:.1f} GFLOP/s")
    print(f"projection of one {d_out}×{d_in} weight ({nominal / 1e9:.1f} nominal GFLOP):")
    scores = score_delta(delta.clone(), fisher).scores.reshape(-1)
    rotate_flops = matmul_flops
    for rho in (0.01, 0.001, 0.5):
        threshold = float(torch.kthvalue(scores, scores.numel() - int(rho * scores.numel()) + 1).values)
        mask = scores.reshape(d_out, d_in) > threshold
        rows, columns = int(mask.any(1).sum()), int(mask.any(0).sum())
        # The back-rotation only touches rows/columns of Δ̃ that hold a masked pair.
        done_flops = rotate_flops + 2 * d_out * rows * columns + 2 * d_out * columns * d_in

        def project(threshold=threshold):
            scored = score_delta(delta.clone(), fisher)
            mask = mask_from_threshold(scored.scores, threshold, 0)
            return remove_masked(scored, mask, fisher)

        seconds = best_seconds(project)
        rotate = best_seconds(lambda: score_delta(delta.clone(), fisher))
        print(f"  rho={rho:<6} {seconds * 1e3:7.1f} ms  ({rotate * 1e3:.1f} ms scoring)  "
              f"{done_flops / 1e9:5.1f} GFLOP done ({rows}×{columns} of Δ̃ back-rotated): "
              f"{done_flops / seconds / 1e9:6.1f} GFLOP/s = {done_flops / seconds / peak:4.2f} × matmul; "
              f"nominal {nominal / seconds / 1e9:6.1f} GFLOP/s")


# Sides of one Qwen3-0.6B layer by size (hidden 1024, 16×128 query heads, 8×128 kv heads,
# intermediate 3072): q 2048×1024, k and v 1024×1024, o 1024×2048, gate and up 3072×1024,
# down 1024×3072, rows and columns each.
SIDES_PER_LAYER = {1024: 9, 2048: 2, 3072: 3}
LAYERS = 28


def orthonormal_check_benchmark(repeats: int = 3) -> None:
    """Seconds per side of the full check on read, and what it adds to one whole-model KFAC merge."""
    import hashlib

    g = torch.Generator().manual_seed(0)
    check, digest = {}, {}
    for n in SIDES_PER_LAYER:
        basis = random_basis(n, g)
        check[n] = best_seconds(lambda basis=basis: check_orthonormal(basis, "basis"), repeats)
        digest[n] = best_seconds(lambda basis=basis: hashlib.sha256(memoryview(basis.numpy()).cast("B")).digest(), repeats)
        print(f"  side {n}: full check {check[n] * 1e3:7.1f} ms ({2 * n ** 3 / check[n] / 1e9:5.1f} GFLOP/s), "
              f"sha256 of the {n * n * 4 / 1e6:.0f} MB tensor {digest[n] * 1e3:5.1f} ms")
    first = LAYERS * sum(count * check[n] for n, count in SIDES_PER_LAYER.items())
    again = LAYERS * sum(count * digest[n] for n, count in SIDES_PER_LAYER.items())
    sides = LAYERS * sum(SIDES_PER_LAYER.values())
    print(f"0.6B KFAC cache ({sides} full sides, each a distinct basis): first read of every side {first:.1f} s, "
          f"a second read (the merge after the threshold pass) {again:.1f} s with the per-cache sha256 memo "
          f"({first:.1f} s without): {first + again:.1f} s per merge")


def write_kfac_cache(workdir: Path) -> Path:
    from graftmerge.formats.checkpoint import Checkpoint
    from graftmerge.formats.fisher_cache import FisherCacheWriter

    path = workdir / "fisher-kfac"
    if path.exists():
        return path
    g = torch.Generator().manual_seed(1)
    bases: dict[int, torch.Tensor] = {}
    post = Checkpoint(workdir / "post")
    print("writing a KFAC cache (one basis per size, a spectrum per weight) ...", flush=True)
    with FisherCacheWriter(path, model=workdir / "post", max_shard_bytes=500_000_000) as writer:
        for name, info in sorted(post.tensors.items()):
            if len(info.shape) == 2 and "proj" in name:
                U = bases.setdefault(info.shape[0], random_basis(info.shape[0], g))
                V = bases.setdefault(info.shape[1], random_basis(info.shape[1], g))
                writer.add_kfac_eigen(name, U=U, S=decaying_spectrum(info.shape[0], g),
                                      V=V, D=decaying_spectrum(info.shape[1], g))
            else:
                writer.add_diagonal(name, torch.rand(info.shape, generator=g) ** 4 * 1e-3)
    return path


KFAC_CONFIG = CONFIGS["graft rho=0.01 global diag"].replace("rho: 0.01", "rho: 0.001").replace(
    "fisher-diag", "fisher-kfac")


def count_and_profile(workdir: Path) -> None:
    """One in-process merge, threshold pass included: Δ̃ computations per KFAC weight, time in matmuls."""
    import os

    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions
    from torch.profiler import ProfilerActivity, profile

    from graftmerge.adapter import import_hook
    from graftmerge.math.projection import KFAC_ROTATIONS

    import_hook.install()
    from mergekit.merge import run_merge

    config = MergeConfiguration.model_validate(yaml.safe_load(KFAC_CONFIG.format(w=workdir.resolve())))
    os.environ["GRAFTMERGE_CACHE_DIR"] = str(workdir / "threshold-cache-profile")
    shutil.rmtree(workdir / "threshold-cache-profile", ignore_errors=True)  # time the pass too
    out = workdir / "out-profile"
    shutil.rmtree(out, ignore_errors=True)
    KFAC_ROTATIONS.clear()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        run_merge(config, str(out), options=MergeOptions(quiet=True, out_shard_size=500_000_000))
    wall = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    matmul_us = sum(e.self_cpu_time_total for e in profiler.key_averages() if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
    weights = sum(1 for name in json.loads((workdir / "fisher-kfac" / "fisher_manifest.json").read_text())["entries"].values()
                  if name["representation"] == "kfac")
    print(f"in-process KFAC graft, threshold pass included: {wall:.1f} s wall (profiled), matmuls {matmul_us / 1e6:.1f} s "
          f"= {100 * matmul_us / 1e6 / wall:.0f}% of the merge")
    print(f"Δ̃ computations: {sum(KFAC_ROTATIONS.values())} for {weights} KFAC weights "
          f"= {sum(KFAC_ROTATIONS.values()) / weights:.2f} per weight per merge (threshold pass + merge)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("bench-work"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-model", action="store_true", help="only the single-weight projection")
    parser.add_argument("--orthonormal-only", action="store_true", help="only the orthonormality check on read")
    args = parser.parse_args()
    print(f"full orthonormality check on read (threads {torch.get_num_threads()}, best of {args.repeats}):")
    orthonormal_check_benchmark(args.repeats)
    if args.orthonormal_only:
        return
    projection_benchmark()
    if args.skip_model:
        return
    build_inputs(args.workdir, qwen3_config(), with_fisher=False)
    write_kfac_cache(args.workdir)
    configs = {"task_arithmetic": CONFIGS["task_arithmetic"], "graft rho=0.001 global KFAC": KFAC_CONFIG}
    results = time_merges(args.workdir, configs, args.repeats)
    walls = {name: r["wall"] for name, r in results.items()}
    ta = statistics.median(walls["task_arithmetic"])
    kfac = statistics.median(walls["graft rho=0.001 global KFAC"])
    print(f"median of {args.repeats}: task_arithmetic {ta:.1f} s, KFAC graft {kfac:.1f} s, ratio {kfac / ta:.2f}")
    count_and_profile(args.workdir)


if __name__ == "__main__":
    main()
