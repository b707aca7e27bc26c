#!/usr/bin/env bash
# From "Closing the Loop" (arXiv 2610.00673), stage 2 of its two-stage recipe: high-quality
# mid-training (its Section 3.4 and Table 1). Continues the pretraining checkpoint of
# looplm_1.4b.sh on instruction-response pairs with the loss on the response tokens only
# (--data-format sft), blended with high-quality data; architecture, recurrent depth, beta,
# weight decay and optimizer stay those of pretraining, the data and the LR schedule are new.
# "The same stage is applied to both dense baselines": PRETRAIN_RECIPE=dense_24l (or dense_72l)
# mid-trains that recipe's checkpoint with the same data and schedule.
#
#   [SIZE=cpu] bash examples/recipes/looplm_1.4b_midtrain.sh DATA TOKENIZER_MODEL [extra flags]
# DATA: one <prefix>_text_document written by preprocess_data.py --data-format sft, or a quoted
# blend "0.7 sft_text_document 0.3 hq_text_document" (high-quality documents are SFT examples
# with an empty prompt: loss on every token); make_demo_midtrain_data.sh writes both at cpu size.
# Environment (besides _launch.sh's): PRETRAIN_RECIPE (default looplm_1.4b), whose flags this
# stage reads so the two cannot drift apart; PRETRAINED, the checkpoint folder to start from
# (default runs/<PRETRAIN_RECIPE>_<SIZE>, where that recipe saves); SAVE_DIR (default
# runs/<PRETRAIN_RECIPE>_midtrain_<SIZE>).
#
# The stage starts with --finetune: the checkpoint's weights only, iteration 0, fresh AdamW
# moments, a new data position and a new LR schedule that warms up again from 0. (Resuming with
# --override-opt_param-scheduler would keep the checkpoint's iteration count, past any warmup
# counted from 0.) A restart, e.g. after preemption, finds a checkpoint in SAVE_DIR and resumes
# the mid-training run itself instead.
# Schedule: the paper mid-trains for 100B tokens (48,000 steps of 512 x 4096 tokens). Peak LR,
# warmup and floor are megaloop's choice: a re-warm to a third of the pretraining peak over 2% of
# the stage, cosine down to a tenth of that (override with --lr, --min-lr, --lr-warmup-iters).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
source "$HERE/_sizes.sh"
SIZE=${SIZE:-full}
DATA=${1:?usage: $0 DATA TOKENIZER_MODEL [extra flags]}
TOKENIZER=${2:?usage: $0 DATA TOKENIZER_MODEL [extra flags]}
PRETRAIN_RECIPE=${PRETRAIN_RECIPE:-looplm_1.4b}
[[ -f $HERE/$PRETRAIN_RECIPE.sh ]] || { echo "error: PRETRAIN_RECIPE=$PRETRAIN_RECIPE: no" \
    "$HERE/$PRETRAIN_RECIPE.sh (use looplm_1.4b, dense_24l or dense_72l)" >&2; exit 2; }
ROOT="$(cd "$HERE/../.." && pwd)"
PRETRAINED=${PRETRAINED:-$ROOT/runs/${PRETRAIN_RECIPE}_$SIZE}
SAVE_DIR=${SAVE_DIR:-$ROOT/runs/${PRETRAIN_RECIPE}_midtrain_$SIZE}

if [[ $SIZE == cpu ]]; then
    SCHEDULE=(--train-iters 150 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 3
              --lr-decay-style cosine)
else
    SCHEDULE=(--train-iters 48000 --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 1000
              --lr-decay-style cosine)
fi
# The pretraining recipe's flags (all before the --data-path that _launch.sh appends), less the
# schedule flags this stage sets again (each takes one value).
declare -A SET_AGAIN=()
for ((i = 0; i < ${#SCHEDULE[@]}; i += 2)); do SET_AGAIN[${SCHEDULE[i]}]=1; done
mapfile -t STAGE1 < <(PRINT_ARGS=1 SIZE=$SIZE bash "$HERE/$PRETRAIN_RECIPE.sh" data tokenizer)
ARGS=()
for ((i = 0; i < ${#STAGE1[@]}; i++)); do
    flag=${STAGE1[i]}
    [[ $flag == --data-path ]] && break
    if [[ -n ${SET_AGAIN[$flag]:-} ]]; then
        i=$((i + 1))
    else
        ARGS+=("$flag")
    fi
done
ARGS+=("${SCHEDULE[@]}" --data-format sft)
if [[ -f $SAVE_DIR/latest_checkpointed_iteration.txt ]]; then
    ARGS+=(--load "$SAVE_DIR")  # this stage's own checkpoint: resume it
else
    if [[ ${PRINT_ARGS:-0} != 1 && ! -f $PRETRAINED/latest_checkpointed_iteration.txt ]]; then
        echo "error: PRETRAINED=$PRETRAINED holds no checkpoint: run" \
            "examples/recipes/$PRETRAIN_RECIPE.sh first or set PRETRAINED" >&2
        exit 2
    fi
    ARGS+=(--load "$PRETRAINED" --finetune)
fi
DATA_IS_BLEND=1
source "$HERE/_launch.sh"
