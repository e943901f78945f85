"""A whole-model graft from a rank-16 LoRA adapter vs the same Δ as a full delta folder (CPU).

Inputs, generated (Qwen3-shaped; ``--small`` = 4 layers, vocab 32768, hidden 1024,
intermediate 3072: 96M parameters, sized for a shared 2-core machine):

  post, base        bf16 checkpoints (bench_graft.py's generator)
  adapter           a rank-16 LoRA of base on q/k/v/o/gate/up/down of every layer, in PEFT's
                    file layout (adapter_config.json + adapter_model.safetensors), lora_alpha 32
  full delta        the same Δ the way a user would graft it without adapter support: the
                    adapter merged into base in float32, then `graftmerge delta extract`
  fisher-kfac       one random orthonormal basis per side size, a spectrum per weight
                    (bench_kfac.py's generator); fisher-diag for the diagonal runs

Each run is a fresh `mergekit-yaml` (threshold cache cleared, --out-shard-size 500M),
medians of --repeats, interleaved: ``role: delta`` adapter vs ``role: delta`` full delta
folder, at rho 0, rho 0.01 global diagonal, and rho 0.001 global KFAC (where the adapter's
Δ̃ = λ·s·(UᵀB)(AV) replaces the dense rotation). Also the inputs' size on disk.

    python benchmarks/bench_lora.py --workdir /tmp/bench-lora --small [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import yaml
from bench_graft import build_inputs
from bench_kfac import write_kfac_cache
from common import median, qwen3_config, time_merges, write_checkpoint
from mergekit.config import MergeConfiguration
from safetensors.torch import save_file

from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.lora_sources import open_lora_fine_tune
from graftmerge.math.projection import KFAC_ROTATIONS
from graftmerge.pipeline.delta_extract import extract_delta
from graftmerge.pipeline.graft_plan import GraftInputs, plan_from_merge_config
from graftmerge.pipeline.threshold_pass import compute_global_threshold

RANK, ALPHA = 16, 32
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(workdir: Path) -> Path:
    """A rank-16 LoRA of ``base`` in PEFT's layout, random A and B (so Δ ≠ 0)."""
    folder = workdir / "adapter"
    if folder.exists():
        return folder
    folder.mkdir()
    generator = torch.Generator().manual_seed(2)
    tensors = {}
    for name, info in sorted(Checkpoint(workdir / "base").tensors.items()):
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in TARGETS:
            continue
        d_out, d_in = info.shape
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(RANK, d_in, generator=generator) / d_in ** 0.5
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(d_out, RANK, generator=generator) * 1e-3
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(TARGETS), "bias": "none",
              "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
              "task_type": "CAUSAL_LM", "base_model_name_or_path": str(workdir / "base")}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return folder


def write_full_delta(workdir: Path, config) -> Path:
    """The adapter merged into base in float32 (as PEFT's merge_and_unload would), then extracted as a delta."""
    folder = workdir / "full-delta"
    if folder.exists():
        return folder
    base = Checkpoint(workdir / "base")
    merged = open_lora_fine_tune(workdir / "adapter", base, workdir / "base", "merged")
    write_checkpoint(workdir / "merged", config, lambda name, shape: merged.read(name), dtype=torch.float32)
    return extract_delta(workdir / "base", workdir / "merged", folder, progress=False)


def graft_config(delta: str, parameters: str) -> str:
    """A graft of one ``role: delta`` input (a folder under the workdir) onto post."""
    return (f"merge_method: graft\nbase_model: {{w}}/post\nmodels:\n  - model: {{w}}/{delta}\n"
            f"    parameters: {{{{role: delta, weight: 0.5}}}}\n{parameters}dtype: float32\nout_dtype: bfloat16\n")


MASKS = {
    "rho 0": "",
    "rho 0.01 global diag": "parameters:\n  rho: 0.01\n  fisher: {w}/fisher-diag\n",
    "rho 0.001 global KFAC": "parameters:\n  rho: 0.001\n  fisher: {w}/fisher-kfac\n",
}


def threshold_pass_seconds(workdir: Path, folder: str, repeats: int) -> tuple[float, int]:
    """(best seconds of the KFAC threshold pass alone, in this process; dense Δ̃ rotations it did).

    Less exposed to a busy machine than whole-process medians: the best of ``repeats``
    after one untimed pass (the Fisher cache checks every basis on its first read).
    """



    text = graft_config(folder, MASKS["rho 0.001 global KFAC"]).format(w=workdir.resolve())
    inputs = GraftInputs.open(plan_from_merge_config(MergeConfiguration.model_validate(yaml.safe_load(text))))
    compute_global_threshold(inputs, progress=False)  # warm: the cache's first reads check every basis
    times = []
    for _ in range(repeats):
        KFAC_ROTATIONS.clear()
        start = time.perf_counter()
        compute_global_threshold(inputs, progress=False)
        times.append(time.perf_counter() - start)
    return min(times), sum(KFAC_ROTATIONS.values())


def size_mb(folder: Path) -> float:
    """Bytes of every file under ``folder``, in MB."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("bench-lora"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="4 layers, vocab 32768 (96M parameters)")
    parser.add_argument("--pass-only", action="store_true", help="only the in-process KFAC threshold pass")
    args = parser.parse_args()
    config = qwen3_config(num_hidden_layers=4, vocab_size=32768) if args.small else qwen3_config()
    args.workdir.mkdir(parents=True, exist_ok=True)
    build_inputs(args.workdir, config, with_fisher=True)
    write_adapter(args.workdir)
    write_full_delta(args.workdir, config)
    write_kfac_cache(args.workdir)
    print(f"on disk: adapter {size_mb(args.workdir / 'adapter'):.1f} MB, full delta "
          f"{size_mb(args.workdir / 'full-delta'):.1f} MB, post {size_mb(args.workdir / 'post'):.1f} MB")
    configs = {f"{kind} {mask}": graft_config(folder, MASKS[mask])
               for mask in MASKS for kind, folder in (("adapter", "adapter"), ("full delta", "full-delta"))}
    for kind, folder in (("adapter", "adapter"), ("full delta", "full-delta")):
        seconds, rotations = threshold_pass_seconds(args.workdir, folder, args.repeats)
        print(f"KFAC threshold pass alone (in process, best of {args.repeats}), {kind}: {seconds:.2f} s, "
              f"{rotations} dense rotations", flush=True)
    if args.pass_only:
        return
    results = time_merges(args.workdir, configs, args.repeats)
    print(f"medians of {args.repeats}:")
    for mask in MASKS:
        adapter, full = results[f"adapter {mask}"], results[f"full delta {mask}"]
        print(f"  {mask:24s} adapter {median(adapter['wall']):6.1f} s {median(adapter['rss']):7.0f} MB | "
              f"full delta {median(full['wall']):6.1f} s {median(full['rss']):7.0f} MB | "
              f"adapter ÷ full: wall {median(adapter['wall']) / median(full['wall']):.2f}, "
              f"RSS {median(adapter['rss']) / median(full['rss']):.2f}")


if __name__ == "__main__":
    main()
