#!/usr/bin/env bash
# Install, then graft on generated tiny checkpoints and print what happened.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/graftmerge demo "$@"
