#!/usr/bin/env bash
# Continued training or SFT of ByteDance's Ouro-1.4B (or Ouro-1.4B-Thinking; Ouro-2.6B the same
# way) starting from its public Hugging Face folder, at any TP / DP size.
#
#   [SIZE=cpu] bash examples/recipes/ouro_1.4b_sft.sh OURO_DIR DATA [extra flags]
# OURO_DIR: the downloaded folder (config.json, model.safetensors, tokenizer.json).
# DATA: a prefix written by tools/preprocess_data.py with Ouro's tokenizer
# (--tokenizer-type HuggingFaceTokenizer --tokenizer-model OURO_DIR): with --data-format sft
# (prompt/response or messages; DATA_FORMAT=sft, the default) or plain documents with
# --append-eod (DATA_FORMAT=pretrain: continued pretraining). Extra flags come last and win.
# Environment: SIZE=full (default) or cpu; NODES (full: 1 or 4); NPROC ranks on this node
# (full 8, cpu 2); TP (full: 1 on one node, 2 on four; cpu 2); IMPORTED, where the converted
# checkpoint goes (default runs/ouro_1.4b_imported; converted once, reused after); SAVE_DIR
# (default runs/ouro_1.4b_sft_<SIZE>); PYTHON; PRINT_ARGS=1 prints the training flags instead.
#
# Step 1 converts the folder once (tools/convert_checkpoint.py import-hf): every config.json key
# honoured or refused by name, the exit gate kept, the tokenizer copied to IMPORTED/tokenizer,
# early_exit_threshold kept as the default exit rule of generate / serve / lm-eval. Step 2 trains
# with --use-checkpoint-args (the model flags are the checkpoint's) and --finetune (its weights,
# iteration 0, fresh AdamW and LR schedule). The objective is megaloop's exit objective,
# sum_t p_t L_t + beta KL(p || uniform) with the folder's gate; Ouro's own `labels` loss is the
# cross-entropy of the exit-weighted logits instead (docs/training.md, "Starting from Ouro").
#
# Layout (megaloop's choice; Ouro-1.4B is 1.4B parameters looped 4 times, 96 effective layers):
# one 8-GPU node: TP 1, DP 8, distributed optimizer, micro-batch 1 of 4096 tokens, global batch
# 128 (0.5M tokens per step); four nodes: TP 2, DP 16, micro-batch 2, the same global batch.
# Four nodes: convert first on one node (IMPORT_ONLY=1 NODES=4 bash ...), then start this script
# once per node (e.g. `srun --nodes 4 --ntasks-per-node 1 bash ...`) with NODES=4 and
# MASTER_ADDR set to the first node: torchrun's c10d rendezvous joins the 32 ranks.
# Schedule (megaloop's choice for SFT of a converged model): LR 2e-5 warmed up over 100 steps,
# cosine to 2e-6 over 2000 steps (override with --train-iters, --lr, ...); no dropout (Ouro has
# none; --use-checkpoint-args takes no training flag); beta 0.05, small as in
# Ouro's later stages, keeps the gate where it is.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
SIZE=${SIZE:-full}
OURO_DIR=${1:?usage: $0 OURO_DIR DATA [extra flags]}
DATA=${2:?usage: $0 OURO_DIR DATA [extra flags]}
shift 2
DATA_FORMAT=${DATA_FORMAT:-sft}
IMPORTED=${IMPORTED:-$ROOT/runs/ouro_1.4b_imported}
SAVE_DIR=${SAVE_DIR:-$ROOT/runs/ouro_1.4b_sft_$SIZE}
PY=${PYTHON:-$ROOT/.venv/bin/python}

source "$HERE/_from_hf_layouts.sh"
hf_layout sft
ARGS+=(--exit-kl-beta 0.05)  # small, as in Ouro's later stages: the gate stays
ARGS+=("$@")
HF_DIR=$OURO_DIR ENTRY=pretrain_looplm.py RDZV_ID=ouro_1.4b_sft
source "$HERE/_from_hf.sh"
