#!/usr/bin/env bash
# From "LoopFormer: Elastic-Depth Looped Transformers for Latent Reasoning via Shortcut Modulation"
# (arXiv 2602.11451): its published configuration from scratch. One shared block of 3 layers
# looped 8 times (effective depth 24), hidden 2048, 32 heads, GELU MLP of 5120, no biases, no
# dropout, learned positions over 1024 tokens, tied embeddings, GPT-2's vocabulary (50257 padded
# to 50304). Every core layer is modulated by the step: c = MLP_t(sin(t)) + MLP_dt(sin(dt)) from
# 256-d sinusoidal embeddings of the time t = l/8 and the step size dt = 1/8; per layer and
# branch a scale and a gate from silu(c) (adaLN without a shift) on norms without a learnable
# scale (--norm-scheme magic, eps = float32 machine epsilon as torch's RMSNorm default); one
# learnable RMSNorm before the tied head, applied at readout only (the loop carries the
# un-normalized state). A shorter route of larger steps is the same model run with fewer loops:
# `--num-loops 4` at evaluation / generation gives t = l/4, dt = 1/4.
#
# The published objective (--loopformer-objective): CE(8 steps of 1/8) + 0.1 CE(a random shorter
# route of unequal steps, drawn per micro-batch as LoopFormer's sampler) + 0.1 MSE(stop-grad(final
# normed state of the full route), the short route's). See docs/training.md, "LoopFormer".
#
# Schedule (LoopFormer's training script): AdamW (0.9, 0.95), weight decay 0.2, LR 6e-4 warmed up
# over 2000 steps, cosine to 6e-5 at 50000 steps, clip 1.0, bf16, 480 sequences of 1024 tokens
# per step (~0.5M tokens). Layout: one 8-GPU node, DP 8, micro-batch 12 (5 accumulation steps,
# as published); NODES=4 (start once per node with MASTER_ADDR set): DP 32, micro-batch 15, the
# same global batch. A 278M-parameter model: no tensor or pipeline parallelism (the step embedder
# is shared by every core layer: --pipeline-model-parallel-size > 1 is refused).
#
#   bash examples/recipes/loopformer_from_scratch.sh DATA_PREFIX GPT2_TOKENIZER_DIR [extra flags]
# SIZE=cpu: the same switches at toy widths on one CPU rank.
set -euo pipefail
source "$(dirname "$0")/_sizes.sh"
SIZE=${SIZE:-full}
RECIPE=(--num-layers 3 --num-loops 8 --timestep-conditioning loopformer --loopformer-objective
        --timestep-frequency-dim 256 --timestep-inference rescaled
        --norm-scheme magic --normalization RMSNorm --norm-epsilon 1.1920929e-07
        --step-norm rms --step-norm-placement readout --exit-loss last
        --position-embedding-type learned_absolute --disable-bias-linear
        --hidden-dropout 0 --attention-dropout 0 --make-vocab-size-divisible-by 64
        --init-method-std 0.02 --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.2
        --clip-grad 1.0 --lr-decay-style cosine)
if [[ $SIZE == cpu ]]; then
    ARGS=("${RECIPE[@]}" --num-workers 0
          --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 160
          --seq-length 64 --max-position-embeddings 64 --micro-batch-size 8 --global-batch-size 8
          --train-iters 300 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 30
          --log-interval 50 --eval-interval 1000 --eval-iters 2 --split 98,2,0)
else
    if [[ ${NODES:-1} == 4 ]]; then MICRO=15; else MICRO=12; fi
    ARGS=("${RECIPE[@]}"
          --hidden-size 2048 --num-attention-heads 32 --ffn-hidden-size 5120
          --seq-length 1024 --max-position-embeddings 1024 --bf16
          --micro-batch-size "$MICRO" --global-batch-size 480
          --train-iters 50000 --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 2000
          --lr-decay-iters 50000
          --log-interval 10 --eval-interval 1000 --eval-iters 200 --split 995,5,0)
fi
source "$(dirname "$0")/_launch.sh"
