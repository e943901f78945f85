"""What identifying a model by content costs: ``weights_sha256`` of a Qwen3-0.6B-shaped bf16 checkpoint.

Prints the first hash (every tensor's bytes read and hashed), a second look (the digests
remembered per unchanged file in the user cache), and ``sha256sum``-style whole-file hashing
for comparison. The page cache is warm after the write, so this is the CPU cost of sha256,
not disk reads.

    python benchmarks/bench_model_digest.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from common import qwen3_config, write_checkpoint

from graftmerge.formats import model_content
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.file_hash import file_sha256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-digest-"))
    os.environ["GRAFTMERGE_CACHE_DIR"] = tempfile.mkdtemp(prefix="user-cache-", dir=workdir)  # nothing remembered
    model = workdir / "qwen3-0.6b"
    if not model.exists():
        generator = torch.Generator().manual_seed(0)
        write_checkpoint(model, qwen3_config(), lambda name, shape: torch.randn(shape, generator=generator))
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    time.sleep(model_content.SETTLED_SECONDS)  # files older than this are remembered
    began = time.perf_counter()
    for file in sorted(model.glob("*.safetensors")):
        file_sha256(file)
    whole = time.perf_counter() - began
    began = time.perf_counter()
    first = model_content.weights_sha256(Checkpoint(model))
    cold = time.perf_counter() - began
    began = time.perf_counter()
    again = model_content.weights_sha256(Checkpoint(model))
    warm = time.perf_counter() - began
    assert first == again
    print(f"{size / 1e9:.2f} GB of bf16 weights in {len(list(model.glob('*.safetensors')))} files")
    print(f"whole-file sha256:            {whole:.2f} s ({size / whole / 1e9:.2f} GB/s)")
    print(f"weights_sha256, first time:   {cold:.2f} s ({size / cold / 1e9:.2f} GB/s)")
    print(f"weights_sha256, remembered:   {warm * 1000:.1f} ms")


if __name__ == "__main__":
    main()
