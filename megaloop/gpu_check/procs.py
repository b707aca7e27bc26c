"""Child processes of the GPU check: full logs on disk, the Python traceback of a failure, and
nothing left running after a row.

Every process a row starts carries one environment variable, ``MEGALOOP_GPU_CHECK_TAG``, with a
value of its own. Children inherit it, so when a row ends (or times out) every process still
carrying its tag is found and killed, wherever it went: torchrun starts each worker in a session
of its own (torch.distributed.elastic's SubprocessHandler passes ``start_new_session=True``), so
killing torchrun's process group leaves the worker running on the GPU, and a worker orphaned by a
dead torchrun is no longer anyone's descendant.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

TAG_ENV = "MEGALOOP_GPU_CHECK_TAG"


def new_tag(name: str) -> str:
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-{uuid.uuid4().hex[:12]}"


def tagged_pids(tag: str) -> list[int]:
    """The processes (of this user: others' environments cannot be read) carrying ``tag``."""
    needle = f"{TAG_ENV}={tag}".encode() + b"\0"
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read() + b"\0":
                    pids.append(int(entry))
        except OSError:  # gone, or not ours
            continue
    return pids


def running(pid: int) -> bool:
    """Whether ``pid`` still runs. A zombie has ended. A process that is exiting has already
    released its memory, so its environment reads empty and it is no longer found by its tag,
    while it has not yet ended: a caller that stopped waiting at that point saw it alive."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def kill_tagged(tag: str, grace_s: float = 5.0) -> list[int]:
    """SIGTERM every process carrying ``tag`` (and its process group), SIGKILL what is left after
    ``grace_s``; returns the pids it found. Returns once every one of them has ended."""
    found, own_group = tagged_pids(tag), os.getpgid(0)
    signalled: set[int] = set()

    def left() -> list[int]:
        return sorted(set(tagged_pids(tag)) | {pid for pid in signalled if running(pid)})

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in tagged_pids(tag):  # never a bare pid: once reaped, it may be reused
            signalled.add(pid)
            try:
                group = os.getpgid(pid)
                if group != own_group:  # never the check's own process group
                    os.killpg(group, sig)
                os.kill(pid, sig)
            except OSError:  # gone meanwhile
                pass
        deadline = time.time() + (grace_s if sig == signal.SIGTERM else 2.0)
        while time.time() < deadline and left():
            time.sleep(0.05)
        if not left():
            break
    return found


@dataclass
class Finished:
    rc: int
    seconds: float
    timed_out: bool
    log: str


def run_logged(cmd: list, log_path: str, timeout: float, cwd: str, env: dict,
               name: str = "row") -> Finished:
    """Run ``cmd`` with stdout and stderr appended to ``log_path`` (kept whatever happens), in a
    process group of its own; at the timeout, or when it ends, every process it left is
    killed. rc 124 on a timeout."""
    tag = new_tag(name)
    start = time.time()
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(cmd, cwd=cwd, env={**env, TAG_ENV: tag}, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        except OSError as exc:  # e.g. $PYTHON does not exist: the row fails, the check goes on
            log.write(f"[gpu_check] could not start: {exc}\n".encode())
            return Finished(127, time.time() - start, False, log_path)
        try:
            rc, timed_out = proc.wait(timeout=max(timeout, 1)), False
        except subprocess.TimeoutExpired:
            rc, timed_out = 124, True
        left = kill_tagged(tag)
        proc.wait()
        if timed_out:
            log.write(f"\n[gpu_check] timed out after {timeout:.0f} s: killed pids "
                      f"{left}\n".encode())
    return Finished(rc, time.time() - start, timed_out, log_path)


_TB_START = re.compile(r"^(\[[\w-]+\]:)?\s*Traceback \(most recent call last\):")
_PREFIX = re.compile(r"^\[[\w-]+\]:\s?")


def tracebacks(text: str) -> list[str]:
    """The Python tracebacks in a log, in order, each up to its exception line and the lines of
    its message that follow (up to a blank line); a rank prefix such as ``[rank0]:`` is removed.
    A chained exception is a block of its own (the last block is the one that was raised)."""
    lines = [_PREFIX.sub("", line) for line in text.splitlines()]
    blocks, i = [], 0
    while i < len(lines):
        if not _TB_START.match(lines[i]):
            i += 1
            continue
        block, i = [lines[i]], i + 1
        while i < len(lines) and (not lines[i] or lines[i][0].isspace()):
            block.append(lines[i])
            i += 1
        while i < len(lines) and lines[i].strip() and not _TB_START.match(lines[i]) \
                and len(block) < 400:
            block.append(lines[i])  # the exception line and the rest of its message
            i += 1
        blocks.append("\n".join(block).rstrip())
    return blocks


# torchrun's own report when a rank fails: a traceback of torchrun's code ending in this error,
# and a banner. It names the failed rank, not the reason: the rank's traceback precedes it.
_LAUNCHER_ERRORS = ("ChildFailedError", "torch.distributed.elastic")


def _exception_line(block: str) -> str:
    return next((line for line in block.splitlines()[1:] if line and not line[0].isspace()), "")


def failure_text(text: str, lines: int = 25) -> str:
    """What a person needs from a failed row's log: the last Python traceback of the program
    itself (not torchrun's ChildFailedError report), else the log's last lines before torchrun's
    report (a refusal prints one ``error:`` line and no traceback)."""
    launcher = lambda block: any(w in _exception_line(block) for w in _LAUNCHER_ERRORS)  # noqa
    own = [b for b in tracebacks(text) if not launcher(b)]
    if own:
        return own[-1]
    all_lines = text.splitlines()
    cut = next((i for i, line in enumerate(all_lines) if _TB_START.match(line)
                and launcher(tracebacks("\n".join(all_lines[i:]))[0])), len(all_lines))
    tail = [line for line in all_lines[:cut] if line.strip()]
    return "\n".join(tail[-lines:])


@contextmanager
def started(cmd: list, log_path: str, cwd: str, env: dict, name: str = "server"):
    """Start ``cmd`` in the background (a server a row talks to) with its output appended to
    ``log_path``; yields the process; when the row is done, every process it left is killed
    (as run_logged's)."""
    tag = new_tag(name)
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env={**env, TAG_ENV: tag}, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            yield proc
        finally:
            kill_tagged(tag)
            proc.wait()
