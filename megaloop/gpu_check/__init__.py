"""The one GPU check behind ``tools/gpu_check.sh`` (``python -m megaloop.gpu_check``).

- ``main``: the orchestrator (row order, time budget, output directory, summary);
- ``worker``: the long-lived single-rank process the single-rank rows run in;
- ``probes``: what the worker measures (environment, gradients, timed training steps);
- ``rows``: the command lines, the CPU rehearsal's flag swap, the tolerances and verdicts;
- ``procs``: child processes (logs on disk, tracebacks, nothing left running);
- ``report``: the table and ``summary.json``.
"""
