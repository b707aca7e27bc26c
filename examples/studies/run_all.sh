#!/usr/bin/env bash
# Run the eight studies one after another (rl starts from midtrain's checkpoints); each writes OUTPUT/studies/<name>.md and .png.
#   bash examples/studies/run_all.sh --size cpu --output-dir studies_out   (3 seeds per arm: about
#       20-60 min per study on 2 shared cores; the reasoning studies train 400 iterations)
#   bash examples/studies/run_all.sh --size tiny --output-dir /tmp/studies    (the test's size)
# Extra flags go to every study (--data-path/--tokenizer-model, --task-file, --seed, --seeds).
# Threads per run: STUDY_THREADS (torch) and OMP_NUM_THREADS. With other CPU jobs beside the
# studies set both to 1: oversubscribed OpenMP threads made one run 15x slower on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
for study in loop_vs_dense gate_collapse norm_placement dense_to_loop multi_resolution \
             extrapolation midtrain rl; do
    echo "== $study"
    $PY "examples/studies/$study.py" "$@"
done
