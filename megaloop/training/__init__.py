"""Training: the run sequence (``run(argv) -> exit code``, megaloop/training/run.py), the
Trainer, its checkpoints, schedules, diagnostics and logging."""

from megaloop.training.run import run  # noqa: F401  (standard library only at import)
