# Shared size presets, sourced by the recipes. FULL_* is the Ouro-1.4B backbone ("Scaling
# Latent Reasoning via Looped Language Models"; "Closing the Loop", arXiv 2610.00673, Table 10
# matches it): hidden 2048, 16 heads, head dim 128, SwiGLU 5632, RoPE, untied embeddings,
# RMSNorm eps 1e-6.
# LLAMA_STYLE: the model family of every recipe (megaloop's flags default to Megatron-LM's GELU,
# learned absolute positions, LayerNorm, dropout 0.1 and linear biases).
# CPU_* keeps every switch of the recipe but shrinks widths, sequence and schedule so a run on
# the demo corpus (examples/recipes/make_demo_data.sh) takes about a minute on one CPU rank.
LLAMA_STYLE=(--swiglu --position-embedding-type rope --normalization RMSNorm
             --hidden-dropout 0 --attention-dropout 0 --disable-bias-linear)
FULL_BACKBONE=("${LLAMA_STYLE[@]}"
               --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 5632
               --seq-length 4096 --max-position-embeddings 4096 --untie-embeddings-and-output-weights
               --norm-epsilon 1e-6 --bf16 --micro-batch-size 4 --global-batch-size 512
               --log-interval 10 --eval-interval 1000 --eval-iters 10 --split 995,5,0)
CPU_BACKBONE=("${LLAMA_STYLE[@]}" --num-workers 0
              --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 176
              --seq-length 64 --max-position-embeddings 64 --untie-embeddings-and-output-weights
              --norm-epsilon 1e-6 --micro-batch-size 8 --global-batch-size 8
              --log-interval 50 --eval-interval 1000 --eval-iters 2 --split 98,2,0)
# From "Closing the Loop" (arXiv 2610.00673): schedule: linear warmup then cosine decay (full: ~100B
# tokens at 2M tokens per step).
FULL_SCHEDULE=(--train-iters 50000 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2000
               --lr-decay-style cosine --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
               --clip-grad 1.0)
CPU_SCHEDULE=(--train-iters 300 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 30
              --lr-decay-style cosine --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
              --clip-grad 1.0)
