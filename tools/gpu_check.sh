#!/bin/bash
# The one GPU check: every GPU-only path of megaloop in one run of at most ~10 minutes on one
# H100/H200 (megaloop/gpu_check/main.py has the rows). Each row's full log, the checkpoints,
# summary.md and summary.json go to --output-dir (default gpu_check_<date>-<time>/ in the current
# directory): send that directory back when a row fails. Exit status 1 if any correctness row
# failed (the performance goals are reported apart and do not count), 2 if the interpreter cannot
# run it. Without a GPU it runs the CPU rehearsal of every row (the same command lines, GPU-only
# flags swapped, tiny shapes).
#
#   bash tools/gpu_check.sh                                  # on a GPU node, from any directory
#   srun --gpus 1 --time 15 bash tools/gpu_check.sh          # on a SLURM cluster node
#   docker run --gpus all --ipc=host --rm megaloop bash tools/gpu_check.sh   # in the image
#
# Environment: PYTHON (the interpreter; default the python3 on PATH, i.e. the container's, never
# the repository's CPU venv), GPU_CHECK_BUDGET_S (default 570), GPU_CHECK_PEAK_TFLOPS (the GPU's
# dense BF16 peak, when its name is not in megaloop/gpu_check/rows.py's table).
# The default output directory is made in the current directory, from wherever it is started.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GPU_CHECK_PYTHON_FROM="\$PYTHON"
if [[ -z "${PYTHON:-}" ]]; then
    GPU_CHECK_PYTHON_FROM="the first python3 on PATH"
    PYTHON="$(command -v python3 || command -v python || true)"
    if [[ -z "$PYTHON" ]]; then
        echo "error: no python3 or python on PATH; name the interpreter with torch and" \
             "megatron-core: PYTHON=/path/to/python bash $0" >&2
        exit 2
    fi
fi
export PYTHON GPU_CHECK_PYTHON_FROM  # the latter: for the message if it lacks torch
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# The repository on the module path instead of a cd into it: the current directory stays the
# user's (relative --output-dir and the default one land there). The interpreter check
# (torch importable, else one line naming the interpreter and PYTHON=) is the module's own.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m megaloop.gpu_check "$@"
