#!/usr/bin/env bash
# Create .venv in the repo root (idempotent): torch first (the CPU wheel on CPU machines), then
# megaloop with its pinned megatron-core. Never installs transformer-engine (GPU extra only).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch, megatron.core, megaloop, pytest, transformers, google.protobuf, lm_eval, matplotlib, openai, jinja2, fastapi" 2>/dev/null; then
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e '.[test]'
fi
