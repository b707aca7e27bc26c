"""Where start-up time goes: seconds per phase, from the process's start to the end of the first
training step, on one compact line (rank 0) and in the first JSONL train record.

Every second of start-up is paid by every rank of a job, and at a thousand nodes a slow phase
(imports on a shared file system, an index build, a checkpoint load) is the first thing to find.
Phases are consecutive: each covers the time since the previous mark, so they sum to the total
exactly, and the first one starts when the kernel started the process (``/proc/self/stat``), not
when Python got to this module.
"""

from __future__ import annotations

import os
import time
from typing import Optional


def seconds_since_process_start() -> Optional[float]:
    """Seconds since this process was started (Linux ``/proc``, 10 ms resolution), or None
    where ``/proc`` is not there."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (starttime, in clock ticks since boot) follows the command name, which
            # may hold spaces: count from the closing parenthesis.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


class StartupTimer:
    """Consecutive start-up phases of this rank. ``from_process_start`` counts the first phase
    from the process's start (the entry point's imports, flag parsing, validation); otherwise
    from the timer's creation (a trainer built inside a running program)."""

    def __init__(self, from_process_start: bool = True):
        now = time.time()
        since = seconds_since_process_start() if from_process_start else None
        self.origin = "process start" if since is not None else "trainer start"
        self.start = now - (since or 0.0)
        self._last = self.start
        self.phases: dict[str, float] = {}
        self.done = False

    def mark(self, phase: str) -> None:
        """End ``phase`` now (it covers the time since the previous mark)."""
        now = time.time()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now

    def finish(self, phase: str = "first step") -> dict:
        """End the last phase; returns the record for the JSONL (seconds per phase, total)."""
        self.mark(phase)
        self.done = True
        return self.record()

    def record(self) -> dict:
        return {**{k: round(v, 3) for k, v in self.phases.items()},
                "total": round(self._last - self.start, 3), "from": self.origin}

    def line(self) -> str:
        parts = " | ".join(f"{k} {v:.2f}" for k, v in self.phases.items())
        return f"> start-up (s): {parts} | total {self._last - self.start:.2f} from {self.origin}"
