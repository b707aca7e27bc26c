#!/usr/bin/env bash
# RLTT (or GRPO) on Nanbeige4.2-3B, starting from its public Hugging Face folder: the loop-aware
# RL objective of "Prioritize the Process, Not Just the Outcome" (a token's policy
# log-probability is sum_t w_t log P^(t) over the passes; Nanbeige has no exit gate, so w is
# uniform over its 2 passes unless --loop-weighting says otherwise), with tensor and data
# parallelism; rollouts and updates on every rank.
#
#   [SIZE=cpu] bash examples/recipes/nanbeige4.2_3b_rltt.sh NANBEIGE_DIR PROBLEMS [extra flags]
# NANBEIGE_DIR: the downloaded folder. PROBLEMS: the environment's problem file (gsm8k:
# GSM8K-style JSONL with question / answer "... #### N"; ENV=demo-tasks: a make_demo_corpus.py
# --tasks-output JSONL). Extra flags last.
# Environment: SIZE=full (default) or cpu; OBJECTIVE=rltt (default) or grpo; ENV (default
# gsm8k); NODES (full: 1 or 4; four nodes: IMPORT_ONLY=1 first, then one launch per node with
# MASTER_ADDR); NPROC ranks on this node (full 8, cpu 2); TP (full: 1 on one node, 2 on four;
# cpu 2); IMPORTED (default runs/nanbeige4.2_3b_imported, shared with the SFT recipe);
# SAVE_DIR (default runs/nanbeige4.2_3b_<OBJECTIVE>_<SIZE>); PYTHON; PRINT_ARGS=1 prints the
# train_rl.py flags instead.
#
# Settings as ouro_1.4b_rltt.sh (from "Closing the Loop" Appendix C: temperature 0.9, groups of
# 8, 32 prompts per optimizer step, learning rate 1e-5, 140 steps; completions of 512 tokens and
# the layouts are megaloop's choice), at Nanbeige's depth T = 2.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
SIZE=${SIZE:-full}
NANBEIGE_DIR=${1:?usage: $0 NANBEIGE_DIR PROBLEMS [extra flags]}
PROBLEMS=${2:?usage: $0 NANBEIGE_DIR PROBLEMS [extra flags]}
shift 2
OBJECTIVE=${OBJECTIVE:-rltt}
ENV=${ENV:-gsm8k}
IMPORTED=${IMPORTED:-$ROOT/runs/nanbeige4.2_3b_imported}
SAVE_DIR=${SAVE_DIR:-$ROOT/runs/nanbeige4.2_3b_${OBJECTIVE}_$SIZE}
PY=${PYTHON:-$ROOT/.venv/bin/python}

source "$HERE/_from_hf_layouts.sh"
hf_layout rl
ARGS+=("$@")
HF_DIR=$NANBEIGE_DIR ENTRY=train_rl.py RDZV_ID=nanbeige4.2_3b_rl
source "$HERE/_from_hf.sh"
