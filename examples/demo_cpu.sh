#!/usr/bin/env bash
# The whole pipeline on CPU in a few minutes, on a corpus megaloop generates itself:
#   generate -> train a tokenizer -> preprocess to Megatron .bin/.idx -> torchrun pretraining of a
#   tiny looped model (2 ranks, TP=2) -> validation loss per loop step -> a checkpoint ->
#   greedy continuations of a few demo-task prompts with tools/generate.py -> a picture of the run.
# The model is Llama-style (SwiGLU, RoPE, RMSNorm, no dropout, no biases): those flags are spelled
# out, since megaloop's defaults are Megatron-LM's (GELU, learned positions, LayerNorm, dropout
# 0.1, biases).
# Usage: bash examples/demo_cpu.sh [OUTPUT_DIR]   (default: demo/)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-demo}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1

echo "== 1-3/6 generate the demo corpus, train a 512-token sentencepiece BPE, preprocess to .bin/.idx"
PYTHON=$PY bash examples/recipes/make_demo_data.sh "$OUT"
echo "== 4/6 pretrain a looped model: 0 + 2 x 4 + 0, TP=2 on 2 CPU ranks"
PORT=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
$PY -m torch.distributed.run --nproc_per_node 2 --master_port "$PORT" pretrain_looplm.py \
    --tensor-model-parallel-size 2 \
    --num-layers 2 --num-loops 4 --hidden-size 128 --num-attention-heads 4 \
    --swiglu --position-embedding-type rope --normalization RMSNorm \
    --hidden-dropout 0 --attention-dropout 0 --disable-bias-linear \
    --seq-length 128 --max-position-embeddings 128 \
    --micro-batch-size 8 --global-batch-size 16 --train-iters 300 \
    --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 30 --lr-decay-style cosine --weight-decay 0.1 \
    --exit-kl-beta 0.15 \
    --data-path "$OUT/corpus_text_document" --split 98,2,0 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$OUT/tokenizer.model" \
    --num-workers 0 \
    --log-interval 25 --eval-interval 100 --eval-iters 4 --log-jsonl "$OUT/train.jsonl" \
    --save "$OUT/checkpoint"
echo "== 5/6 generate from the checkpoint (greedy, KV cache per loop step)"
$PY tools/generate.py --load "$OUT/checkpoint" --max-tokens 12 \
    --prompt "x=7. y=x. z=y. what is z? answer:" \
    --prompt "a=4; b=a+3; c=b*2; c=? answer:" \
    --prompt "the quiet robot"
echo "== 6/6 draw the run (losses per loop step, exit distribution, p0, gradient norms, geometry)"
$PY tools/plot_run.py "$OUT/train.jsonl" --output "$OUT/train.png"
echo "== done: per-iteration records in $OUT/train.jsonl (split=valid lines hold per-step validation losses), checkpoint in $OUT/checkpoint, picture in $OUT/train.png"
