#!/usr/bin/env bash
# Create .venv in the repo root (idempotent): torch first (the CPU wheel on CPU machines), then
# megaloop with its pinned megatron-core, the test extra and TensorBoard (--tensorboard-dir works
# on first use; wandb, the rest of the log extra, is large and stays optional: pip install wandb).
# Never installs transformer-engine (GPU extra only).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# A venv made by an earlier version of this script lacks what was added since: each extra's
# package is named here, so such a venv is completed instead of trusted (and one installed before
# setup.py had the `megaloop` console script gets it).
if [ ! -x .venv/bin/megaloop ] || ! .venv/bin/python -c "import torch, megatron.core, megaloop, pytest, transformers, google.protobuf, lm_eval, matplotlib, openai, jinja2, fastapi, tensorboard, torch.utils.tensorboard" 2>/dev/null; then
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e '.[test,tensorboard]'
fi
