#!/usr/bin/env bash
# From "Closing the Loop" (arXiv 2610.00673): from-scratch LoopLM-1.4B: the Ouro backbone, 24 layers
# looped T=4 times (effective depth 96), Ouro norm scheme, per-token exit gate trained with the
# expected loss and KL coefficient
# beta = 0.15, LR warmup + cosine. Its dense twins: dense_24l.sh (same 24 layers, T=1) and
# dense_72l.sh (72 layers, T=1). SIZE=cpu: the same recipe at CPU size.
set -euo pipefail
source "$(dirname "$0")/_sizes.sh"
SIZE=${SIZE:-full}
RECIPE=(--num-loops 4 --norm-scheme ouro --step-norm rms --exit-loss expected --exit-kl-beta 0.15)
if [[ $SIZE == cpu ]]; then
    ARGS=(--num-layers 2 "${RECIPE[@]}" "${CPU_BACKBONE[@]}" "${CPU_SCHEDULE[@]}")
else
    ARGS=(--num-layers 24 "${RECIPE[@]}" "${FULL_BACKBONE[@]}" "${FULL_SCHEDULE[@]}")
fi
source "$(dirname "$0")/_launch.sh"
