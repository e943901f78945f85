"""Every merge path against what this machine can do: a minimal streaming graft, cat/cp, FLOPs (issue 39).

For the same inputs and the same output (bench_graft.py's Qwen3-shaped bf16 trio), fresh
processes, interleaved, medians of --repeats:

  (a) ``--minimal``: a graft at ρ = 0 with no checks, written for speed: bf16 spans read from
      the mmapped shards, computed in cache-sized float32 spans with reused buffers, written
      as bf16 shards, on one thread (OMP_NUM_THREADS to change it).
      The script asserts it writes the same bits as graftmerge's ρ = 0 graft.
  (b) ``cat`` of the three inputs plus ``cp`` of one model folder (the bytes alone).
  (c) mergekit's ``task_arithmetic``.
  (d) graftmerge through ``mergekit-yaml``: ρ = 0, global diagonal ρ = 0.01, full-rank KFAC,
      rank-512 KFAC (ρ = 0.001), a LoRA adapter as ``role: delta``, and the ``fisher`` merge.

Each path also gets its own floor: (a), plus reading its Fisher cache once (``cat``), plus its
matmuls (rotations Uᵀ Δ V, or B·A of the LoRA) at this machine's sgemm rate, measured in the
same run. The load average is printed with every figure (the machine may be shared).

    python benchmarks/bench_floor.py --workdir bench-work [--repeats 3] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

SPAN = 1 << 18  # float32 elements per span: two 1 MiB buffers stay in L2


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        return 8 + size, json.loads(handle.read(size))


def minimal_graft(post: Path, donor: Path, fine_tune: Path, out: Path, lam: float) -> None:
    """bf16(θpost + λ(θft − θdonor)), per span, each post shard written with post's own header."""
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    maps = {}

    def tensor(folder: Path, name: str) -> torch.Tensor:
        file = folder / index[folder][name]
        if file not in maps:
            start, header = _header(file)
            maps[file] = (np.memmap(file, dtype=np.uint8, mode="r"), start, header)
        data, start, header = maps[file]
        begin, end = header[name]["data_offsets"]
        return torch.from_numpy(data[start + begin : start + end]).view(torch.bfloat16)

    index = {f: json.loads((f / "model.safetensors.index.json").read_text())["weight_map"]
             for f in (post, donor, fine_tune)}
    a, b = torch.empty(SPAN), torch.empty(SPAN)
    written = torch.empty(SPAN, dtype=torch.bfloat16)
    out.mkdir(parents=True)
    for item in (post / "config.json", post / "model.safetensors.index.json"):
        shutil.copyfile(item, out / item.name)
    for shard in sorted(set(index[post].values())):
        start, header = _header(post / shard)
        names = sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])
        with open(post / shard, "rb") as source, open(out / shard, "wb") as sink:
            sink.write(source.read(start))
            for name in names:
                p, d, f = tensor(post, name), tensor(donor, name), tensor(fine_tune, name)
                for lo in range(0, p.numel(), SPAN):
                    n = min(SPAN, p.numel() - lo)
                    x, y = a[:n], b[:n]
                    x.copy_(f[lo : lo + n])
                    y.copy_(d[lo : lo + n])
                    x.sub_(y).mul_(lam)
                    y.copy_(p[lo : lo + n])
                    x.add_(y)
                    written[:n].copy_(x)
                    sink.write(written[:n].view(torch.uint8).numpy().tobytes())


if __name__ == "__main__" and sys.argv[1:2] == ["--minimal"]:  # the child of (a): torch and numpy only
    if not os.environ.get("OMP_NUM_THREADS"):
        # One thread: the spans are memory-bound, and on a shared 2-core machine a second
        # thread waits for a descheduled partner at every op (4.1 s against 2.5 s, load 7).
        torch.set_num_threads(1)
    minimal_graft(*map(Path, sys.argv[2:6]), float(sys.argv[6]))
    sys.exit(0)

import yaml  # noqa: E402 - the minimal child above imports nothing else
from bench_graft import CONFIGS, GRAFT, build_inputs  # noqa: E402
from bench_kfac import compact_cache, rotation_flops, write_kfac_cache  # noqa: E402
from bench_lora import RANK, graft_config, write_adapter  # noqa: E402
from common import BIN, median, qwen3_config, timed_run  # noqa: E402
from mergekit.config import MergeConfiguration  # noqa: E402
from safetensors import safe_open  # noqa: E402

