"""Shared helpers for the benchmark scripts: generated checkpoints, timed subprocesses."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

BIN = Path(sys.executable).parent
# The repository's root: benchmarks run as `python benchmarks/bench_x.py` use its test fixtures (tests/helpers).
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
SHARD_BYTES = 500 * 1000 * 1000


def qwen3_config(**overrides):
    from transformers import Qwen3Config

    settings = dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, vocab_size=151936,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                    max_position_embeddings=4096, torch_dtype="bfloat16",
                    architectures=["Qwen3ForCausalLM"])
    settings.update(overrides)
    return Qwen3Config(**settings)


def parameter_shapes(config) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a Qwen3ForCausalLM, without allocating it."""
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def write_checkpoint(folder: Path, config, make_tensor, dtype=torch.bfloat16) -> None:
    """Sharded safetensors (500 MB shards) + index + config.json, one tensor in memory at a time."""
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    shapes = parameter_shapes(config)
    shards, current, size = [], {}, 0
    for name, shape in shapes.items():
        tensor = make_tensor(name, shape).to(dtype).contiguous()
        current[name] = tensor
        size += tensor.numel() * tensor.element_size()
        if size >= SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    weight_map = {}
    for index, shard in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


# Runs the measured command as its own child and reports that child's peak RSS. A child
# forked straight from the benchmark would inherit the benchmark's resident set in its
# ru_maxrss (Linux keeps the high-water mark across fork and exec), so a small
# intermediate process does the fork instead.
_PEAK_RSS_PROBE = (
    "import resource, subprocess, sys; rc = subprocess.call(sys.argv[2:]); "
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
    "sys.exit(rc)"
)


def timed_run(command: list[str], env: dict | None = None) -> tuple[float, float]:
    """(wall seconds, peak RSS in MB) of one subprocess, measured for that child alone."""
    with tempfile.TemporaryDirectory() as scratch:
        peak_file = os.path.join(scratch, "peak_kb")
        start = time.perf_counter()
        process = subprocess.run(
            [sys.executable, "-c", _PEAK_RSS_PROBE, peak_file, *command],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, **(env or {})},
        )
        wall = time.perf_counter() - start
        if process.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{process.stderr.decode()[-2000:]}")
        return wall, int(Path(peak_file).read_text()) / 1024


def median(values) -> float:
    return statistics.median(values)


def time_merges(workdir: Path, configs: dict[str, str], repeats: int, between=None) -> dict[str, dict[str, list]]:
    """Run each config through `mergekit-yaml` ``repeats`` times, interleaved.

    The graft threshold cache is cleared before every run so its pass is always timed.
    ``between()`` runs after each round (e.g. to measure the IO floor in the same conditions).
    """
    import shutil

    cache_dir = workdir / "threshold-cache"
    results = {name: {"wall": [], "rss": []} for name in configs}
    for repeat in range(repeats):
        for name, template in configs.items():
            config_file = workdir / "bench.yml"
            config_file.write_text(template.format(w=workdir.resolve()))
            out = workdir / "out"
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(cache_dir, ignore_errors=True)
            wall, rss = timed_run([str(BIN / "mergekit-yaml"), str(config_file), str(out), "--out-shard-size", "500M"],
                                  env={"GRAFTMERGE_CACHE_DIR": str(cache_dir)})
            shutil.rmtree(out, ignore_errors=True)
            results[name]["wall"].append(wall)
            results[name]["rss"].append(rss)
            print(f"  run {repeat + 1} {name:30s} {wall:7.1f} s  {rss:8.0f} MB", flush=True)
        if between is not None:
            between()
    return results


def small_qwen3(hidden: int, layers: int, intermediate: int, vocab: int, dtype: torch.dtype = torch.float32):
    """A generated Qwen3 (8 heads, 4 KV heads, tied, sdpa) for the estimator and sampler benchmarks."""
    from transformers import Qwen3ForCausalLM

    from graftmerge.demo.tiny_models import tiny_qwen3_config

    config = tiny_qwen3_config(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                               vocab_size=vocab, num_attention_heads=8, num_key_value_heads=4,
                               tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(dtype).eval()
