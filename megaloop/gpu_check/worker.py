"""The GPU check's long-lived single-rank worker: one process runs every single-rank row, so
torch, Transformer Engine and megatron-core are imported, and megatron-core's ``jit_fuser``
kernels (torch.compile) and TE's cuDNN graphs built, once for the whole check.

    python -m megaloop.gpu_check.worker CMD_FD REPLY_FD

It reads one JSON request per line from file descriptor CMD_FD: ``{"call": "module:function",
"kwargs": {...}, "log": path}``, runs the function with its stdout and stderr (file descriptors
1 and 2, so C++ and CUDA library output too) appended to ``log``, and answers one JSON line on
REPLY_FD: ``{"ok": true, "value": ...}`` or ``{"ok": false, "error": traceback}`` (the
traceback is also written to the log). The orchestrator (megaloop.gpu_check.main) owns the
timeouts (class Worker below): it kills the worker, and everything it started, if an answer does
not come in time.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import select
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager

from megaloop.gpu_check import procs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = os.environ.get("PYTHON") or sys.executable


@contextmanager
def output_to(path: str):
    """Point file descriptors 1 and 2 (and sys.stdout/stderr above them) at ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def resolve(name: str):
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def _json_safe(value):
    """NaN and infinities as strings (JSON has none); the orchestrator reads them back."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def reset_fp8_state() -> None:
    """Reset Transformer Engine's process-wide FP8 state after every row. It lives in class
    attributes of TE's FP8GlobalStateManager (the autocast depth, the recipe, the amax buffers
    that delayed scaling reduces at the end of each autocast), so an FP8 row interrupted by an
    error, or simply run before a bf16 row, would otherwise hand its state to the next row.
    Only where TE was imported by a row: the rehearsal on CPU never imports it."""
    if "transformer_engine.pytorch" not in sys.modules:
        return
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager  # megatron-core's import

    FP8GlobalStateManager.reset()
    print("[gpu_check] reset Transformer Engine's FP8 global state", flush=True)


def serve(cmd_fd: int, reply_fd: int) -> None:
    with os.fdopen(cmd_fd, "r") as requests, os.fdopen(reply_fd, "w") as replies:
        for line in requests:
            request = json.loads(line)
            with output_to(request["log"]):
                try:
                    value = resolve(request["call"])(**request.get("kwargs", {}))
                    reply = {"ok": True, "value": _json_safe(value)}
                except Exception:
                    error = traceback.format_exc()
                    print(error, file=sys.stderr, flush=True)
                    reply = {"ok": False, "error": error}
                finally:
                    reset_fp8_state()
            replies.write(json.dumps(reply) + "\n")
            replies.flush()


# --- the orchestrator's side ------------------------------------------------------------------
class Worker:
    """The long-lived worker process and its two pipes; restarted after a crash or timeout."""

    def __init__(self, out_dir: str, env: dict):
        self.out_dir, self.env, self.proc, self.fresh = out_dir, env, None, True

    def start(self):
        cmd_r, self.cmd_w = os.pipe()
        self.reply_r, reply_w = os.pipe()
        self.tag = procs.new_tag("worker")
        self.log = open(os.path.join(self.out_dir, "worker.log"), "ab")
        self.proc = subprocess.Popen(
            [PY, "-m", "megaloop.gpu_check.worker", str(cmd_r), str(reply_w)], cwd=ROOT,
            env={**self.env, procs.TAG_ENV: self.tag}, pass_fds=(cmd_r, reply_w),
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        os.close(cmd_r)
        os.close(reply_w)
        self.buffer, self.fresh = b"", True

    def call(self, fn: str, kwargs: dict, log_path: str, timeout: float):
        """(reply or None, timed_out). None: the worker died or did not answer in time (it is
        then killed with everything it started, and the next call starts a new one)."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.fresh = False
        request = {"call": fn, "kwargs": kwargs, "log": log_path}
        os.write(self.cmd_w, (json.dumps(request) + "\n").encode())
        deadline = time.time() + timeout
        while b"\n" not in self.buffer:
            wait = deadline - time.time()
            if wait <= 0:
                self.kill(f"timed out after {timeout:.0f} s", log_path)
                return None, True
            ready, _, _ = select.select([self.reply_r], [], [], min(wait, 1.0))
            if ready:
                chunk = os.read(self.reply_r, 1 << 20)
                if not chunk:  # the worker died
                    self.kill("the worker process died", log_path)
                    return None, False
                self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line), False

    def kill(self, why: str, log_path: str):
        pids = procs.kill_tagged(self.tag)
        if self.proc is not None:
            self.proc.wait()
        with open(log_path, "a") as f:
            f.write(f"\n[gpu_check] {why}: killed the worker and its processes {pids}; its own "
                    f"output is in worker.log\n")
        self.close()

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            os.close(self.cmd_w)  # EOF: the worker's loop ends
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            procs.kill_tagged(self.tag)
        elif self.proc is not None:
            os.close(self.cmd_w)
        if self.proc is not None:
            os.close(self.reply_r)
            self.log.close()
        self.proc, self.fresh = None, True  # the next call starts a new worker: its imports


if __name__ == "__main__":  # also the guard dist_checkpointing's spawned writer needs
    serve(int(sys.argv[1]), int(sys.argv[2]))
