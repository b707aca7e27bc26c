#!/usr/bin/env bash
# Continued pretraining or SFT of Huginn-0125 (3.5B: 2 prelude layers, a core of 4 applied a
# sampled number of times, 2 coda layers) starting from its public Hugging Face folder, at any
# TP / DP size, with Huginn's own training recurrence.
#
#   [SIZE=cpu] bash examples/recipes/huginn_0125_sft.sh HUGINN_DIR DATA [extra flags]
# HUGINN_DIR: the downloaded folder (config.json, the safetensors shards, tokenizer.json).
# DATA: a prefix written by tools/preprocess_data.py with its tokenizer (--tokenizer-type
# HuggingFaceTokenizer --tokenizer-model HUGINN_DIR): with --data-format sft (prompt/response
# or messages; DATA_FORMAT=sft, the default) or plain documents with --append-eod
# (DATA_FORMAT=pretrain: continued pretraining). Extra flags come last and win.
# Environment: SIZE=full (default) or cpu; NODES (full: 1 or 4); NPROC ranks on this node (full
# 8, cpu 2); TP (full: 1 on one node, 2 on four; cpu 2); IMPORTED, where the converted checkpoint
# goes (default runs/huginn_0125_imported; converted once, reused after); SAVE_DIR (default
# runs/huginn_0125_sft_<SIZE>); PYTHON; PRINT_ARGS=1 prints the training flags instead.
#
# The conversion (megaloop/convert/hf_huginn.py) keeps Huginn's computation: the random initial
# state, the adapter on [state; prelude output], sandwich layers with q/k biases and interleaved
# RoPE, the shared final norm, no exit gate (--exit-loss last: the cross-entropy after the last
# step, as Huginn trains), all taken from the checkpoint (--use-checkpoint-args). Training
# recurrence, as Huginn's sampler: every optimizer step runs T = 1 + Poisson(lambda) steps, log
# lambda ~ N(log(m) - 1/8, 1/4) with m config.json's mean_recurrence (32), and backpropagates
# through the last mean_backprop_depth (8) of them (--random-depth-mean, --random-depth-sigma
# 0.5, --backprop-last-steps, read from HUGINN_DIR/config.json); validation runs m steps.
# Layout (megaloop's choice; 3.6B parameters, tied head): one 8-GPU node: TP 1, DP 8,
# distributed optimizer, micro-batch 1 of 4096 tokens, global batch 128 (0.5M tokens per step);
# four nodes: TP 2, DP 16, micro-batch 2, the same global batch (convert first with
# IMPORT_ONLY=1 NODES=4, then one launch per node with MASTER_ADDR). Schedule (megaloop's choice
# for SFT of a converged model): LR 2e-5 warmed up over 100 steps, cosine to 2e-6 over 2000
# steps; no dropout (Huginn has none).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
SIZE=${SIZE:-full}
HUGINN_DIR=${1:?usage: $0 HUGINN_DIR DATA [extra flags]}
DATA=${2:?usage: $0 HUGINN_DIR DATA [extra flags]}
shift 2
DATA_FORMAT=${DATA_FORMAT:-sft}
IMPORTED=${IMPORTED:-$ROOT/runs/huginn_0125_imported}
SAVE_DIR=${SAVE_DIR:-$ROOT/runs/huginn_0125_sft_$SIZE}
PY=${PYTHON:-$ROOT/.venv/bin/python}

source "$HERE/_from_hf_layouts.sh"
hf_layout sft
read -r MEAN BACKPROP < <($PY -c 'import json, sys
c = json.load(open(sys.argv[1]))
print(c["mean_recurrence"], c.get("mean_backprop_depth", 8))' "$HUGINN_DIR/config.json")
ARGS+=(--random-depth-mean "$MEAN" --random-depth-sigma 0.5 --backprop-last-steps "$BACKPROP")
ARGS+=("$@")
HF_DIR=$HUGINN_DIR ENTRY=pretrain_looplm.py RDZV_ID=huginn_0125_sft
source "$HERE/_from_hf.sh"
