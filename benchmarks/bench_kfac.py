"""KFAC projection speed, and a whole-model KFAC graft vs mergekit's task_arithmetic (CPU).

Part 1: projection of one 3072×1024 weight (Δ̃ = UᵀΔV, scores, mask, Δ − U(1_S⊙Δ̃)Vᵀ):
the FLOPs actually done per second ÷ this machine's float32 matmul FLOP/s on the same
shapes, measured in the same run (the back-rotation is restricted to the rows and
columns of Δ̃ holding masked pairs, so "nominal" counts all four matmuls at full size).

Part 1b (also alone: --orthonormal-only): the full orthonormality check a read of a KFAC
side runs the first time its bytes are seen on a machine (max |VᵀV − I|, one float32
matmul) at the 0.6B model's side sizes 1024, 2048 and 3072, the sha256 that every later
read (this merge's or the next one's) matches against the record of bases that passed,
and the whole-model extrapolation (28 layers × 14 sides, every side a distinct basis).

Part 2: on the ~0.6B checkpoint of bench_graft.py (reuses --workdir; --small: 4 layers,
vocab 32768), with a generated KFAC cache (random orthonormal bases, decaying spectra, one entry
per Linear weight) and rank-K copies of it (`graftmerge fisher compress`, K from --ranks):

- the mask overlap |M_K ∩ M_full| / |M_full| of each rank K at the same number of masked
  directions (ρ_K = ⌈ρ·D_full⌉ / D_K: a compact cache ranks fewer directions, so at the
  same ρ it would mask fewer); the smallest K with overlap ≥ 0.99 is timed;
- wall time of `mergekit-yaml` graft ρ = 0.001 global KFAC (full rank, and rank K at ρ_K)
  ÷ task_arithmetic, interleaved, medians of --repeats; every run computes its threshold
  afresh (GRAFTMERGE_NO_THRESHOLD_CACHE=1) and finds the bases already checked (the
  record in the benchmark's own cache folder, filled when the caches were written;
  --cold also times one merge with an empty record: every basis checked in full);
- one in-process merge: Δ̃ computations per weight, and the share of the merge in matmuls.

    python benchmarks/bench_kfac.py --workdir bench-work [--repeats 3] [--ranks 256,512,768]
                                    [--small] [--skip-model] [--orthonormal-only] [--cold]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml
from bench_graft import CONFIGS, build_inputs
from common import BIN, qwen3_config, timed_run
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions

from graftmerge.adapter import import_hook
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.fisher_cache import FisherCacheWriter, KfacFactors, side_rank
from graftmerge.formats.rotation_store import RotationStore
from graftmerge.math.eigenbasis import check_orthonormal
from graftmerge.math.projection import KFAC_ROTATIONS, TensorFisher, remove_masked, score_delta
from graftmerge.math.selection import mask_from_threshold
from graftmerge.pipeline.fisher_compress import compress_cache
from graftmerge.pipeline.graft_plan import GraftInputs, plan_from_merge_config
from graftmerge.pipeline.threshold_pass import compute_global_threshold


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


def projection_benchmark(d_out: int = 3072, d_in: int = 1024) -> float:
    """Prints the projection's speed on one weight; returns this machine's float32 matmul FLOP/s."""
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
    return peak


# Sides of one Qwen3-0.6B layer by size (hidden 1024, 16×128 query heads, 8×128 kv heads,
# intermediate 3072): q 2048×1024, k and v 1024×1024, o 1024×2048, gate and up 3072×1024,
# down 1024×3072, rows and columns each.
SIDES_PER_LAYER = {1024: 9, 2048: 2, 3072: 3}
LAYERS = 28


def orthonormal_check_benchmark(repeats: int = 3) -> None:
    """Seconds per side of the full check on read, and what it adds to one whole-model KFAC merge."""

    g = torch.Generator().manual_seed(0)
    check, digest = {}, {}
    for n in SIDES_PER_LAYER:
        basis = random_basis(n, g)
        check[n] = best_seconds(lambda basis=basis: check_orthonormal(basis, "basis"), repeats)
        digest[n] = best_seconds(
            lambda basis=basis: hashlib.sha256(memoryview(basis.numpy()).cast("B")).digest(), repeats
        )
        print(f"  side {n}: full check {check[n] * 1e3:7.1f} ms ({2 * n ** 3 / check[n] / 1e9:5.1f} GFLOP/s), "
              f"sha256 of the {n * n * 4 / 1e6:.0f} MB tensor {digest[n] * 1e3:5.1f} ms")
    first = LAYERS * sum(count * check[n] for n, count in SIDES_PER_LAYER.items())
    again = LAYERS * sum(count * digest[n] for n, count in SIDES_PER_LAYER.items())
    sides = LAYERS * sum(SIDES_PER_LAYER.values())
    print(
        f"0.6B KFAC cache ({sides} full sides, each a distinct basis): the first merge on a machine checks every "
        f"side in full, {first:.1f} s (+ {again:.1f} s of sha256); every later merge reads each side once and matches "
        f"its sha256 against the record of bases that passed: {again:.1f} s"
    )


def write_kfac_cache(workdir: Path) -> Path:
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


RHO = 0.001


def kfac_config(fisher: str = "fisher-kfac", rho: float = RHO) -> str:
    """The graft config template (``{w}``: the workdir) with a global KFAC mask from ``fisher`` at ``rho``."""
    return CONFIGS["graft rho=0.01 global diag"].replace("rho: 0.01", f"rho: {rho!r}").replace("fisher-diag", fisher)


KFAC_CONFIG = kfac_config()


def compact_cache(workdir: Path, rank: int) -> tuple[Path, dict[str, list[int] | None]]:
    """``fisher-kfac-r<K>`` (written once) and the kept eigenvector indices of each side key."""

    path, kept_file = workdir / f"fisher-kfac-r{rank}", workdir / f"fisher-kfac-r{rank}.kept.json"
    if not (path.exists() and kept_file.exists()):
        shutil.rmtree(path, ignore_errors=True)
        print(f"fisher compress --rank {rank} ...", flush=True)
        result = compress_cache(workdir / "fisher-kfac", path, rank, progress=False)
        kept = {key: None if side.kept_indices is None else side.kept_indices.tolist()
                for key, side in result.sides.items()}
        kept_file.write_text(json.dumps(kept))
    return path, json.loads(kept_file.read_text())


def kept_masks(workdir: Path, fisher: str, rho: float):
    """(inputs, flat mask positions of every ranked tensor) of a fresh threshold pass."""

    text = kfac_config(fisher, rho).format(w=workdir.resolve())
    inputs = GraftInputs.open(plan_from_merge_config(MergeConfiguration.model_validate(yaml.safe_load(text))))
    with tempfile.TemporaryDirectory(dir=workdir) as scratch:
        store = RotationStore(scratch)
        compute_global_threshold(inputs, progress=False, rotations=store)
        return inputs, {name: store.masked_positions(name) for name in inputs.ranked_names()}


def matched_overlap(full, compact, kept: dict) -> tuple[float, int, int]:
    """(|M_K ∩ M_full| / |M_full|, |M_full|, |M_K|) with compact pairs mapped to the full basis's pairs."""
    (full_inputs, full_masks), (compact_inputs, compact_masks) = full, compact
    both = 0
    for name, positions in full_masks.items():
        other = compact_masks[name]
        if full_inputs.fisher_kind(name) == "kfac":
            width = full_inputs.post.tensors[name].shape[1]
            entry = compact_inputs.fisher.entries[name]["kfac"]
            rows, columns = (kept[entry[side]] for side in ("rows", "columns"))
            compact_width = len(columns) if columns is not None else width
            r, c = torch.div(other, compact_width, rounding_mode="floor"), other % compact_width
            r = torch.tensor(rows)[r] if rows is not None else r
            c = torch.tensor(columns)[c] if columns is not None else c
            other = r * width + c
        both += int(torch.isin(other, positions).sum())
    full_count = sum(p.numel() for p in full_masks.values())
    return both / max(1, full_count), full_count, sum(p.numel() for p in compact_masks.values())


