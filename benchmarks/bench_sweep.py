"""`graftmerge sweep` over a 3×3 (λ, ρ) grid vs 9 separate `mergekit-yaml` runs (CPU).

Generated Qwen3-shaped bf16 checkpoints (post, base, base-ft) and a diagonal Fisher
cache; global diagonal mask; `dtype: float32`, `out_dtype: bfloat16`,
`--out-shard-size 500M`. Every run is a fresh process with an empty threshold cache
(so each separate run does its own threshold pass, as a first run would). Per repeat:
the sweep, then the 9 single merges; prints wall and peak RSS of the sweep, of the
largest single merge and of the 9 together, the two ratios the sweep is judged by
(peak RSS ÷ the largest single merge; wall ÷ the 9 separate runs) with their spread over
the repeats, and checks that every output is bit-identical (tensors, config, shard files,
index). ``--scaling`` adds sweeps of a 1×1 and a 5×5 grid, to show peak RSS does not grow
with the grid. Each separate output is compared and deleted at once (disk).

    python benchmarks/bench_sweep.py --workdir bench-work [--small] [--repeats 3] [--scaling]
"""

from __future__ import annotations

import argparse
import filecmp
import resource
import shutil
from pathlib import Path

import torch
from bench_graft import build_inputs
from common import BIN, median, qwen3_config, timed_run

LAMBDAS = (0.25, 0.5, 1.0)
RHOS = (0.0, 0.001, 0.01)
CONFIG = """merge_method: graft
base_model: {w}/post
models:
  - model: {w}/base
    parameters: {{role: donor}}
  - model: {w}/base-ft
    parameters: {{role: donor_ft}}
parameters:
  lambda: {lam}
  rho: {rho}
  fisher: {w}/fisher-diag
dtype: float32
out_dtype: bfloat16
"""


def same_tensors(a: Path, b: Path) -> bool:
    from graftmerge.formats.checkpoint import Checkpoint

    left, right = Checkpoint(a), Checkpoint(b)
    if left.tensors.keys() != right.tensors.keys():
        return False
    return all(left.read(n).view(torch.uint8).equal(right.read(n).view(torch.uint8)) for n in left.tensors)


def same_files(a: Path, b: Path) -> bool:
    """Every shard, the index and config.json byte for byte (README.md and mergekit_config.yml name the run)."""
    names = {p.name for p in a.iterdir()} - {"README.md", "mergekit_config.yml"}
    if names != {p.name for p in b.iterdir()} - {"README.md", "mergekit_config.yml"}:
        return False
    return all(filecmp.cmp(a / name, b / name, shallow=False) for name in names)


def measured(command: list[str], env: dict) -> tuple[float, float, float]:
    """(wall s, peak RSS MB, CPU s) of one process: CPU time is the steadier number on a shared machine."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall, rss = timed_run(command, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, rss, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def sweep(w: Path, lambdas, rhos, out: Path) -> tuple[float, float, float]:
    """(wall s, peak RSS MB, CPU s) of one `graftmerge sweep` process with an empty threshold cache."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(w / "caches", ignore_errors=True)
    return measured(
        [str(BIN / "graftmerge"), "sweep", str(w / "sweep.yml"), "--lambda", ",".join(map(str, lambdas)),
         "--rho", ",".join(map(str, rhos)), "-o", str(out), "--out-shard-size", "500M"],
        env={"GRAFTMERGE_CACHE_DIR": str(w / "caches" / "sweep")})


def separate_runs(w: Path) -> tuple[list[float], list[float], list[float], bool]:
    """Walls, peak RSS and CPU of the 9 single merges; whether each equals its sweep folder (then deleted)."""
    walls, peaks, cpus, identical = [], [], [], True
    for lam in LAMBDAS:
        for rho in RHOS:
            yml = w / f"single-{lam}-{rho}.yml"
            yml.write_text(CONFIG.format(w=w, lam=lam, rho=rho))
            out = w / "separate-out" / f"lambda-{lam!r}_rho-{rho!r}"
            shutil.rmtree(out, ignore_errors=True)
            wall, rss, cpu = measured([str(BIN / "mergekit-yaml"), str(yml), str(out), "--out-shard-size", "500M"],
                                      env={"GRAFTMERGE_CACHE_DIR": str(w / "caches" / f"{lam}-{rho}")})
            walls.append(wall)
            peaks.append(rss)
            cpus.append(cpu)
            mine = w / "sweep-out" / out.name
            tensors, files = same_tensors(mine, out), same_files(mine, out)
            if not (tensors and files):
                print(f"  {out.name}: sweep output differs ({'files' if tensors else 'tensors'})", flush=True)
            identical = identical and tensors and files
            shutil.rmtree(out)
    return walls, peaks, cpus, identical


