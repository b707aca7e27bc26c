#!/usr/bin/env bash
# From "What Makes Recurrence Effective in Looped Language Models?" (arXiv 2609.36636): best
# CoreLoop configuration: Prelude + shared core + Coda (2 + 4 x 3 + 2, physical depth 8, effective
# training depth 16 = the Llama-3.1-1B depth What Makes Recurrence Effective matches), channel-wise
# history-state injection with window 2 plus loop gating (What Makes Recurrence Effective's best
# combination), fixed K with full backpropagation and the loss on the last loop (no exit gate), Muon
# (0.95, Nesterov, 5 Newton-Schulz steps) for the hidden matrices + AdamW (0.9, 0.95) for the rest,
# weight decay 0.1, WSD schedule. The layer split is our choice, not a number taken from the paper;
# the backbone is the Llama-3.1-1B one (hidden 2048, 32 heads, 8 KV groups, SwiGLU 8192, pre-norm).
set -euo pipefail
source "$(dirname "$0")/_sizes.sh"
SIZE=${SIZE:-full}
RECIPE=(--norm-scheme pre --num-loops 3 --exit-loss last
        --history-injection channel-wise --history-window 2 --timestep-conditioning loop-gating
        --optimizer muon --muon-momentum 0.95 --muon-use-nesterov --muon-num-ns-steps 5
        --muon-scale-mode rms-match
        --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --lr-decay-style WSD
        --lr-wsd-decay-style linear --clip-grad 1.0)
if [[ $SIZE == cpu ]]; then
    ARGS=(--num-layers 4 --num-prelude-layers 1 --num-coda-layers 1 "${RECIPE[@]}"
          "${LLAMA_STYLE[@]}" --num-workers 0
          --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2
          --ffn-hidden-size 176
          --seq-length 64 --max-position-embeddings 64 --micro-batch-size 8 --global-batch-size 8
          --train-iters 300 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 30 --lr-wsd-decay-iters 60
          --log-interval 50 --eval-interval 1000 --eval-iters 2 --split 98,2,0)
else
    ARGS=(--num-layers 8 --num-prelude-layers 2 --num-coda-layers 2 "${RECIPE[@]}"
          "${LLAMA_STYLE[@]}"
          --hidden-size 2048 --num-attention-heads 32 --group-query-attention --num-query-groups 8
          --ffn-hidden-size 8192
          --rotary-base 500000 --seq-length 4096 --max-position-embeddings 4096 --bf16
          --micro-batch-size 4 --global-batch-size 512
          --train-iters 50000 --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 2000
          --lr-wsd-decay-iters 10000
          --log-interval 10 --eval-interval 1000 --eval-iters 10 --split 995,5,0)
fi
source "$(dirname "$0")/_launch.sh"
