"""One run per --save folder: a lock file in it, taken by rank 0 at start-up.

Two runs saving into one folder destroy each other: the second run's start-up removes the first
one's in-progress ``iter_*.tmp`` save, and later each overwrites the other's checkpoints. So
before anything in --save is removed or written, rank 0 creates ``megaloop_run.lock`` there with
``O_CREAT | O_EXCL`` (atomic, also on NFS) holding who took it: host, pid, SLURM job id, start
time. A second run finds the file and refuses to start, naming the holder (exit code 2). A lock
whose holder is gone is taken over with a message: at once when it names this SLURM job
(requeued after its node failed) or a SLURM job that squeue says has ended (cancelled with its
launcher, its rank 0 on any node), on this host when its pid no longer runs (or is a zombie), on
another host when the holder has not refreshed it (its modification time, touched about once a
minute while the run trains) for --save-lock-timeout minutes. --load needs no lock: reading a
folder another run writes is safe (``latest`` only ever names complete checkpoints). The lock
file itself (creation, staleness, takeover) is megaloop.lockfile's, shared with preprocessing.

The lock is released when the run ends (trained, stopped, failed, or SIGTERM without
--exit-signal-handler); a holder killed outright (SIGKILL, a node failure) leaves it, to be taken
over as stale.
"""

from __future__ import annotations

import atexit
import os
import signal
import time
from typing import Optional

import torch

from megaloop import lockfile
from megaloop.training.exit_conditions import RunError

LOCK = "megaloop_run.lock"
REFRESH_SECONDS = 60.0


class SaveDirInUse(RunError):
    """Another live run holds the --save folder's lock: refused before training (exit 2)."""

    exit_code = 2


class SaveLock:
    """The --save folder's lock, held by rank 0 (the other ranks hold nothing)."""

    def __init__(self, path: Optional[str], token: Optional[str]):
        self.path, self.token = path, token
        self.refreshed = time.monotonic()
        self._previous_sigterm = None
        if token is not None:
            atexit.register(self.release)
            try:
                if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                    self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
            except ValueError:  # not the main thread: no handler (atexit still releases)
                pass

    @classmethod
    def acquire(cls, save_dir: Optional[str], timeout_min: float, print_fn=print) -> "SaveLock":
        """Collective: rank 0 takes the lock of ``save_dir`` (None: nothing to lock) and every rank
        learns the outcome, so all raise ``SaveDirInUse`` together or none does."""
        if not save_dir:
            return cls(None, None)
        outcome = [None, [], None]  # refusal, notes, token
        if torch.distributed.get_rank() == 0:
            try:
                outcome = list(_take(save_dir, timeout_min))
            except OSError as exc:
                outcome = [f"cannot create the lock file {os.path.join(save_dir, LOCK)} "
                           f"({exc.strerror}); check that --save {save_dir} is writable", [], None]
        torch.distributed.broadcast_object_list(outcome, src=0)
        refusal, notes, token = outcome
        for note in notes:
            print_fn(note)
        if refusal:
            raise SaveDirInUse(refusal)
        return cls(os.path.join(save_dir, LOCK), token)

    def refresh(self) -> None:
        """Touch the lock about once a minute (rank 0; cheap to call every step): another host
        judges staleness by its age."""
        if self.token is None or time.monotonic() - self.refreshed < REFRESH_SECONDS:
            return
        self.refreshed = time.monotonic()
        try:
            os.utime(self.path)
        except OSError:
            pass  # taken over meanwhile or the folder is gone: release() will see it is not ours

    def release(self) -> None:
        """Remove the lock if it is still this run's (idempotent)."""
        if self.token is None:
            return
        token, self.token = self.token, None
        if self._previous_sigterm is not None and \
                signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        lockfile.release(self.path, token)

    def _on_sigterm(self, signum, frame):  # noqa: ARG002 - signal handler signature
        # Without --exit-signal-handler SIGTERM ends the run at once: release, then die of it.
        self.release()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _take(save_dir: str, timeout_min: float):
    """Rank 0: (refusal or None, notes, token)."""
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, LOCK)
    got = lockfile.take(path, timeout_min, f"--save-lock-timeout {timeout_min:g}")
    if got.token is not None:
        return None, got.notes, got.token
    if got.raced:
        return (f"--save {save_dir}: could not take the lock file {path} (other runs keep "
                f"taking it); start one run per --save folder", got.notes, None)
    return (f"--save {save_dir} is in use by another run: {lockfile.describe(got.holder)} (lock "
            f"file {path}). Wait for it to finish, choose another --save, or delete the lock "
            f"file if that run is gone", got.notes, None)
