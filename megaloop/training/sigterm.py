"""SIGTERM recorded, not fatal (--exit-signal-handler), from as early in the process as possible.

Standard library only, so ``megaloop.training.run`` installs it right after the flags are parsed,
before torch and megatron-core are imported: a job's start-up takes tens of seconds, and SLURM may
send its ``--signal`` up to a minute early, so on a short job the signal can arrive there. A rank
that died of it would leave no word of why; a recorded one makes the trainer stop before its first
step (megaloop.training.exit_conditions.ExitConditions.before_training).
"""

from __future__ import annotations

import signal
from typing import Optional

_received: Optional[int] = None  # the signal recorded, process-wide
_previous = None  # the handler catch() replaced (None: not installed)


def _record(signum, frame):  # noqa: ARG001 - signal handler signature
    global _received
    _received = signum


def catch() -> None:
    """From now on a SIGTERM is recorded instead of ending the process. Idempotent."""
    global _previous
    if _previous is None:
        _previous = signal.signal(signal.SIGTERM, _record)


def release() -> None:
    """Give SIGTERM back to the handler ``catch`` replaced, and forget a recorded one."""
    global _previous, _received
    if _previous is not None:
        signal.signal(signal.SIGTERM, _previous)
    _previous, _received = None, None


def received() -> Optional[int]:
    """The signal recorded since ``catch``, or None."""
    return _received
