#!/usr/bin/env bash
# Install, then: the paper's minimal model and a graft on generated tiny checkpoints (~10 s),
# then `python -m experiments.demo --lm`: a small LM trained here and a fair comparison of SFT, on-policy
# self-distillation and grafts, every choice made on validation (≤ 5 min on 2 idle cores;
# results, plots and models in demo-out/lm/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/graftmerge demo "$@"
.venv/bin/python -m experiments.demo --lm "$@"
