"""Self-sampling throughput (``fisher estimate --prompts``): one prompt per call vs batched.

    python benchmarks/bench_sampling.py                       # CPU, small Qwen3 shape
    python benchmarks/bench_sampling.py --device cuda --sizes 1,16,64

Samples the same prompts (mixed lengths) with the same per-prompt generators at each
``--sample-batch-size`` in turn, like ``_sample_rollouts`` does (this rank's prompts sorted
by length, then cut into batches). Sizes are interleaved within each repeat so load
changes hit them alike; prints the median rollouts/s and its ratio to size 1 (the old
one-prompt-at-a-time path), measured in this run. No EOS: every rollout gets all
``--new-tokens``, so every size does the same sampling work. Also checks that every
size sampled the same tokens as size 1 (exact in float64; reported, not required, in
lower precisions).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from common import small_qwen3

from graftmerge.estimate.sampling import prompt_generator, sample_batch


def make_prompts(args) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.prompts,), generator=generator)
    return [torch.randint(0, args.vocab, (int(n),), generator=generator).tolist() for n in lengths]


def sample_all(model, prompts, size: int, args) -> list:
    """Every prompt's completions, batched as ``_sample_rollouts`` batches them."""
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    result: list = [None] * len(prompts)
    for start in range(0, len(order), size):
        chunk = order[start : start + size]
        sampled = sample_batch(
            model,
            [prompts[i] for i in chunk],
            samples=args.samples,
            max_new_tokens=args.new_tokens,
            temperature=1.0,
            top_p=1.0,
            generators=[prompt_generator(0, i, device) for i in chunk],
            eos_ids=[],
        )
        for i, rows in zip(chunk, sampled, strict=True):
            result[i] = rows
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=2, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=48)
    parser.add_argument("--sizes", default="1,8,16,32", help="prompts per call; 1 = the old path")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch CPU threads; 1 by default: on a shared 2-core machine more threads spin and thrash",
    )  # fmt: skip
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    if 1 not in sizes:
        sizes.insert(0, 1)

    model = small_qwen3(args.hidden, args.layers, args.intermediate, args.vocab, getattr(torch, args.dtype)).to(
        args.device
    )
    prompts = make_prompts(args)
    rollouts = args.prompts * args.samples
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"Qwen3 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} "
        f"({parameters / 1e6:.1f}M parameters, {args.dtype}, {args.device}, "
        f"{torch.get_num_threads()} threads); {args.prompts} prompts of "
        f"{args.min_prompt}-{args.max_prompt} tokens x {args.samples} samples x "
        f"{args.new_tokens} new tokens = {rollouts} rollouts; median of {args.repeats}"
    )

    def sync() -> None:
        if model.device.type == "cuda":
            torch.cuda.synchronize()

    reference = sample_all(model, prompts, 1, args)  # also the warm-up
    same = {}
    seconds: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(args.repeats):
        for size in sizes:
            sync()
            start = time.perf_counter()
            sampled = sample_all(model, prompts, size, args)
            sync()
            seconds[size].append(time.perf_counter() - start)
            same[size] = same.get(size, True) and sampled == reference

    base = statistics.median(seconds[1])
    print(f"{'prompts/call':>12} {'seconds':>9} {'rollouts/s':>11} {'x size 1':>9}  same tokens")
    results = []
    for size in sizes:
        median = statistics.median(seconds[size])
        results.append({
            "sample_batch_size": size, "seconds": median, "rollouts_per_s": rollouts / median,
            "speedup": base / median, "same_tokens_as_size_1": same[size],
        })  # fmt: skip
        print(
            f"{size:>12} {median:>9.2f} {rollouts / median:>11.1f} {base / median:>9.2f}  {same[size]}"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"settings": vars(args), "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
