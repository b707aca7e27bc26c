#!/usr/bin/env bash
# The mid-training data for the CPU recipe looplm_1.4b_midtrain.sh, from the demo corpus' own
# generator, tokenized with the demo tokenizer (run make_demo_data.sh into the same folder first):
#   <OUT>/midtrain_sft_text_document  instruction data: the demo tasks as prompt/response pairs
#                                     (prompt: the problem; response: "answer: X."), loss on the
#                                     response only;
#   <OUT>/midtrain_hq_text_document   "high-quality" data: documents of problems with their
#                                     answers and no prose, loss on every token (an SFT example
#                                     with an empty prompt);
#   <OUT>/midtrain_tasks.jsonl        held-out problems (family, k, answer) for evaluation.
# Every file has its own --seed, none the pretraining corpus' (make_demo_data.sh uses 1).
# Then:
#   SIZE=cpu bash examples/recipes/looplm_1.4b_midtrain.sh \
#       "0.7 demo/midtrain_sft_text_document 0.3 demo/midtrain_hq_text_document" \
#       demo/tokenizer.model
# Usage: bash examples/recipes/make_demo_midtrain_data.sh [OUTPUT_DIR]   (default: demo/)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-demo}
TOKENIZER=$OUT/tokenizer.model
[[ -f $TOKENIZER ]] || { echo "error: $TOKENIZER not found: run" \
    "examples/recipes/make_demo_data.sh $OUT first (the stages share its tokenizer)" >&2; exit 2; }
$PY tools/make_demo_corpus.py --output "$OUT/midtrain_hq_raw.jsonl" --num-docs 5000 \
    --prose-fraction 0 --sft-output "$OUT/midtrain_sft.jsonl" --num-sft 20000 \
    --tasks-output "$OUT/midtrain_tasks.jsonl" --num-tasks 300 --seed 11
# A text document as an SFT example whose prompt is empty: the loss covers all of it.
$PY -c 'import json, sys
for line in sys.stdin:
    print(json.dumps({"prompt": "", "response": json.loads(line)["text"]}))' \
    < "$OUT/midtrain_hq_raw.jsonl" > "$OUT/midtrain_hq.jsonl"
for part in sft hq; do
    $PY tools/preprocess_data.py --input "$OUT/midtrain_$part.jsonl" \
        --output-prefix "$OUT/midtrain_$part" --data-format sft \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER" --workers 2
done
