# Sourced by the recipes that start from a public looped model's folder (Ouro, Nanbeige,
# Huginn): the layouts and schedules they share. `hf_layout sft` or `hf_layout rl` sets NPROC,
# TP and ARGS from SIZE and NODES: the size- and layout-dependent flags, then those all take
# (the converted checkpoint IMPORTED with its flags and tokenizer, SAVE_DIR, no dropout; sft:
# DATA in DATA_FORMAT; rl: OBJECTIVE on ENV's PROBLEMS); the recipe then appends its own.
#   SIZE=cpu: 2 ranks at TP 2, two steps at toy sizes.
#   full, one 8-GPU node: TP 1 x DP 8, distributed optimizer; NODES=4: TP 2 x DP 16.
# SFT (megaloop's choice for a converged model): sequences of 4096, global batch 128 (0.5M
# tokens per step), LR 2e-5 warmed up over 100 steps, cosine to 2e-6 over 2000 steps.
# RL ("Closing the Loop" Appendix C): groups of 8, 32 prompts per optimizer step, LR 1e-5, 140
# steps; completions of 512 tokens (megaloop's choice).
hf_layout() {
    if [[ $SIZE == cpu ]]; then
        NPROC=${NPROC:-2}; TP=${TP:-2}
    elif [[ ${NODES:-1} == 4 ]]; then
        NPROC=${NPROC:-8}; TP=${TP:-2}
    else
        NPROC=${NPROC:-8}; TP=${TP:-1}
    fi
    if [[ $1 == rl && $SIZE == cpu ]]; then
        ARGS=(--prompts-per-step 2 --group-size 2 --max-new-tokens 4 --micro-batch-size 2
              --train-iters 2 --lr 1e-5 --log-interval 1)
    elif [[ $1 == rl ]]; then
        ARGS=(--prompts-per-step 32 --group-size 8 --max-new-tokens 512 --micro-batch-size 8
              --train-iters 140 --lr 1e-5 --bf16 --use-distributed-optimizer --log-interval 1
              --save-interval 20)
    elif [[ $SIZE == cpu ]]; then
        ARGS=(--seq-length 32 --micro-batch-size 2 --global-batch-size 4 --train-iters 2
              --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 1 --lr-decay-style cosine
              --log-interval 1 --eval-interval 1000 --eval-iters 1 --split 90,10,0 --num-workers 0)
    else
        # micro-batch 1 on one node, 2 on four: the same global batch of 128
        ARGS=(--seq-length 4096 --micro-batch-size $(( ${NODES:-1} == 4 ? 2 : 1 ))
              --global-batch-size 128 --bf16
              --use-distributed-optimizer --train-iters 2000 --lr 2e-5 --min-lr 2e-6
              --lr-warmup-iters 100 --lr-decay-style cosine --log-interval 10 --eval-interval 200
              --eval-iters 10 --split 995,5,0)
    fi
    ARGS+=(--hidden-dropout 0 --attention-dropout 0 --tensor-model-parallel-size "$TP"
           --use-checkpoint-args --load "$IMPORTED"
           --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$IMPORTED/tokenizer"
           --save "$SAVE_DIR")
    if [[ $1 == rl ]]; then
        ARGS+=(--objective "$OBJECTIVE" --temperature 0.9 --env "$ENV" --env-path "$PROBLEMS"
               --lr-decay-style constant --weight-decay 0.0 --clip-grad 1.0)
    else
        ARGS+=(--finetune --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
               --data-path "$DATA")
        [[ $DATA_FORMAT == sft ]] && ARGS+=(--data-format sft)
    fi
    return 0
}
