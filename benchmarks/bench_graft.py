"""Whole-model graft vs mergekit's task_arithmetic on a ~0.75B Qwen3-shaped checkpoint (CPU).

Measured side by side in one run, medians of --repeats:
  * wall time and peak RSS of `mergekit-yaml` for task_arithmetic, graft rho 0,
    graft rho 0.01 with the global diagonal mask (threshold pass included: its
    result cache is cleared before every run);
  * the IO floor: reading every input tensor and writing the output once.

    python benchmarks/bench_graft.py --workdir bench-work [--repeats 3] [--small]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from common import median, qwen3_config, time_merges, write_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.fisher_cache import FisherCacheWriter


def build_inputs(workdir: Path, config, with_fisher: bool = True) -> None:
    generator = torch.Generator().manual_seed(0)
    if not (workdir / "base").exists():
        write_checkpoint(workdir / "base", config, lambda n, s: torch.randn(s, generator=generator) * 0.02)
    base = None

    def derived(scale: float):
        def make(name, shape):
            nonlocal base
            with safe_open(str(workdir / "base" / _shard_of(workdir / "base", name)), "pt") as f:
                base = f.get_tensor(name).float()
            return base + torch.randn(shape, generator=generator) * scale
        return make

    for name, scale in (("post", 0.004), ("base-ft", 0.002)):
        if not (workdir / name).exists():
            write_checkpoint(workdir / name, config, derived(scale))
    if with_fisher and not (workdir / "fisher-diag").exists():
        post = Checkpoint(workdir / "post")
        with FisherCacheWriter(workdir / "fisher-diag", model=workdir / "post", max_shard_bytes=500_000_000) as w:
            for tensor_name, info in post.tensors.items():
                w.add_diagonal(tensor_name, torch.rand(info.shape, generator=generator) ** 4)


def _shard_of(folder: Path, name: str) -> str:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]


GRAFT = """merge_method: graft
base_model: {{w}}/post
models:
  - model: {{w}}/base
    parameters: {{{{role: donor}}}}
  - model: {{w}}/base-ft
    parameters: {{{{role: donor_ft, weight: 0.5}}}}
{parameters}dtype: float32
out_dtype: bfloat16
"""

CONFIGS = {
    "task_arithmetic": """merge_method: task_arithmetic
base_model: {w}/base
models:
  - model: {w}/post
    parameters: {{weight: 1.0}}
  - model: {w}/base-ft
    parameters: {{weight: 0.5}}
parameters: {{normalize: false}}
dtype: float32
out_dtype: bfloat16
""",
    "graft rho=0": GRAFT.format(parameters=""),
    "graft rho=0.01 global diag": GRAFT.format(parameters="parameters:\n  rho: 0.01\n  fisher: {w}/fisher-diag\n"),
}


def io_floor(workdir: Path, folders: list[str], out: Path) -> float:
    """Seconds to read every input tensor of ``folders`` once and write one bf16 output."""
    start = time.perf_counter()
    last = {}
    for folder in folders:
        for file in sorted((workdir / folder).glob("*.safetensors")):
            with safe_open(str(file), "pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    last[key] = handle.get_tensor(key)
            if folder == folders[0]:
                out.mkdir(parents=True, exist_ok=True)
                save_file({k: v.to(torch.bfloat16) for k, v in last.items()}, str(out / file.name))
            last = {}
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("bench-work"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a 4-layer, 32k-vocab model for a quick look")
    args = parser.parse_args()
    overrides = dict(num_hidden_layers=4, vocab_size=32768) if args.small else {}
    config = qwen3_config(**overrides)
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(f"building inputs in {args.workdir} ...", flush=True)
    build_inputs(args.workdir, config)

    params = sum(info.numel for info in Checkpoint(args.workdir / "post").tensors.values())
    print(f"model: {params / 1e9:.3f}B parameters, bf16, tied embeddings; torch threads {torch.get_num_threads()}")

    floors = {"3 inputs": [], "3 inputs + fisher": []}

    def measure_io_floor() -> None:
        for label, folders in (("3 inputs", ["post", "base", "base-ft"]),
                               ("3 inputs + fisher", ["post", "base", "base-ft", "fisher-diag"])):
            floors[label].append(io_floor(args.workdir, folders, args.workdir / "out"))
            shutil.rmtree(args.workdir / "out", ignore_errors=True)

    results = time_merges(args.workdir, CONFIGS, args.repeats, between=measure_io_floor)

    ta_wall = median(results["task_arithmetic"]["wall"])
    ta_rss = median(results["task_arithmetic"]["rss"])
    print(f"\nmedians of {args.repeats} (IO floor: 3 inputs {median(floors['3 inputs']):.1f} s, "
          f"with Fisher {median(floors['3 inputs + fisher']):.1f} s)")
    print(f"{'method':28s} {'wall s':>8s} {'÷ TA':>6s} {'peak RSS MB':>12s} {'÷ TA':>6s} {'÷ IO floor':>10s}")
    for name, r in results.items():
        floor = median(floors["3 inputs + fisher" if "rho=0.01" in name else "3 inputs"])
        wall, rss = median(r["wall"]), median(r["rss"])
        print(f"{name:28s} {wall:8.1f} {wall / ta_wall:6.2f} {rss:12.0f} {rss / ta_rss:6.2f} {wall / floor:10.2f}")


if __name__ == "__main__":
    main()
