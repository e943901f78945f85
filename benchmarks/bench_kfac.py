"""KFAC projection speed, and a whole-model KFAC graft vs mergekit's task_arithmetic (CPU).

Part 1: projection of one 3072×1024 weight (Δ̃ = UᵀΔV, scores, mask, Δ − U(1_S⊙Δ̃)Vᵀ):
nominal FLOPs (all four matmuls at full size) per second ÷ this machine's float32
matmul FLOP/s on the same shapes, measured in the same run.

Part 2: on the ~0.6B checkpoint of bench_graft.py (reuses --workdir), with a generated
KFAC cache (random orthonormal bases, decaying spectra, one entry per Linear weight):
wall time of `mergekit-yaml` graft rho=0.001 global KFAC ÷ task_arithmetic, the number of
Δ̃ computations per weight per merge, and the share of the merge spent in matmuls.

    python benchmarks/bench_kfac.py --workdir bench-work [--repeats 3] [--skip-model]
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
from common import BIN, qwen3_config, timed_run

from graftmerge.fisher import KfacFactors
from graftmerge.projection import TensorFisher, remove_masked, score_delta
from graftmerge.selection import mask_from_threshold


def median_seconds(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
    peak = matmul_flops / (median_seconds(lambda: big @ tall) + median_seconds(lambda: tall @ square))
    nominal = 2 * matmul_flops  # rotate + back-rotate, at full size
    print(f"threads {torch.get_num_threads()}; fp32 matmul on these shapes: {peak / 1e9:.1f} GFLOP/s")
    print(f"projection of one {d_out}×{d_in} weight ({nominal / 1e9:.1f} nominal GFLOP):")
    scores = score_delta(delta.clone(), fisher).scores.reshape(-1)
    for rho in (0.01, 0.001, 0.5):
        threshold = float(torch.kthvalue(scores, scores.numel() - int(rho * scores.numel()) + 1).values)

        def project(threshold=threshold):
            scored = score_delta(delta.clone(), fisher)
            mask = mask_from_threshold(scored.scores, threshold, 0)
            return remove_masked(scored, mask, fisher)

        seconds = median_seconds(project)
        rotate = median_seconds(lambda: score_delta(delta.clone(), fisher))
        print(f"  rho={rho:<6} {seconds * 1e3:7.1f} ms  {nominal / seconds / 1e9:6.1f} GFLOP/s  "
              f"÷ matmul peak {nominal / seconds / peak:5.2f}   (scoring alone {rotate * 1e3:.1f} ms)")


def write_kfac_cache(workdir: Path) -> Path:
    from graftmerge.checkpoint import Checkpoint
    from graftmerge.fisher import FisherCacheWriter

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
    """One in-process merge: Δ̃ computations per KFAC weight, and time inside matmuls."""
    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions
    from torch.profiler import ProfilerActivity, profile

    from graftmerge import _import_hook
    from graftmerge.projection import KFAC_ROTATIONS

    _import_hook.install()
    from mergekit.merge import run_merge

    config = MergeConfiguration.model_validate(yaml.safe_load(KFAC_CONFIG.format(w=workdir.resolve())))
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
    print(f"in-process KFAC graft: {wall:.1f} s wall (profiled), matmuls {matmul_us / 1e6:.1f} s "
          f"= {100 * matmul_us / 1e6 / wall:.0f}% of the merge")
    print(f"Δ̃ computations: {sum(KFAC_ROTATIONS.values())} for {weights} KFAC weights "
          f"= {sum(KFAC_ROTATIONS.values()) / weights:.2f} per weight per merge (threshold pass + merge)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("bench-work"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-model", action="store_true", help="only the single-weight projection")
    args = parser.parse_args()
    projection_benchmark()
    if args.skip_model:
        return
    build_inputs(args.workdir, qwen3_config(), with_fisher=False)
    write_kfac_cache(args.workdir)
    configs = {"task_arithmetic": CONFIGS["task_arithmetic"], "graft rho=0.001 global KFAC": KFAC_CONFIG}
    walls: dict[str, list[float]] = {name: [] for name in configs}
    cache_dir = args.workdir / "threshold-cache"
    for repeat in range(args.repeats):
        for name, template in configs.items():
            config_file = args.workdir / "bench-kfac.yml"
            config_file.write_text(template.format(w=args.workdir.resolve()))
            shutil.rmtree(args.workdir / "out", ignore_errors=True)
            shutil.rmtree(cache_dir, ignore_errors=True)
            wall, rss = timed_run([str(BIN / "mergekit-yaml"), str(config_file), str(args.workdir / "out"),
                                   "--out-shard-size", "500M"], env={"GRAFTMERGE_CACHE_DIR": str(cache_dir)})
            walls[name].append(wall)
            print(f"  run {repeat + 1} {name:28s} {wall:7.1f} s  {rss:8.0f} MB", flush=True)
    ta = statistics.median(walls["task_arithmetic"])
    kfac = statistics.median(walls["graft rho=0.001 global KFAC"])
    print(f"median of {args.repeats}: task_arithmetic {ta:.1f} s, KFAC graft {kfac:.1f} s, ratio {kfac / ta:.2f}")
    count_and_profile(args.workdir)


if __name__ == "__main__":
    main()
