#!/usr/bin/env bash
# From "Closing the Loop" (arXiv 2610.00673): dense-ouro-1.4B twin of looplm_1.4b.sh, the same
# parameter count: the 24 layers run once (T=1, no gate), everything else equal, so the gain of
# looping is measured at fixed parameter count.
set -euo pipefail
source "$(dirname "$0")/_sizes.sh"
SIZE=${SIZE:-full}
RECIPE=(--num-loops 1 --norm-scheme ouro --step-norm rms)
if [[ $SIZE == cpu ]]; then
    ARGS=(--num-layers 2 "${RECIPE[@]}" "${CPU_BACKBONE[@]}" "${CPU_SCHEDULE[@]}")
else
    ARGS=(--num-layers 24 "${RECIPE[@]}" "${FULL_BACKBONE[@]}" "${FULL_SCHEDULE[@]}")
fi
source "$(dirname "$0")/_launch.sh"
