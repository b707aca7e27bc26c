#!/usr/bin/env bash
# From "Closing the Loop" (arXiv 2610.00673): dense-ouro-3.9B twin of looplm_1.4b.sh: three 24-layer
# blocks stacked into 72 distinct layers, run once; it matches the LoopLM's inference compute at
# three recurrent steps (24 x 3). The CPU size keeps the ratio: 6 layers against the loop's 2
# layers.
set -euo pipefail
source "$(dirname "$0")/_sizes.sh"
SIZE=${SIZE:-full}
RECIPE=(--num-loops 1 --norm-scheme ouro --step-norm rms)
if [[ $SIZE == cpu ]]; then
    ARGS=(--num-layers 6 "${RECIPE[@]}" "${CPU_BACKBONE[@]}" "${CPU_SCHEDULE[@]}")
else
    ARGS=(--num-layers 72 "${RECIPE[@]}" "${FULL_BACKBONE[@]}" "${FULL_SCHEDULE[@]}")
fi
source "$(dirname "$0")/_launch.sh"
