#!/usr/bin/env bash
# A real `graftmerge sweep --eval` on SmolLM2-135M-Instruct (CPU, a few minutes): the figure in
# docs/sweeps.md and the README. θpost is the Instruct model; the update is a PEFT LoRA adapter of
# its last 10 layers trained here on invented facts (role: delta); the mask ranks by θpost's own
# diagonal retention Fisher, estimated from its sampled replies to the "known facts" prompts;
# the tasks are graftmerge.demo.smollm2.write_fact_tasks (known: old, nll; facts: new, nll).
#   bash scripts/sweep_eval_smollm2.sh [WORKDIR]   (default: a new temporary folder)
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
from graftmerge.demo.smollm2 import KNOWN_FACTS, smollm2_gguf, train_fact_adapter, write_fact_tasks
work = Path(sys.argv[1])
if not (work / "post" / "config.json").exists():
    import_gguf(smollm2_gguf(), work / "post")
result = train_fact_adapter(work / "post", work / "lora", layers=range(20, 30), steps=12, lr=3e-3)
print(f"adapter loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}")
write_fact_tasks(work / "tasks", per_split=3)
prompts = [{"messages": [{"role": "user", "content": q}]} for split in KNOWN_FACTS.values() for q, _ in split]
(work / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
(work / "graft.yml").write_text(
    f"merge_method: graft\nbase_model: {work / 'post'}\nmodels:\n  - model: {work / 'lora'}\n"
    f"    parameters: {{role: delta}}\nparameters:\n  lambda: 1.0\n  rho: 0.0\n  fisher: {work / 'fisher'}\n"
    "dtype: float32\nout_dtype: bfloat16\n")
PY
.venv/bin/graftmerge fisher estimate "$work/post" -o "$work/fisher" --prompts "$work/prompts.jsonl" \
  --samples-per-prompt 2 --max-new-tokens 48 --modules 'model.layers.*' --overwrite
.venv/bin/graftmerge sweep "$work/graft.yml" --lambda 0.25,0.5,1 --rho 0,0.001,0.01 \
  --eval "$work/tasks/tasks.yml" -o "$work/sweep" --tolerance 0.01
echo "frontier: $work/sweep/frontier.png; chosen: $work/sweep/chosen.json"
