#!/bin/bash
# The one GPU check: every GPU-only path of megaloop in one run of at most ~10 minutes on one
# H100/H200, one table, exit status non-zero if any check failed (tools/gpu_checks.py has the
# list). On a machine without a GPU it runs the CPU-runnable checks and prints "no GPU: skipped"
# rows (exit 0).
#
#   bash tools/gpu_check.sh                                  # on a GPU node, in the repo root
#   srun --gpus 1 --time 15 bash tools/gpu_check.sh          # on a SLURM cluster node
#   docker run --gpus all --ipc=host --rm megaloop bash tools/gpu_check.sh   # in the image
#
# Environment: PYTHON (default: .venv/bin/python if present, else python), GPU_CHECK_BUDGET_S,
# GPU_CHECK_PEAK_TFLOPS, GPU_CHECK_FP8_ARGS (see tools/gpu_checks.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python; fi
fi
export PYTHON
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
cd "$ROOT"
exec "$PYTHON" tools/gpu_checks.py run "$@"
