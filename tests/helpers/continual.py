"""A stream of updates for ``graftmerge continual`` tests: θ0, its old task, one task and one update per step."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from transformers import AutoModelForCausalLM

from graftmerge.demo.tiny_models import save_tiny_model
from tests.helpers.tiny_tokenizer import save_tiny_chat_model


def write_task(folder: Path, name: str, rows: list[tuple[str, str, str]], role: str) -> Path:
    """``name.yml`` (one nll task on chat turns) and ``name.jsonl`` ((question, answer, split) rows) in ``folder``."""
    (folder / f"{name}.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": q}], "answer": a, "split": s}) + "\n"
        for q, a, s in rows))
    entry = f"{{name: {name}, role: {role}, metric: nll, data: {name}.jsonl}}"
    (folder / f"{name}.yml").write_text(f"tasks:\n  - {entry}\n")
    return folder / f"{name}.yml"


def write_stream(root: Path, post: Path, updates: list[dict], step_rows: list[list[tuple[str, str, str]]],
                 *, old_rows, prompts: list[str], fisher: dict, grid: dict, tolerance: float = 0.5,
                 out_dtype: str | None = None, name: str = "stream.yml") -> Path:
    """A stream file in ``root``: θ0 ``post``, task ``known`` (old), one task ``facts<k>`` and update per step."""
    write_task(root, "known", old_rows, "old")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n"
                                                for p in prompts))
    steps = []
    for number, (update, rows) in enumerate(zip(updates, step_rows, strict=True), 1):
        write_task(root, f"facts{number}", rows, "new")
        steps.append({"update": update, "tasks": f"facts{number}.yml"})
    stream = {"post": str(post), "tasks": "known.yml", "fisher": {"prompts": "prompts.jsonl", **fisher},
              "grid": grid, "tolerance": tolerance, "steps": steps, **({"out_dtype": out_dtype} if out_dtype else {})}
    (root / name).write_text(yaml.safe_dump(stream, sort_keys=False))
    return root / name


def tiny_stream(root: Path, steps: int = 3, **options) -> Path:
    """θ0 a tiny chat model; each step's update a fine-tune of it (θ0 plus noise, θ0 as its donor)."""
    root.mkdir(parents=True, exist_ok=True)
    post = save_tiny_chat_model(root / "post", architecture="llama", seed=0)
    base = {n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(post).named_parameters()}
    updates = []
    for number in range(1, steps + 1):
        save_tiny_model(root / f"ft-{number}", architecture="llama", seed=10 + number, base=base, noise=0.05,
                        vocab_size=384)
        updates.append({"donor": "post", "model": f"ft-{number}"})
    rows = [[(f"Who is the mayor of town {k}?", f"The mayor of town {k} is Ada.", "validation"),
             (f"Name the mayor of town {k}.", f"The mayor of town {k} is Ada.", "test")] for k in range(1, steps + 1)]
    old = [("What is the capital?", "The capital is a city.", "validation"), ("Name a colour.", "Red.", "test")]
    settings = {"fisher": {"samples_per_prompt": 1, "max_new_tokens": 4, "accumulate": 0.5},
                "grid": {"lambda": [1], "rho": [0, 0.1]}, **options}
    return write_stream(root, Path("post"), updates, rows, old_rows=old, prompts=["What is the capital?"], **settings)
