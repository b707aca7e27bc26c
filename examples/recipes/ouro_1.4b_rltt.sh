#!/usr/bin/env bash
# RLTT (or GRPO) on ByteDance's Ouro-1.4B, starting from its public Hugging Face folder: the
# loop-aware RL objective of "Prioritize the Process, Not Just the Outcome" (the policy
# log-probability of a token is sum_t w_t log P^(t); w is the model's own exit distribution by
# default), with tensor and data parallelism; rollouts and updates on every rank.
#
#   [SIZE=cpu] bash examples/recipes/ouro_1.4b_rltt.sh OURO_DIR PROBLEMS [extra flags]
# OURO_DIR: the downloaded folder (config.json, model.safetensors, tokenizer.json).
# PROBLEMS: the environment's problem file (gsm8k: GSM8K-style JSONL with question / answer
# "... #### N"; ENV=demo-tasks: a make_demo_corpus.py --tasks-output JSONL). Extra flags last.
# Environment: SIZE=full (default) or cpu; OBJECTIVE=rltt (default) or grpo; ENV (default
# gsm8k); NODES (full: 1 or 4; four nodes as in ouro_1.4b_sft.sh: IMPORT_ONLY=1 first, then one
# launch per node with MASTER_ADDR); NPROC ranks on this node (full 8, cpu 2); TP (full: 1 on
# one node, 2 on four; cpu 2); IMPORTED (default runs/ouro_1.4b_imported, shared with the SFT
# recipe; converted once); SAVE_DIR (default runs/ouro_1.4b_<OBJECTIVE>_<SIZE>); PYTHON;
# PRINT_ARGS=1 prints the train_rl.py flags instead.
#
# Sizes from "Closing the Loop" (arXiv 2610.00673) Appendix C, which ran RLTT on a 1.4B LoopLM of
# Ouro-1.4B's shape: temperature 0.9, groups of 8, 32 prompts per optimizer step, T = 4, learning
# rate 1e-5 (1e-6 did not move the policy), 140 steps (the GSM8K gain had saturated by then).
# Completion length (512 tokens) and the layout are megaloop's choices: one node TP 1 x DP 8 (4
# prompts, 32 completions per rank, micro-batches of 8); four nodes TP 2 x DP 16 (2 prompts, 16
# completions per rank). --kl-beta stays 0; the KL to the starting policy is logged each step
# (the paper reads a growing KL with a non-negligible gradient norm as RL moving the policy).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
SIZE=${SIZE:-full}
OURO_DIR=${1:?usage: $0 OURO_DIR PROBLEMS [extra flags]}
PROBLEMS=${2:?usage: $0 OURO_DIR PROBLEMS [extra flags]}
shift 2
OBJECTIVE=${OBJECTIVE:-rltt}
ENV=${ENV:-gsm8k}
IMPORTED=${IMPORTED:-$ROOT/runs/ouro_1.4b_imported}
SAVE_DIR=${SAVE_DIR:-$ROOT/runs/ouro_1.4b_${OBJECTIVE}_$SIZE}
PY=${PYTHON:-$ROOT/.venv/bin/python}

source "$HERE/_from_hf_layouts.sh"
hf_layout rl
ARGS+=("$@")
HF_DIR=$OURO_DIR ENTRY=train_rl.py RDZV_ID=ouro_1.4b_rl
source "$HERE/_from_hf.sh"
