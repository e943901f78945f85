"""`graftmerge sweep` over a 3×3 (λ, ρ) grid vs 9 separate `mergekit-yaml` runs (CPU).

Generated Qwen3-shaped bf16 checkpoints (post, base, base-ft) and a diagonal Fisher
cache; global diagonal mask; `dtype: float32`, `out_dtype: bfloat16`,
`--out-shard-size 500M`. Every run is a fresh process with an empty threshold cache
(so each separate run does its own threshold pass, as a first run would). Prints wall
time and peak RSS of both, their ratio, and checks that the outputs are bit-identical.

    python benchmarks/bench_sweep.py --workdir bench-work [--small] [--repeats 1]
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("bench-work"))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--small", action="store_true", help="a 4-layer, 32k-vocab model for a quick look")
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
    sweep_walls, sweep_rss, separate_walls, separate_rss = [], [], [], []
    for repeat in range(args.repeats):
        for folder in ("sweep-out", "separate-out", "caches"):
            shutil.rmtree(w / folder, ignore_errors=True)
        wall, rss = timed_run(
            [str(BIN / "graftmerge"), "sweep", str(w / "sweep.yml"), "--lambda", ",".join(map(str, LAMBDAS)),
             "--rho", ",".join(map(str, RHOS)), "-o", str(w / "sweep-out"), "--out-shard-size", "500M"],
            env={"GRAFTMERGE_CACHE_DIR": str(w / "caches" / "sweep")})
        sweep_walls.append(wall)
        sweep_rss.append(rss)
        total, peak = 0.0, 0.0
        for lam in LAMBDAS:
            for rho in RHOS:
                yml = w / f"single-{lam}-{rho}.yml"
                yml.write_text(CONFIG.format(w=w, lam=lam, rho=rho))
                out = w / "separate-out" / f"lambda-{lam!r}_rho-{rho!r}"
                run_wall, run_rss = timed_run(
                    [str(BIN / "mergekit-yaml"), str(yml), str(out), "--out-shard-size", "500M"],
                    env={"GRAFTMERGE_CACHE_DIR": str(w / "caches" / f"{lam}-{rho}")})
                total += run_wall
                peak = max(peak, run_rss)
        separate_walls.append(total)
        separate_rss.append(peak)
        print(f"repeat {repeat + 1}: sweep {wall:.1f} s, 9 × mergekit-yaml {total:.1f} s", flush=True)
    identical = all(same_tensors(w / "sweep-out" / f"lambda-{lam!r}_rho-{rho!r}",
                                 w / "separate-out" / f"lambda-{lam!r}_rho-{rho!r}") for lam in LAMBDAS for rho in RHOS)
    sweep_wall, separate_wall = median(sweep_walls), median(separate_walls)
    print(f"\nmedians of {args.repeats}")
    print(f"{'run':34s} {'wall s':>8s} {'peak RSS MB':>12s}")
    print(f"{'graftmerge sweep (9 models)':34s} {sweep_wall:8.1f} {median(sweep_rss):12.0f}")
    print(f"{'9 separate mergekit-yaml runs':34s} {separate_wall:8.1f} {median(separate_rss):12.0f}")
    print(f"sweep ÷ separate: {sweep_wall / separate_wall:.2f} (speed-up {separate_wall / sweep_wall:.2f}×); "
          f"outputs bit-identical: {identical}")


if __name__ == "__main__":
    main()
