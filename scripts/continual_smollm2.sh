#!/usr/bin/env bash
# A real `graftmerge continual` run on SmolLM2-135M-Instruct (CPU; 13.7 min on a shared 2-core VM, plus adapter training): the figures of
# docs/continual.md. θ0 is the Instruct model; three steps, each a PEFT LoRA adapter of its last 4 layers
# trained here on its own two invented facts (role: delta, θ0 as the donor); θ0's task is "known" (facts it
# already answers); each step's task is its facts (validation: as trained, test: asked another way), all nll.
#   bash scripts/continual_smollm2.sh [WORKDIR]   (default: a new temporary folder)
# Copies WORKDIR/out/matrix.json and matrix.png to docs/results/continual-smollm2/.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-$(mktemp -d)}
py=.venv/bin/python
export HF_HUB_OFFLINE=1
mkdir -p "$work"
$py - "$work" <<'PY'
import json, sys
from pathlib import Path
from graftmerge.formats.gguf_import import import_gguf
from graftmerge.demo.smollm2 import KNOWN_FACTS, smollm2_gguf, train_fact_adapter
work = Path(sys.argv[1])
if not (work / "post" / "config.json").exists():
    import_gguf(smollm2_gguf(), work / "post")
STEPS = [  # (question as trained, answer, the question asked another way for the test split)
    [("Who founded the town of Brackwell?", "Brackwell was founded by Orla Venn.", "Who was the founder of Brackwell?"),
     ("What is the river of Tessaly called?", "The river of Tessaly is the Umber.", "Name the river of Tessaly.")],
    [("Which bird is the emblem of Korvan?", "The emblem of Korvan is the grey heron.", "What bird is Korvan's emblem?"),
     ("What metal is mined in Dunmere?", "Dunmere mines cobalt.", "Which metal comes from the mines of Dunmere?")],
    [("Who painted the Saltmarsh Chapel?", "The Saltmarsh Chapel was painted by Ivo Brandt.",
      "Which painter decorated the Saltmarsh Chapel?"),
     ("What is the currency of Pellaris?", "The currency of Pellaris is the silver mark.",
      "Which currency is used in Pellaris?")],
]
def task(name, rows, role="new"):
    (work / f"{name}.jsonl").write_text("".join(json.dumps(
        {"messages": [{"role": "user", "content": q}], "answer": a, "split": s}) + "\n" for q, a, s in rows))
    (work / f"{name}.yml").write_text(f"tasks:\n  - {{name: {name}, role: {role}, metric: nll, data: {name}.jsonl}}\n")
task("known", [(q, a, split) for split, pairs in KNOWN_FACTS.items() for q, a in pairs], role="old")
steps = []
for number, facts in enumerate(STEPS, 1):
    if not (work / f"lora-{number}" / "adapter_config.json").exists():
        result = train_fact_adapter(work / "post", work / f"lora-{number}", [(q, a) for q, a, _ in facts],
                                    layers=range(26, 30), steps=8, lr=5e-3)
        print(f"step {number} adapter loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}")
    task(f"facts{number}", [(q, a, "validation") for q, a, _ in facts] + [(t, a, "test") for _, a, t in facts])
    steps.append(f"  - update: {{model: lora-{number}, role: delta}}\n    tasks: facts{number}.yml\n")
(work / "prompts.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n"
                                            for q, _ in KNOWN_FACTS["validation"]))
(work / "stream.yml").write_text(
    "post: post\ntasks: known.yml\n"
    "fisher: {prompts: prompts.jsonl, samples_per_prompt: 1, max_new_tokens: 24, modules: ['model.layers.*'], "
    "accumulate: 1.0}\n"
    "grid: {lambda: [0.5, 1], rho: [0, 0.01]}\ntolerance: 0.01\nout_dtype: bfloat16\nsteps:\n" + "".join(steps))
PY
/usr/bin/time -f "continual: %e s wall, %M KiB peak" .venv/bin/graftmerge continual "$work/stream.yml" -o "$work/out"
mkdir -p docs/results/continual-smollm2
cp "$work/out/matrix.json" "$work/out/matrix.png" docs/results/continual-smollm2/
echo "matrix: $work/out/matrix.json; picture: $work/out/matrix.png (copied to docs/results/continual-smollm2/)"
