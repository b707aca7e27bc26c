#!/usr/bin/env bash
# Continued pretraining or SFT of Nanbeige4.2-3B (its 22 Llama layers looped twice) starting
# from its public Hugging Face folder, at any TP / DP size.
#
#   [SIZE=cpu] bash examples/recipes/nanbeige4.2_3b_sft.sh NANBEIGE_DIR DATA [extra flags]
# NANBEIGE_DIR: the downloaded folder (config.json, the safetensors shards, tokenizer.json).
# DATA: a prefix written by tools/preprocess_data.py with its tokenizer (--tokenizer-type
# HuggingFaceTokenizer --tokenizer-model NANBEIGE_DIR): with --data-format sft (prompt/response
# or messages; DATA_FORMAT=sft, the default) or plain documents with --append-eod
# (DATA_FORMAT=pretrain: continued pretraining). Extra flags come last and win.
# Environment: SIZE=full (default) or cpu; NODES (full: 1 or 4); NPROC ranks on this node (full
# 8, cpu 2); TP (full: 1 on one node, 2 on four; cpu 2); IMPORTED, where the converted checkpoint
# goes (default runs/nanbeige4.2_3b_imported; converted once, reused after); SAVE_DIR (default
# runs/nanbeige4.2_3b_sft_<SIZE>); PYTHON; PRINT_ARGS=1 prints the training flags instead.
#
# The conversion (megaloop/convert/hf_nanbeige.py) keeps Nanbeige's computation: the norm
# between the passes, no exit gate, so the objective is the cross-entropy after the last pass
# (--exit-loss last, from the checkpoint's flags: --use-checkpoint-args), as Nanbeige trains.
# Layout (megaloop's choice; 4.2B parameters with the untied head, 44 effective layers): one
# 8-GPU node: TP 1, DP 8, distributed optimizer, micro-batch 1 of 4096 tokens, global batch 128
# (0.5M tokens per step); four nodes: TP 2, DP 16, micro-batch 2, the same global batch (as
# ouro_1.4b_sft.sh; convert first with IMPORT_ONLY=1 NODES=4, then one launch per node with
# MASTER_ADDR). Schedule (megaloop's choice for SFT of a converged model): LR 2e-5 warmed up over
# 100 steps, cosine to 2e-6 over 2000 steps; no dropout (Nanbeige has none).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
SIZE=${SIZE:-full}
NANBEIGE_DIR=${1:?usage: $0 NANBEIGE_DIR DATA [extra flags]}
DATA=${2:?usage: $0 NANBEIGE_DIR DATA [extra flags]}
shift 2
DATA_FORMAT=${DATA_FORMAT:-sft}
IMPORTED=${IMPORTED:-$ROOT/runs/nanbeige4.2_3b_imported}
SAVE_DIR=${SAVE_DIR:-$ROOT/runs/nanbeige4.2_3b_sft_$SIZE}
PY=${PYTHON:-$ROOT/.venv/bin/python}

source "$HERE/_from_hf_layouts.sh"
hf_layout sft
ARGS+=("$@")
HF_DIR=$NANBEIGE_DIR ENTRY=pretrain_looplm.py RDZV_ID=nanbeige4.2_3b_sft
source "$HERE/_from_hf.sh"
