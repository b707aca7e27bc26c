#!/usr/bin/env bash
# The demo corpus for the CPU recipes (as examples/demo_cpu.sh makes it): generated documents,
# a 512-token sentencepiece BPE, Megatron .bin/.idx. Then, for example:
#   SIZE=cpu bash examples/recipes/looplm_1.4b.sh demo/corpus_text_document demo/tokenizer.model
# Usage: bash examples/recipes/make_demo_data.sh [OUTPUT_DIR]   (default: demo/)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-demo}
mkdir -p "$OUT"
$PY tools/make_demo_corpus.py --output "$OUT/corpus.jsonl" --num-docs 20000 --seed 1
$PY tools/train_tokenizer.py --input "$OUT/corpus.jsonl" --output-prefix "$OUT/tokenizer" \
    --vocab-size 512
$PY tools/preprocess_data.py --input "$OUT/corpus.jsonl" --output-prefix "$OUT/corpus" \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$OUT/tokenizer.model" \
    --append-eod --workers 2
