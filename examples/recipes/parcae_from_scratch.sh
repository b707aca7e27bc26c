#!/usr/bin/env bash
# From "Parcae" (arXiv 2604.12946): a looped model trained from scratch. Prelude, recurrent block
# and coda of PARCAE layers each (pre-norm blocks with QK-norm, RMSNorm eps 1e-5, squared-ReLU MLP
# of 4x, no biases, interleaved RoPE of base 50000, head dim 128, tied embeddings, context 2048).
# The state starts as noise (truncated normal, std sqrt(2 / (5 d))); before every pass of the
# recurrent block it is updated as h <- exp(-dt A) * h + dt * (B e), dt = softplus(dt_bias),
# A = exp(A_log) per channel, B a [d, d] matrix (identity at start), e the prelude output
# RMS-normed once; no norm between passes; the coda reads C h_T (C a [d, d] matrix). Loss on the
# last pass only (no exit gate); 8 passes at evaluation.
#
#   [SIZE=cpu] [PARCAE=small|medium|large|xlarge] bash examples/recipes/parcae_from_scratch.sh \
#       DATA_PREFIX TOKENIZER_MODEL [extra flags]
# PARCAE (default small, the smallest published size), as Parcae's configs:
#   small  2/2/2 layers x 768,  6 heads, 11.2B tokens    medium 4/4/4 x 1024,  8 heads, 29.6B
#   large  6/6/6 x 1280, 10 heads, 61.6B tokens         xlarge 8/8/8 x 1536, 12 heads, 104B
# Layout: one 8-GPU node, DP 8 (NODES=1, the default); NODES=n nodes: DP 8n, one launch per node
# with MASTER_ADDR set to the first (_launch.sh joins them by c10d rendezvous). The global batch
# stays 256 sequences of 2048 tokens (Parcae's 0.5M tokens per step) at any layout; micro-batches
# are Parcae's (32, 16, 8, 8 sequences), lower them with an extra --micro-batch-size if memory
# runs short.
#
# Not exact (docs/training.md#parcae): Parcae draws each sequence's depth max(1, Poisson(8)) and
# backpropagates through the last min(depth, 4) passes; megaloop draws one depth per optimizer
# step, 1 + Poisson(7) (the same mean 8, --random-depth-sigma 0), and backpropagates through its
# last 4 passes (--backprop-last-steps 4). Exact: Parcae's value embeddings (a token-indexed
# table added to the values of every other layer, --value-embeddings) and its parameter-free
# QK-norm (--qk-layernorm-scale-free: applied before RoPE, the same over a whole head). The MLP
# is relu(x)^2 where Parcae's code halves it (the 1/2 folds into fc2). Init:
# megatron-core's normal init of std sqrt(2 / (5 d)) and scaled output layers, where Parcae
# zero-initialises the attention and MLP output projections and draws the others orthogonal.
# Optimizer: Muon (momentum 0.95, 5 Newton-Schulz steps) for the hidden matrices + Adam
# (0.8, 0.95, eps 1e-10) for the rest, one LR (Parcae: 8e-3 for both at small / medium; Adam 6e-3,
# Muon 8e-3 at large / xlarge, where this recipe takes Muon's 8e-3), one weight decay 0 (Parcae:
# 0 for Adam, 0.2 decaying linearly for Muon), clip 1.0; WSD: no warm-up, constant, then a linear
# decay to 0 over the last half (Parcae's trapezoid with cooldown 0.5).
set -euo pipefail
source "$(dirname "$0")/_sizes.sh"
SIZE=${SIZE:-full}
PARCAE=${PARCAE:-small}
PARCAE_ARCH=(--norm-scheme pre --normalization RMSNorm --norm-epsilon 1e-5 --squared-relu
             --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --qk-layernorm
             --qk-layernorm-scale-free --value-embeddings
             --position-embedding-type rope --rotary-base 50000 --rotary-interleaved
             --num-loops 8 --exit-loss last --step-norm identity --step-norm-placement readout
             --readout-projection --input-injection parcae --injection-source prelude
             --injection-source-norm --state-init noise)
PARCAE_OPT=(--optimizer muon --muon-momentum 0.95 --muon-num-ns-steps 5
            --adam-beta1 0.8 --adam-beta2 0.95 --adam-eps 1e-10 --weight-decay 0.0
            --clip-grad 1.0 --lr-decay-style WSD --lr-wsd-decay-style linear
            --lr-warmup-iters 0 --min-lr 0)
if [[ $SIZE == cpu ]]; then
    # Every switch of the recipe at toy sizes (2/2/2 layers x 64, head dim 16): random depth
    # 1 + Poisson(3), the last 2 passes trained, 4 passes at evaluation; about a minute on CPU.
    ARGS=(--num-layers 6 --num-prelude-layers 2 --num-coda-layers 2 "${PARCAE_ARCH[@]}"
          --num-loops 4 --random-depth-mean 3 --random-depth-sigma 0 --random-depth-max 6
          --backprop-last-steps 2 "${PARCAE_OPT[@]}" --num-workers 0
          --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 --init-method-std 0.079
          --seq-length 64 --max-position-embeddings 64 --micro-batch-size 8 --global-batch-size 8
          --train-iters 300 --lr 3e-3 --lr-wsd-decay-iters 150
          --log-interval 50 --eval-interval 1000 --eval-iters 2 --split 98,2,0)
else
    case $PARCAE in
        # layers per part, hidden, heads, micro-batch, iterations (tokens / 524,288), LR
        small)  P=2; H=768;  HEADS=6;  MBS=32; ITERS=21362;  LR=8e-3 ;;
        medium) P=4; H=1024; HEADS=8;  MBS=16; ITERS=56458;  LR=8e-3 ;;
        large)  P=6; H=1280; HEADS=10; MBS=8;  ITERS=117493; LR=8e-3 ;;
        xlarge) P=8; H=1536; HEADS=12; MBS=8;  ITERS=198364; LR=8e-3 ;;
        *) echo "PARCAE=$PARCAE: choose small, medium, large or xlarge" >&2; exit 2 ;;
    esac
    # init std sqrt(2 / (5 d)), Parcae's "scaled" std (and its C's orthogonal gain / sqrt(d))
    STD=$(awk -v d="$H" 'BEGIN { printf "%.6f", sqrt(2 / (5 * d)) }')
    ARGS=(--num-layers $((3 * P)) --num-prelude-layers "$P" --num-coda-layers "$P"
          "${PARCAE_ARCH[@]}" --random-depth-mean 7 --random-depth-sigma 0
          --backprop-last-steps 4 "${PARCAE_OPT[@]}"
          --hidden-size "$H" --num-attention-heads "$HEADS" --kv-channels 128
          --ffn-hidden-size $((4 * H)) --init-method-std "$STD"
          --seq-length 2048 --max-position-embeddings 2048 --bf16
          --micro-batch-size "$MBS" --global-batch-size 256
          --train-iters "$ITERS" --lr "$LR" --lr-wsd-decay-iters $((ITERS / 2))
          --log-interval 10 --eval-interval 1000 --eval-iters 10 --split 995,5,0)
fi
source "$(dirname "$0")/_launch.sh"
