#!/usr/bin/env bash
# Install, then: the paper's minimal model and a graft on generated tiny checkpoints (~10 s),
# then a small LM trained here, compared under SFT, SFT + merge and grafts (~2-3 min on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/graftmerge demo "$@"
.venv/bin/graftmerge demo --lm "$@"
