"""The two ways a checkpoint is refused. Standard library only (flag checks raise them before
torch is imported)."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read as asked; the message names the file and the
    way out. A ValueError: before training starts it is a bad --load like a bad flag. Raised on
    every rank alike, so the ranks leave together; ``exit_code`` is the run's exit status."""

    exit_code = 1


class CheckpointMismatch(CheckpointError):
    """A checkpoint that does not fit this run's flags (found at load, before any step): the
    run exits 2, as for a bad flag; the message names the flag and its two values."""

    exit_code = 2
