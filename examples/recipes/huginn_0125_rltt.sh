#!/usr/bin/env bash
# RLTT (or GRPO) on Huginn-0125, starting from its public Hugging Face folder: the loop-aware RL
# objective of "Prioritize the Process, Not Just the Outcome" (a token's policy log-probability
# is sum_t w_t log P^(t) over the loop steps; Huginn has no exit gate, so w is uniform over its
# mean_recurrence steps unless --loop-weighting says otherwise), with tensor and data
# parallelism; rollouts and updates on every rank.
#
#   [SIZE=cpu] bash examples/recipes/huginn_0125_rltt.sh HUGINN_DIR PROBLEMS [extra flags]
# HUGINN_DIR: the downloaded folder. PROBLEMS: the environment's problem file (gsm8k:
# GSM8K-style JSONL with question / answer "... #### N"; ENV=demo-tasks: a make_demo_corpus.py
# --tasks-output JSONL). Extra flags last.
# Environment: SIZE=full (default) or cpu; OBJECTIVE=rltt (default) or grpo; ENV (default
# gsm8k); NODES (full: 1 or 4; four nodes: IMPORT_ONLY=1 first, then one launch per node with
# MASTER_ADDR); NPROC ranks on this node (full 8, cpu 2); TP (full: 1 on one node, 2 on four;
# cpu 2); IMPORTED (default runs/huginn_0125_imported, shared with the SFT recipe); SAVE_DIR
# (default runs/huginn_0125_<OBJECTIVE>_<SIZE>); PYTHON; PRINT_ARGS=1 prints the train_rl.py
# flags instead.
#
# Settings as ouro_1.4b_rltt.sh (from "Closing the Loop" Appendix C: temperature 0.9, groups of
# 8, 32 prompts per optimizer step, learning rate 1e-5, 140 steps; completions of 512 tokens and
# the layouts are megaloop's choice), at Huginn's mean recurrence (32 steps). Every forward draws
# Huginn's random initial state afresh, so a completion's log-probabilities at update time are
# those of another draw than at rollout time: the importance ratio of an on-policy token is not
# exactly 1 (it is for models that start from the prelude's output).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
SIZE=${SIZE:-full}
HUGINN_DIR=${1:?usage: $0 HUGINN_DIR PROBLEMS [extra flags]}
PROBLEMS=${2:?usage: $0 HUGINN_DIR PROBLEMS [extra flags]}
shift 2
OBJECTIVE=${OBJECTIVE:-rltt}
ENV=${ENV:-gsm8k}
IMPORTED=${IMPORTED:-$ROOT/runs/huginn_0125_imported}
SAVE_DIR=${SAVE_DIR:-$ROOT/runs/huginn_0125_${OBJECTIVE}_$SIZE}
PY=${PYTHON:-$ROOT/.venv/bin/python}

source "$HERE/_from_hf_layouts.sh"
hf_layout rl
ARGS+=("$@")
HF_DIR=$HUGINN_DIR ENTRY=train_rl.py RDZV_ID=huginn_0125_rl
source "$HERE/_from_hf.sh"
