# Sourced by every recipe after it has filled ARGS (the model and schedule flags). Adds the data,
# tokenizer and --save flags, then either prints the whole command line's flags one per line
# (PRINT_ARGS=1: the test that keeps the recipes parseable reads them), prints the launch as one
# shell-quoted command line to paste or edit (PRINT_ARGS=command), or starts torchrun.
#
#   bash examples/recipes/<recipe>.sh DATA_PREFIX TOKENIZER_MODEL [extra flags...]
# Environment: SIZE=full (default) or cpu; NPROC ranks on this node (default: 8 full, 1 cpu);
# NODES (default 1): more than 1 launches this node as one of NODES joined at MASTER_ADDR
# (MASTER_PORT, default 29500; run the same command on every node);
# TOKENIZER_TYPE (default HuggingFaceTokenizer full, SentencePieceTokenizer cpu); PYTHON;
# SAVE_DIR, the --save folder (default runs/<recipe>_<SIZE> in the repository: where the next
# stage, e.g. looplm_1.4b_midtrain.sh, looks for it). A recipe that sets DATA_IS_BLEND=1 takes
# DATA_PREFIX as one prefix or a quoted blend "W1 PREFIX1 W2 PREFIX2 ..." (split on spaces).
# Extra flags after the two paths are appended last, so they override the recipe's.

DATA_PREFIX=${1:?usage: $0 DATA_PREFIX TOKENIZER_MODEL [extra flags]}
TOKENIZER_MODEL=${2:?usage: $0 DATA_PREFIX TOKENIZER_MODEL [extra flags]}
shift 2
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [[ ${DATA_IS_BLEND:-0} == 1 ]]; then
    read -r -a DATA <<< "$DATA_PREFIX"
else
    DATA=("$DATA_PREFIX")
fi
if [[ $SIZE == cpu ]]; then
    TOKENIZER_TYPE=${TOKENIZER_TYPE:-SentencePieceTokenizer}
    NPROC=${NPROC:-1}
else
    TOKENIZER_TYPE=${TOKENIZER_TYPE:-HuggingFaceTokenizer}
    NPROC=${NPROC:-8}
fi
ARGS+=(--data-path "${DATA[@]}" --tokenizer-type "$TOKENIZER_TYPE"
       --tokenizer-model "$TOKENIZER_MODEL"
       --save "${SAVE_DIR:-$ROOT/runs/$(basename "$0" .sh)_$SIZE}" "$@")

if [[ ${PRINT_ARGS:-0} == 1 ]]; then
    printf '%s\n' "${ARGS[@]}"
    exit 0
fi
PY=${PYTHON:-$ROOT/.venv/bin/python}
[[ $SIZE == cpu ]] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [[ ${PRINT_ARGS:-0} == command ]]; then
    # torchrun's default port (29500) instead of a free one found now; paths are as given.
    [[ $SIZE == cpu ]] && printf 'OMP_NUM_THREADS=%q ' "$OMP_NUM_THREADS"
    printf '%q ' "$PY" -m torch.distributed.run --nproc_per_node "$NPROC" \
        "$ROOT/pretrain_looplm.py" "${ARGS[@]}"
    printf '\n'
    exit 0
fi
cd "$ROOT"
if [[ ${NODES:-1} != 1 ]]; then
    # One launch per node; torchrun's c10d rendezvous at MASTER_ADDR joins the NODES x NPROC ranks.
    exec $PY -m torch.distributed.run --nproc_per_node "$NPROC" --nnodes "$NODES" \
        --rdzv-backend c10d --rdzv-id "${RDZV_ID:-$(basename "$0" .sh)}" \
        --rdzv-endpoint "${MASTER_ADDR:?set MASTER_ADDR to the first node}:${MASTER_PORT:-29500}" \
        pretrain_looplm.py "${ARGS[@]}"
fi
PORT=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
exec $PY -m torch.distributed.run --nproc_per_node "$NPROC" --master_port "$PORT" \
    pretrain_looplm.py "${ARGS[@]}"