def choose_rank(workdir: Path, ranks: list[int]) -> tuple[int, float] | None:
    """The smallest K of ``ranks`` whose mask overlap at the same masked count is ≥ 0.99, and its ρ_K."""
    full = kept_masks(workdir, "fisher-kfac", RHO)
    total = sum(full[0].direction_count(name) for name in full[0].ranked_names())
    k = sum(p.numel() for p in full[1].values())
    print(f"full-rank cache: D = {total:,} ranked directions, ρ = {RHO} masks {k:,}")
    for rank in sorted(ranks):
        path, kept = compact_cache(workdir, rank)
        probe = kept_masks(workdir, path.name, 0.5)[0]
        compact_total = sum(probe.direction_count(name) for name in probe.ranked_names())
        rho = k / compact_total
        overlap, _, masked = matched_overlap(full, kept_masks(workdir, path.name, rho), kept)
        same_rho = matched_overlap(full, kept_masks(workdir, path.name, RHO), kept)[0]
        print(f"  K = {rank}: D = {compact_total:,}, ρ_K = {rho:.6g} masks {masked:,}: overlap {overlap:.4f} "
              f"(at the same ρ = {RHO}: {same_rho:.4f})", flush=True)
        if overlap >= 0.99:
            return rank, rho
    return None


def timed_runs(workdir: Path, configs: dict[str, str], repeats: int, user_cache: Path) -> dict[str, list[float]]:
    """Fresh `mergekit-yaml` runs, interleaved: each computes its threshold, the orthonormality record persists."""
    env = {"GRAFTMERGE_CACHE_DIR": str(user_cache), "GRAFTMERGE_NO_THRESHOLD_CACHE": "1"}
    walls: dict[str, list[float]] = {name: [] for name in configs}
    for repeat in range(repeats):
        for name, template in configs.items():
            config_file = workdir / "bench.yml"
            config_file.write_text(template.format(w=workdir.resolve()))
            shutil.rmtree(workdir / "out", ignore_errors=True)
            wall, rss = timed_run([str(BIN / "mergekit-yaml"), str(config_file), str(workdir / "out"),
                                   "--out-shard-size", "500M"], env=env)
            shutil.rmtree(workdir / "out", ignore_errors=True)
            walls[name].append(wall)
            print(f"  run {repeat + 1} {name:34s} {wall:7.1f} s  {rss:8.0f} MB", flush=True)
    return walls


