"""A lock file that one run holds while it writes somewhere others could write too (a --save
folder, a preprocessing output prefix); no torch here, so a tool that starts in a fraction of a
second may take one.

The file is created with ``O_CREAT | O_EXCL`` (atomic, also on NFS) and holds who took it:
host, pid, SLURM job id, start time and a random token. Someone else's lock is taken over, with
a note, when its holder is gone: at once when it names this SLURM job (requeued after its node
failed) or a SLURM job that SLURM says has ended (``squeue``; a job cancelled with its launcher
leaves the lock behind, on whichever node its rank 0 ran), on this host when its pid no longer
runs, on another host when the holder has not refreshed it (its modification time) for
``timeout_min`` minutes. The users and their
messages: megaloop.training.save_lock (--save) and megaloop.data.preprocess (--output-prefix).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

OWN = "it is this process's own"


@dataclass
class Outcome:
    """What ``take`` found: the token when the lock is now ours; else who holds it (None when
    the file is empty or unreadable), or ``raced`` when other takers kept winning."""

    token: Optional[str]
    notes: list[str] = field(default_factory=list)  # stale locks taken over, one line each
    holder: Optional[dict] = None
    raced: bool = False


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host. A zombie has ended: it holds nothing and only
    waits to be reaped, which may never happen (an orphan whose init does not reap, as in some
    containers; a parent that was itself killed mid-wait). A reused pid reads as alive: a lock
    or file is then kept, never another run's taken."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The state follows the command name, which is in parentheses and may hold any byte.
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):  # no /proc (not Linux): it exists
        return True


def describe(holder: Optional[dict]) -> str:
    if not holder:
        return "an unknown run (the lock file is empty or unreadable)"
    job = f", SLURM job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return (f"pid {holder.get('pid')} on host {holder.get('host')}{job}, started "
            f"{holder.get('started')}")


def read_holder(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            holder = json.load(f)
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


# squeue's states of a job that has ended (its processes are gone); every other state (PENDING,
# RUNNING, COMPLETING, SUSPENDED, REQUEUED, ...) may still have a process holding the lock.
SLURM_ENDED = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
               "OUT_OF_MEMORY", "PREEMPTED", "REVOKED", "TIMEOUT"}


def slurm_job_ended(holder: dict) -> Optional[str]:
    """What SLURM says of the holder's job when it has ended (its state, or that SLURM no longer
    lists it: ended jobs are forgotten after MinJobAge); None while it may run, or when this
    process cannot tell: not in a job of the holder's cluster (a folder shared by two clusters:
    this one's squeue knows nothing of the other's jobs), no squeue, no answer. A job missing
    from the list counts only when it was this user's (PrivateData hides other users' jobs)."""
    job_id, cluster = holder.get("slurm_job_id"), os.environ.get("SLURM_CLUSTER_NAME")
    squeue = shutil.which("squeue")
    if not job_id or not cluster or holder.get("slurm_cluster") != cluster or squeue is None:
        return None
    forgotten = "SLURM no longer lists it" if holder.get("uid") == os.getuid() else None
    try:
        done = subprocess.run([squeue, "--noheader", f"--jobs={job_id}", "--format=%T"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    states = set(done.stdout.split())
    if done.returncode == 0:
        if not states:
            return forgotten
        if states <= SLURM_ENDED:
            return f"its state is {'/'.join(sorted(states))}"
        return None
    # Older SLURM refuses a job id it has forgotten; any other failure answers nothing.
    return forgotten if "Invalid job id" in done.stderr else None


def stale_reason(holder: Optional[dict], age_s: float, timeout_min: float,
                 timeout_text: str) -> Optional[str]:
    """Why the lock of ``holder`` (last refreshed ``age_s`` seconds ago) may be taken over, or
    None while its run may still be alive. ``timeout_text`` names ``timeout_min`` in the note
    (e.g. the flag that set it, with its value)."""
    job = os.environ.get("SLURM_JOB_ID")
    if holder and job and holder.get("slurm_job_id") == job:
        # A requeued SLURM job keeps its id and may restart on another node after the first
        # died without releasing (node failure): the same job, not a second run.
        return f"it was taken by this SLURM job ({job}) before it was requeued"
    if holder and not (holder.get("host") == socket.gethostname() and
                       holder.get("pid") == os.getpid()):
        ended = slurm_job_ended(holder)
        if ended:
            return f"its SLURM job {holder['slurm_job_id']} has ended ({ended})"
    if holder and holder.get("host") == socket.gethostname():
        pid = int(holder.get("pid", -1))
        if pid == os.getpid():
            return OWN
        if not pid_alive(pid):
            return f"its process {pid} no longer runs on this host"
        return None
    if age_s > timeout_min * 60.0:
        return f"not refreshed for {age_s / 60.0:.1f} min, more than {timeout_text}"
    return None


def take(path: str, timeout_min: float, timeout_text: str) -> Outcome:
    """Create the lock file ``path`` for this process, taking over a stale one (see
    ``stale_reason``). OSError when it cannot be created (the folder is not writable)."""
    token = uuid.uuid4().hex
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
          "slurm_cluster": os.environ.get("SLURM_CLUSTER_NAME"), "uid": os.getuid(),
          "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "token": token}
    notes = []
    for _ in range(3):  # a takeover raced by another run: look again
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = read_holder(path)
            try:
                age = time.time() - os.path.getmtime(path)
            except FileNotFoundError:
                continue  # released meanwhile
            why = stale_reason(holder, age, timeout_min, timeout_text)
            if why is None:
                return Outcome(None, notes, holder)
            # Exactly one taker wins the rename; a lock that changed meanwhile is put back.
            aside = f"{path}.stale.{os.getpid()}"
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                continue
            if (read_holder(aside) or {}).get("token") != (holder or {}).get("token"):
                try:
                    os.link(aside, path)  # never overwrites: fails if a lock exists again
                except OSError:
                    pass
                os.remove(aside)
                continue
            os.remove(aside)
            if why != OWN:
                notes.append(f"> took over the stale lock {path} of {describe(holder)}: {why}")
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
            f.flush()
            os.fsync(f.fileno())
        return Outcome(token, notes)
    return Outcome(None, notes, raced=True)


def release(path: str, token: str) -> None:
    """Remove the lock file ``path`` if it still holds ``token`` (taken over meanwhile: not
    ours to remove)."""
    holder = read_holder(path)
    if holder and holder.get("token") == token:
        try:
            os.remove(path)
        except OSError:
            pass
