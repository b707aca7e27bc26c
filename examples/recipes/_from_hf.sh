# Sourced by the recipes that start from a public looped model's Hugging Face folder (Ouro,
# Nanbeige, Huginn) once they have filled ARGS. Needs HF_DIR (the folder), IMPORTED (where its converted
# checkpoint goes), TP, NPROC, SIZE, PY, ROOT, ENTRY (pretrain_looplm.py or train_rl.py) and
# RDZV_ID. PRINT_ARGS=1 prints the entry point's flags one per line instead of running. Step 1
# converts the folder once (tools/convert_checkpoint.py import-hf; every config.json key honoured
# or refused by name, the tokenizer copied to IMPORTED/tokenizer); step 2 launches ENTRY under
# torchrun: on this node (NODES=1), or as one of NODES nodes joined by c10d rendezvous at
# MASTER_ADDR (convert first on one node with IMPORT_ONLY=1: every node would convert at once).
if [[ ${PRINT_ARGS:-0} == 1 ]]; then
    printf '%s\n' "${ARGS[@]}"
    exit 0
fi

cd "$ROOT"
if [[ ! -f $IMPORTED/latest_checkpointed_iteration.txt ]]; then
    if [[ ${NODES:-1} != 1 && ${IMPORT_ONLY:-0} != 1 ]]; then
        echo "error: $IMPORTED holds no converted checkpoint: run IMPORT_ONLY=1 on one node" \
            "first (every node would convert at once)" >&2
        exit 2
    fi
    echo "== import $HF_DIR -> $IMPORTED"
    $PY tools/convert_checkpoint.py import-hf --hf-dir "$HF_DIR" --save "$IMPORTED" \
        --tensor-model-parallel-size "$TP" --no-progress
fi
[[ ${IMPORT_ONLY:-0} == 1 ]] && exit 0
[[ $SIZE == cpu ]] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [[ ${NODES:-1} == 1 ]]; then
    PORT=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    LAUNCH=(--nproc_per_node "$NPROC" --master_port "$PORT")
else
    LAUNCH=(--nproc_per_node "$NPROC" --nnodes "$NODES" --rdzv-backend c10d
            --rdzv-endpoint "${MASTER_ADDR:?set MASTER_ADDR to the first node}:${MASTER_PORT:-29500}"
            --rdzv-id "$RDZV_ID")
fi
exec $PY -m torch.distributed.run "${LAUNCH[@]}" "$ENTRY" "${ARGS[@]}"
