"""One run per --save folder: a lock file in it, taken by rank 0 at start-up.

Two runs saving into one folder destroy each other: the second run's start-up removes the first
one's in-progress ``iter_*.tmp`` save, and later each overwrites the other's checkpoints. So
before anything in --save is removed or written, rank 0 creates ``megaloop_run.lock`` there with
``O_CREAT | O_EXCL`` (atomic, also on NFS) holding who took it: host, pid, SLURM job id, start
time. A second run finds the file and refuses to start, naming the holder (exit code 2). A lock
whose holder is gone is taken over with a message: on this host when its pid no longer runs, on
another host when the holder has not refreshed it (its modification time, touched about once a
minute while the run trains) for --save-lock-timeout minutes, and at once when it names this
SLURM job (requeued after its node failed). --load needs no lock: reading a
folder another run writes is safe (``latest`` only ever names complete checkpoints).

The lock is released when the run ends (trained, stopped, failed, or SIGTERM without
--exit-signal-handler); a holder killed outright (SIGKILL, a node failure) leaves it, to be taken
over as stale.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import time
import uuid
from typing import Optional

import torch

from megaloop.training.exit_conditions import RunError

LOCK = "megaloop_run.lock"
REFRESH_SECONDS = 60.0


class SaveDirInUse(RunError):
    """Another live run holds the --save folder's lock: refused before training (exit 2)."""

    exit_code = 2


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def describe(holder: Optional[dict]) -> str:
    if not holder:
        return "an unknown run (the lock file is empty or unreadable)"
    job = f", SLURM job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return (f"pid {holder.get('pid')} on host {holder.get('host')}{job}, started "
            f"{holder.get('started')}")


def _read(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def stale_reason(holder: Optional[dict], age_s: float, timeout_min: float) -> Optional[str]:
    """Why the lock of ``holder`` (last refreshed ``age_s`` seconds ago) may be taken over, or
    None while its run may still be alive."""
    job = os.environ.get("SLURM_JOB_ID")
    if holder and job and holder.get("slurm_job_id") == job:
        # A requeued SLURM job keeps its id and may restart on another node after the first
        # died without releasing (node failure): the same job, not a second run.
        return f"it was taken by this SLURM job ({job}) before it was requeued"
    if holder and holder.get("host") == socket.gethostname():
        pid = int(holder.get("pid", -1))
        if pid == os.getpid():
            return "it is this process's own"
        if not _pid_alive(pid):
            return f"its process {pid} no longer runs on this host"
        return None
    if age_s > timeout_min * 60.0:
        return (f"not refreshed for {age_s / 60.0:.1f} min, more than --save-lock-timeout "
                f"{timeout_min:g}")
    return None


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
        holder = _read(self.path)
        if holder and holder.get("token") == token:
            try:
                os.remove(self.path)
            except OSError:
                pass

    def _on_sigterm(self, signum, frame):  # noqa: ARG002 - signal handler signature
        # Without --exit-signal-handler SIGTERM ends the run at once: release, then die of it.
        self.release()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _take(save_dir: str, timeout_min: float):
    """Rank 0: (refusal or None, notes, token)."""
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, LOCK)
    token = uuid.uuid4().hex
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
          "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "token": token}
    notes = []
    for _ in range(3):  # a takeover raced by another run: look again
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(path)
            try:
                age = time.time() - os.path.getmtime(path)
            except FileNotFoundError:
                continue  # released meanwhile
            why = stale_reason(holder, age, timeout_min)
            if why is None:
                return (f"--save {save_dir} is in use by another run: {describe(holder)} (lock "
                        f"file {path}). Wait for it to finish, choose another --save, or delete "
                        f"the lock file if that run is gone", notes, None)
            # Exactly one taker wins the rename; a lock that changed meanwhile is put back.
            aside = f"{path}.stale.{os.getpid()}"
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                continue
            if (_read(aside) or {}).get("token") != (holder or {}).get("token"):
                try:
                    os.link(aside, path)  # never overwrites: fails if a lock exists again
                except OSError:
                    pass
                os.remove(aside)
                continue
            os.remove(aside)
            if why != "it is this process's own":
                notes.append(f"> took over the stale lock {path} of {describe(holder)}: {why}")
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
            f.flush()
            os.fsync(f.fileno())
        return None, notes, token
    return (f"--save {save_dir}: could not take the lock file {path} (other runs keep taking "
            f"it); start one run per --save folder", notes, None)