def spread(values: list[float]) -> str:
    return f"{median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("bench-work"))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--small", action="store_true", help="a 4-layer, 32k-vocab model for a quick look")
    parser.add_argument("--scaling", action="store_true", help="also sweep a 1×1 and a 5×5 grid (peak RSS)")
    args = parser.parse_args()
    w = args.workdir.resolve()
    config = qwen3_config(**(dict(num_hidden_layers=4, vocab_size=32768) if args.small else {}))
    w.mkdir(parents=True, exist_ok=True)
    print(f"building inputs in {w} ...", flush=True)
    build_inputs(w, config)
    from graftmerge.formats.checkpoint import Checkpoint

    params = sum(info.numel for info in Checkpoint(w / "post").tensors.values())
    print(f"model: {params / 1e9:.3f}B parameters, bf16; grid λ {LAMBDAS} × ρ {RHOS}; "
          f"torch threads {torch.get_num_threads()}", flush=True)
    (w / "sweep.yml").write_text(CONFIG.format(w=w, lam=1.0, rho=0.01))
    rows = {"sweep": [], "single": [], "separate": []}
    rss_ratios, wall_ratios, cpu_ratios, identical = [], [], [], True
    for repeat in range(args.repeats):
        wall, rss, cpu = sweep(w, LAMBDAS, RHOS, w / "sweep-out")
        walls, peaks, cpus, same = separate_runs(w)
        identical = identical and same
        rows["sweep"].append((wall, rss, cpu))
        rows["single"].append((median(walls), max(peaks), median(cpus)))
        rows["separate"].append((sum(walls), max(peaks), sum(cpus)))
        rss_ratios.append(rss / max(peaks))
        wall_ratios.append(wall / sum(walls))
        cpu_ratios.append(cpu / sum(cpus))
        print(f"repeat {repeat + 1}: sweep {wall:.1f} s {rss:.0f} MB; 9 × mergekit-yaml {sum(walls):.1f} s, "
              f"largest {max(peaks):.0f} MB", flush=True)
    shutil.rmtree(w / "sweep-out", ignore_errors=True)
    print(f"\nmedians of {args.repeats} (the machine may be shared: read the ratios, not the seconds)")
    print(f"{'run':44s} {'wall s':>8s} {'peak RSS MB':>12s} {'CPU s':>8s}")
    for label, key in (("graftmerge sweep (9 models)", "sweep"), ("one mergekit-yaml (median; RSS: the largest)",
                       "single"), ("9 separate mergekit-yaml runs", "separate")):
        wall, rss, cpu = (median([r[i] for r in rows[key]]) for i in range(3))
        print(f"{label:44s} {wall:8.1f} {rss:12.0f} {cpu:8.1f}")
    print(f"sweep peak RSS ÷ largest single merge: {spread(rss_ratios)}")
    print(f"sweep wall ÷ 9 separate runs:          {spread(wall_ratios)}")
    print(f"sweep CPU ÷ 9 separate runs:           {spread(cpu_ratios)}")
    print(f"outputs bit-identical (tensors, shards, index, config): {identical}")
    if args.scaling:
        for lambdas, rhos in (((1.0,), (0.01,)), ((0.25, 0.5, 0.75, 1.0, 1.25), (0.0, 0.001, 0.003, 0.01, 0.03))):
            scaling(w, lambdas, rhos)


def scaling(w: Path, lambdas, rhos) -> None:
    """Peak RSS of a sweep of another grid ÷ the largest single merge of that grid (one per ρ, at the largest λ:
    a merge's peak moves with ρ, hardly with λ)."""
    wall, rss, _ = sweep(w, lambdas, rhos, w / "scaling-out")
    shutil.rmtree(w / "scaling-out", ignore_errors=True)
    peaks = []
    for rho in rhos:
        yml = w / f"scaling-{rho}.yml"
        yml.write_text(CONFIG.format(w=w, lam=max(lambdas), rho=rho))
        shutil.rmtree(w / "scaling-single", ignore_errors=True)
        peaks.append(measured([str(BIN / "mergekit-yaml"), str(yml), str(w / "scaling-single"), "--out-shard-size",
                               "500M"], env={"GRAFTMERGE_CACHE_DIR": str(w / "caches" / f"scaling-{rho}")})[1])
    shutil.rmtree(w / "scaling-single", ignore_errors=True)
    print(f"sweep of {len(lambdas)}×{len(rhos)}: {wall:.1f} s, peak RSS {rss:.0f} MB; largest single merge "
          f"{max(peaks):.0f} MB; ratio {rss / max(peaks):.2f}", flush=True)


if __name__ == "__main__":
    main()
