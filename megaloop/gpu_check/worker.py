"""The GPU check's long-lived single-rank worker: one process runs every single-rank row, so
torch, Transformer Engine and megatron-core are imported, and megatron-core's ``jit_fuser``
kernels (torch.compile) and TE's cuDNN graphs built, once for the whole check.

    python -m megaloop.gpu_check.worker CMD_FD REPLY_FD

It reads one JSON request per line from file descriptor CMD_FD: ``{"call": "module:function",
"kwargs": {...}, "log": path}``, runs the function with its stdout and stderr (file descriptors
1 and 2, so C++ and CUDA library output too) appended to ``log``, and answers one JSON line on
REPLY_FD: ``{"ok": true, "value": ...}`` or ``{"ok": false, "error": traceback}`` (the
traceback is also written to the log). The orchestrator (megaloop.gpu_check.main) owns the
timeouts: it kills the worker, and everything it started, if an answer does not come in time.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import traceback
from contextlib import contextmanager


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
            replies.write(json.dumps(reply) + "\n")
            replies.flush()


if __name__ == "__main__":  # also the guard dist_checkpointing's spawned writer needs
    serve(int(sys.argv[1]), int(sys.argv[2]))
