#!/usr/bin/env bash
# A SpiralFormer-B-style looped model on CPU ("SpiralFormer" (arXiv 2602.11698)): P + K x {1/8, 1/4,
# 1/2, 1} + C with the MeSH topology, self-aggregation down-scaling and output-dependent up-scaling,
# on the demo corpus. Layout here: 1 + 2 x {1/8,1/4,1/2,1} + 1, hidden 128, 128-token sequences (16
# latents at 1/8). Trains the final step only (--exit-loss last, as SpiralFormer), then writes
# attention probes of the saved checkpoint (tools/attention_probes.py: key-marginal entropy and
# local attention mass per loop step and head, a table and a PNG).
# Usage: [ITERS=300] bash examples/spiral_cpu.sh [OUTPUT_DIR]   (default: demo/; reuses
# demo_cpu.sh's corpus). Slow: 10-13 s per iteration on 2 cores, about an hour at the default 300
# iterations; ITERS=20 is a 4-minute look (the warm-up, log and evaluation intervals follow ITERS).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-demo}
ITERS=${ITERS:-300}
case "$ITERS" in
    ''|*[!0-9]*|0) echo "error: ITERS=$ITERS: the number of training iterations, a whole number > 0" >&2
        exit 2 ;;
esac
WARMUP=$(( ITERS / 10 < 30 ? ITERS / 10 : 30 ))
LOG=$(( ITERS < 25 ? ITERS : 25 ))
EVAL=$(( ITERS < 100 ? ITERS : 100 ))
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

if [ ! -f "$OUT/corpus_text_document.bin" ]; then
    echo "== corpus, tokenizer, .bin/.idx (as examples/demo_cpu.sh)"
    PYTHON=$PY bash examples/recipes/make_demo_data.sh "$OUT"
fi

echo "== pretrain SpiralFormer-B-style 1 + 2 x {1/8,1/4,1/2,1} + 1, MeSH (1 CPU rank), $ITERS iterations"
echo "   (10-13 s each on 2 cores: about $(( ITERS * 12 / 60 )) min; ITERS=N for fewer)"
PORT=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
$PY -m torch.distributed.run --nproc_per_node 1 --master_port "$PORT" pretrain_looplm.py \
    --num-layers 4 --num-prelude-layers 1 --num-coda-layers 1 --num-loops 4 \
    --loop-resolutions 1/8,1/4,1/2,1 --loop-topology mesh \
    --resolution-down self-aggregation --resolution-up allocation \
    --exit-loss last --step-norm-placement readout \
    --hidden-size 128 --num-attention-heads 4 \
    --swiglu --position-embedding-type rope --normalization RMSNorm \
    --hidden-dropout 0 --attention-dropout 0 --disable-bias-linear \
    --seq-length 128 --max-position-embeddings 128 \
    --micro-batch-size 16 --global-batch-size 16 --train-iters "$ITERS" \
    --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters "$WARMUP" --lr-decay-style cosine --weight-decay 0.1 \
    --data-path "$OUT/corpus_text_document" --split 98,2,0 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$OUT/tokenizer.model" \
    --num-workers 0 \
    --log-interval "$LOG" --eval-interval "$EVAL" --eval-iters 4 --log-jsonl "$OUT/spiral_train.jsonl" \
    --save "$OUT/spiral_ckpt" --save-interval "$ITERS"

echo "== attention probes per loop step and head"
$PY tools/attention_probes.py --load "$OUT/spiral_ckpt" --data-path "$OUT/corpus_text_document" \
    --num-batches 4 --output "$OUT/spiral_probes"
echo "== done: $OUT/spiral_train.jsonl, $OUT/spiral_probes.{md,png}"
