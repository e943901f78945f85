#!/usr/bin/env bash
# Install, lint, run the whole test suite (offline, CPU), then mergekit's own suite with graft registered.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check graftmerge tests benchmarks
HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q "$@"
bash scripts/mergekit_suite.sh
