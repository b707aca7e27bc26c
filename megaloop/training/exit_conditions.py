"""When a run should save and stop early: SIGTERM, an iteration interval, a wall-clock budget.

SLURM sends SIGTERM to every task of a job before preemption or at the time limit (with
``--signal``). The handler only records the signal; the trainer finishes the step in flight,
asks here whether to stop, saves and exits 0. The handler is installed as soon as the flags are
parsed (megaloop.training.sigterm, from megaloop.training.run), not when training starts: a signal
that lands during the start-up (imports, model, checkpoint load: SLURM may send ``--signal`` up to
a minute early, so a short job can get it there) is kept, and the trainer stops before its first
step (``before_training``) instead of the rank dying of it. The decision is one all-reduce (MAX) over the
world, so every rank takes the same branch even when only some ranks got the signal or one rank's
clock crossed the budget first: nothing can hang in a half-taken save.

How a run ends, for launchers (``pretrain_looplm.py``'s exit code, and with --exit-status-file
one JSON line that says the same where a launcher hides the code: torchrun exits 1 whenever it is
signalled itself, whatever its ranks did):

- 0, ``completed``: trained to --train-iters (and saved, with --save);
- 0, ``saved-and-stopped``: stopped early by SIGTERM (--exit-signal-handler, also one received
  during the start-up), --exit-interval or --exit-duration-in-mins, after saving: resubmit the
  same command to continue;
- 1, ``failed``: a ``RunError`` (too many non-finite steps in a row, a save or load that
  failed): nothing after the last good checkpoint was kept;
- 2: a bad flag or a checkpoint that does not fit the flags, found before training started.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import torch

from megaloop.device import current_device
from megaloop.training import sigterm
from megaloop.training.config import CheckpointConfig


class RunError(Exception):
    """A failure that ends the run with a message for the user (what happened, what is kept, what
    to do). Raised on every rank alike, so the ranks leave together; ``megaloop.training.run``
    prints it once and exits with ``exit_code``: 1, or 2 for a refusal found before training (a
    --save folder another run holds). A checkpoint's failures are megaloop.checkpoint's
    CheckpointError, handled the same way."""

    exit_code = 1


def write_exit_status(path: str, status: str, reason: str, iteration: int,
                      checkpoint_iteration: Optional[int]) -> None:
    """Rank 0: one JSON line ``{"status", "reason", "iteration", "checkpoint_iteration"}``,
    written atomically (a launcher never reads half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(json.dumps({"status": status, "reason": reason, "iteration": iteration,
                            "checkpoint_iteration": checkpoint_iteration}) + "\n")
    os.replace(path + ".tmp", path)


class ExitConditions:
    """``start_time``: when --exit-duration-in-mins starts counting (Megatron-LM's: the
    program's start; the trainer passes its process's start time)."""

    def __init__(self, cfg: CheckpointConfig, start_time: Optional[float] = None):
        self.cfg = cfg
        self.start_time = time.time() if start_time is None else start_time

    @property
    def received_signal(self) -> Optional[int]:
        return sigterm.received()

    def install(self) -> None:
        """Take over SIGTERM (only with --exit-signal-handler; kept if already caught)."""
        if self.cfg.exit_signal_handler:
            sigterm.catch()

    def uninstall(self) -> None:
        sigterm.release()

    def before_training(self, iteration: int) -> Optional[str]:
        """Why the run must stop before its first step: a SIGTERM received on any rank during
        the start-up. Collective with --exit-signal-handler (every rank takes the same branch)."""
        if not self.cfg.exit_signal_handler:
            return None
        flag = torch.tensor([float(self.received_signal is not None)], device=current_device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag[0] > 0:
            return (f"SIGTERM received during the start-up (--exit-signal-handler): stopping "
                    f"before the first step after iteration {iteration}")
        return None

    @property
    def collective(self) -> bool:
        """Whether the check needs an all-reduce (conditions that can differ between ranks)."""
        return self.cfg.exit_signal_handler or self.cfg.exit_duration_in_mins is not None

    def reason(self, iteration: int) -> Optional[str]:
        """Why the run must stop after ``iteration``, or None. Collective when ``collective``."""
        if self.cfg.exit_interval and iteration % self.cfg.exit_interval == 0:
            return f"--exit-interval {self.cfg.exit_interval} reached at iteration {iteration}"
        if not self.collective:
            return None
        minutes = (time.time() - self.start_time) / 60.0
        flags = torch.tensor([
            float(self.received_signal is not None),
            float(self.cfg.exit_duration_in_mins is not None
                  and minutes > self.cfg.exit_duration_in_mins)],
            device=current_device())  # NCCL reduces GPU tensors only
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        if flags[0] > 0:
            return f"SIGTERM received (--exit-signal-handler), stopping after iteration {iteration}"
        if flags[1] > 0:
            return (f"--exit-duration-in-mins {self.cfg.exit_duration_in_mins} exceeded at "
                    f"iteration {iteration}")
        return None