def rotation_flops(inputs: GraftInputs) -> int:
    """FLOPs of one Δ̃ = Uᵀ Δ V per KFAC weight (2·r·m·n, then 2·r·n·r'), summed over the model."""
    total = 0
    for name in inputs.ranked_names():
        if inputs.fisher_kind(name) != "kfac":
            continue
        m, n = inputs.post.tensors[name].shape
        rows, columns = (inputs.fisher.kfac_side(name, side) for side in ("rows", "columns"))
        rows_rank = side_rank(rows) if "eigenvectors" in rows else None  # None: identity basis, nothing to multiply
        if rows_rank is not None:
            total += 2 * rows_rank * m * n
        if "eigenvectors" in columns:
            total += 2 * (rows_rank or m) * n * side_rank(columns)
    return total


def count_and_floor(workdir: Path, user_cache: Path, configs: dict[str, str], matmul_flops: float) -> None:
    """One in-process merge per KFAC config, threshold pass included: Δ̃ computations per KFAC
    weight, and the matmul floor (the rotations' FLOPs at this machine's matmul speed) ÷ the wall.

    Counted, not profiled: the threshold pass scores in a background thread, which
    torch.profiler does not record from the main thread.
    """
    import_hook.install()
    os.environ["GRAFTMERGE_CACHE_DIR"] = str(user_cache)
    os.environ["GRAFTMERGE_NO_THRESHOLD_CACHE"] = "1"  # time the pass too
    for label, template in configs.items():
        config = MergeConfiguration.model_validate(yaml.safe_load(template.format(w=workdir.resolve())))
        inputs = GraftInputs.open(plan_from_merge_config(config))
        weights = sum(1 for name in inputs.ranked_names() if inputs.fisher_kind(name) == "kfac")
        flops = rotation_flops(inputs)
        out = workdir / "out-count"
        shutil.rmtree(out, ignore_errors=True)
        KFAC_ROTATIONS.clear()
        start = time.perf_counter()
        run_merge(config, str(out), options=MergeOptions(quiet=True, out_shard_size=500_000_000))
        wall = time.perf_counter() - start
        shutil.rmtree(out, ignore_errors=True)
        floor = flops / matmul_flops
        print(f"{label}, in process: {wall:.1f} s; Δ̃ computations {sum(KFAC_ROTATIONS.values()) / weights:.2f} per "
              f"KFAC weight; rotations {flops / 1e12:.2f} TFLOP = {floor:.1f} s at {matmul_flops / 1e9:.0f} GFLOP/s "
              f"({100 * floor / wall:.0f} % of the wall)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("bench-work"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", default="256,512,768,1024", help="candidate K for the compact cache")
    parser.add_argument("--small", action="store_true", help="a 4-layer, 32k-vocab model for a quick look")
    parser.add_argument("--skip-model", action="store_true", help="only the single-weight projection")
    parser.add_argument("--orthonormal-only", action="store_true", help="only the orthonormality check on read")
    parser.add_argument("--cold", action="store_true", help="also time one merge with an empty orthonormality record")
    args = parser.parse_args()
    print(f"full orthonormality check on read (threads {torch.get_num_threads()}, best of {args.repeats}):")
    orthonormal_check_benchmark(args.repeats)
    if args.orthonormal_only:
        return
    matmul_flops = projection_benchmark()
    if args.skip_model:
        return
    user_cache = args.workdir.resolve() / "user-cache"  # the record of checked bases lives here, not in ~/.cache
    os.environ["GRAFTMERGE_CACHE_DIR"] = str(user_cache)
    overrides = dict(num_hidden_layers=4, vocab_size=32768) if args.small else {}
    build_inputs(args.workdir, qwen3_config(**overrides), with_fisher=False)
    write_kfac_cache(args.workdir)
    chosen = choose_rank(args.workdir, [int(k) for k in args.ranks.split(",")])
    configs = {"task_arithmetic": CONFIGS["task_arithmetic"], f"graft rho={RHO} global KFAC": kfac_config()}
    if chosen is not None:
        configs[f"graft KFAC rank {chosen[0]} (rho_K {chosen[1]:.4g})"] = kfac_config(
            f"fisher-kfac-r{chosen[0]}", chosen[1]
        )
    else:
        print(f"no K in {args.ranks} reaches a mask overlap of 0.99; the compact cache is not timed")
    timed_runs(args.workdir, {name: c for name, c in configs.items() if "KFAC" in name}, 1, user_cache)  # warm-up
    if args.cold:
        cold = args.workdir.resolve() / "user-cache-cold"
        shutil.rmtree(cold, ignore_errors=True)
        timed_runs(args.workdir, {"cold record (every basis checked)": kfac_config()}, 1, cold)
        shutil.rmtree(cold, ignore_errors=True)
    walls = timed_runs(args.workdir, configs, args.repeats, user_cache)
    ta = statistics.median(walls["task_arithmetic"])
    print(f"\nmedians of {args.repeats} (interleaved; spread = min–max ÷ task_arithmetic's median):")
    for name, values in walls.items():
        print(f"  {name:40s} {statistics.median(values):7.1f} s  ÷ TA {statistics.median(values) / ta:5.2f} "
              f"(runs {min(values) / ta:.2f}–{max(values) / ta:.2f})")
    count_and_floor(args.workdir, user_cache, {name: c for name, c in configs.items() if "KFAC" in name}, matmul_flops)


if __name__ == "__main__":
    main()