from graftmerge.formats.checkpoint import Checkpoint  # noqa: E402
from graftmerge.formats.fisher_cache import FisherCacheWriter  # noqa: E402
from graftmerge.pipeline.graft_plan import GraftInputs, plan_from_merge_config  # noqa: E402

LAMBDA = 0.5  # bench_graft's donor_ft weight
FISHER = """merge_method: fisher
models:
  - model: {w}/post
    parameters: {{fisher: {w}/fisher-diag, weight: 1.0}}
  - model: {w}/base-ft
    parameters: {{fisher: {w}/fisher-diag-ft, weight: 1.0}}
dtype: float32
out_dtype: bfloat16
"""
KFAC = GRAFT.format(parameters="parameters:\n  rho: 0.001\n  fisher: {w}/FISHER\n")
PATHS = {
    "task_arithmetic": CONFIGS["task_arithmetic"],
    "graft ρ=0": CONFIGS["graft rho=0"],
    "graft ρ=0.01 diagonal": CONFIGS["graft rho=0.01 global diag"],
    "graft ρ=0.001 KFAC full": KFAC.replace("FISHER", "fisher-kfac"),
    "graft ρ=0.001 KFAC r512": KFAC.replace("FISHER", "fisher-kfac-r512"),
    "graft LoRA ρ=0": graft_config("adapter", ""),
    "fisher": FISHER,
}
CACHE = {"graft ρ=0.01 diagonal": ["fisher-diag"], "graft ρ=0.001 KFAC full": ["fisher-kfac"],
         "graft ρ=0.001 KFAC r512": ["fisher-kfac-r512"], "fisher": ["fisher-diag", "fisher-diag-ft"]}


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def sgemm_rate(size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of one float32 size² matmul (best of ``repeats``), with the threads merges get."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def files(workdir: Path, folder: str) -> list[str]:
    return sorted(str(p) for p in (workdir / folder).iterdir() if p.is_file())


def cat_seconds(paths: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(["cat", *paths], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def io_bytes(workdir: Path, out: Path) -> float:
    """(b): cat of the three inputs, cp of the post folder to ``out``."""
    start = time.perf_counter()
    subprocess.run(["cat", *(f for m in ("post", "base", "base-ft") for f in files(workdir, m))],
                   stdout=subprocess.DEVNULL, check=True)
    subprocess.run(["cp", "-r", str(workdir / "post"), str(out)], check=True)
    return time.perf_counter() - start


def same_bits(graft_out: Path, minimal_out: Path) -> None:
    """Assert every tensor graftmerge wrote is, bit for bit, the minimal graft's of the same name."""
    ours = {}
    for file in minimal_out.glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            ours.update({k: handle.get_tensor(k) for k in handle.keys()})  # noqa: SIM118
    seen = set()
    for file in graft_out.glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118
                theirs = handle.get_tensor(key)
                assert theirs.dtype == ours[key].dtype and torch.equal(theirs.view(torch.int16),
                                                                       ours[key].view(torch.int16)), key
                seen.add(key)
    assert seen == set(ours), sorted(set(ours) ^ seen)[:3]
    print(f"minimal graft writes the same bits as graft ρ=0 ({len(seen)} tensors)", flush=True)


def build(workdir: Path, config, kfac: bool) -> None:
    build_inputs(workdir, config)
    if kfac:
        write_kfac_cache(workdir)
        compact_cache(workdir, 512)
    write_adapter(workdir)
    if not (workdir / "fisher-diag-ft").exists():
        generator = torch.Generator().manual_seed(3)
        with FisherCacheWriter(workdir / "fisher-diag-ft", model=workdir / "base-ft",
                               max_shard_bytes=500_000_000) as writer:
            for name, info in Checkpoint(workdir / "base-ft").tensors.items():
                writer.add_diagonal(name, torch.rand(info.shape, generator=generator) ** 4)


def matmul_flops(workdir: Path) -> dict[str, int]:
    """The matmul FLOPs each path cannot avoid: KFAC rotations, the LoRA's B·A."""
    flops = {}
    for label in (k for k in PATHS if "KFAC" in k):
        config = MergeConfiguration.model_validate(yaml.safe_load(PATHS[label].format(w=workdir.resolve())))
        flops[label] = rotation_flops(GraftInputs.open(plan_from_merge_config(config)))
    with safe_open(str(workdir / "adapter" / "adapter_model.safetensors"), "pt") as handle:
        shapes = {k: handle.get_slice(k).get_shape() for k in handle.keys()}  # noqa: SIM118
    flops["graft LoRA ρ=0"] = sum(2 * s[0] * s[1] * RANK for k, s in shapes.items() if "lora_B" in k)
    return flops


def one_round(workdir: Path, times: dict, rss: dict, check_bits: bool) -> None:
    out, env = workdir / "out", {"GRAFTMERGE_CACHE_DIR": str(workdir / "user-cache"),
                                 "GRAFTMERGE_NO_THRESHOLD_CACHE": "1"}
    w = workdir
    shutil.rmtree(w / "minimal-out", ignore_errors=True)
    wall, peak = timed_run([sys.executable, __file__, "--minimal", str(w / "post"), str(w / "base"),
                            str(w / "base-ft"), str(w / "minimal-out"), str(LAMBDA)])
    times["(a) minimal graft"].append(wall)
    rss["(a) minimal graft"].append(peak)
    times["(b) cat inputs + cp"].append(io_bytes(workdir, out))
    shutil.rmtree(out)
    for cache in {c for label in PATHS for c in CACHE.get(label, ())}:
        times[f"cat {cache}"].append(cat_seconds(files(workdir, cache)))
    for label, template in PATHS.items():
        (workdir / "bench.yml").write_text(template.format(w=workdir.resolve()))
        wall, peak = timed_run([str(BIN / "mergekit-yaml"), str(workdir / "bench.yml"), str(out),
                                "--out-shard-size", "500M"], env=env)
        times[label].append(wall)
        rss[label].append(peak)
        if check_bits and label == "graft ρ=0":
            same_bits(out, workdir / "minimal-out")
        shutil.rmtree(out)
        print(f"  {label:26s} {wall:7.1f} s {peak:7.0f} MB  (load {load()})", flush=True)
    shutil.rmtree(workdir / "minimal-out")


def report(times: dict, rss: dict, flops: dict, rate: float, repeats: int) -> None:
    t = {k: median(v) for k, v in times.items()}
    minimal, ta = t["(a) minimal graft"], t["task_arithmetic"]
    ta_rss = median(rss["task_arithmetic"])
    print(f"\nmedians of {repeats}; sgemm {rate / 1e9:.0f} GFLOP/s; load at end {load()}")
    print("| path | wall s | ÷ (a) | its floor s | ÷ its floor | ÷ task_arithmetic | peak RSS MB | RSS ÷ TA |")
    print("|---|---|---|---|---|---|---|---|")
    for label in ("(a) minimal graft", "(b) cat inputs + cp", *PATHS):
        floor = minimal + sum(t[f"cat {c}"] for c in CACHE.get(label, ())) + flops.get(label, 0) / rate
        memory = median(rss[label]) if label in rss else float("nan")
        print(f"| {label} | {t[label]:.2f} | {t[label] / minimal:.2f} | {floor:.2f} | {t[label] / floor:.2f} | "
              f"{t[label] / ta:.2f} | {memory:.0f} | {memory / ta_rss:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("bench-work"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a 4-layer, 32k-vocab model for a quick look")
    parser.add_argument("--skip-kfac", action="store_true", help="no KFAC paths (their cache takes long to write)")
    args = parser.parse_args()
    if args.skip_kfac:
        for label in [k for k in PATHS if "KFAC" in k]:
            del PATHS[label]
    config = qwen3_config(**(dict(num_hidden_layers=4, vocab_size=32768) if args.small else {}))
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(f"building inputs in {args.workdir} ... (load {load()})", flush=True)
    build(args.workdir, config, kfac=not args.skip_kfac)
    params = sum(info.numel for info in Checkpoint(args.workdir / "post").tensors.values())
    rate, flops = sgemm_rate(), matmul_flops(args.workdir)
    print(f"model {params / 1e9:.3f}B bf16; torch threads {torch.get_num_threads()}; sgemm {rate / 1e9:.0f} GFLOP/s; "
          f"matmul floors " + ", ".join(f"{k}: {v / 1e12:.3f} TFLOP" for k, v in flops.items()), flush=True)
    labels = ["(a) minimal graft", "(b) cat inputs + cp", *PATHS,
              *(f"cat {c}" for label in PATHS for c in CACHE.get(label, ()))]
    times, rss = {k: [] for k in labels}, {k: [] for k in ("(a) minimal graft", *PATHS)}
    for repeat in range(args.repeats):
        print(f"round {repeat + 1} (load {load()})", flush=True)
        one_round(args.workdir, times, rss, check_bits=repeat == 0)
    rate = max(rate, sgemm_rate())  # measured again after the runs: the better of the two
    report(times, rss, flops, rate, args.repeats)


if __name__ == "__main__":
    main()
