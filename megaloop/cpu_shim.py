"""CPU development mode: lets megatron-core 0.16 run without CUDA.

megatron-core calls CUDA directly in about twenty places (DESIGN.md lists them): it asks
``torch.cuda.current_device()`` for allocation devices, creates tensors with ``device="cuda"``
in schedules, DDP buffers, the optimizer and grad clipping, keeps its RNG streams in the CUDA
generator, and asserts ``param.type() == 'torch.cuda.FloatTensor'``. This module patches those
three levels at runtime so the *same* megatron-core code paths (gloo, fp32) run on a laptop or
a CI machine:

1. ``torch.cuda`` device queries answer "cpu", synchronize/empty_cache are no-ops, and the CUDA
   RNG state used by megatron-core's ``CudaRNGStatesTracker`` is the CPU generator (so the
   tracker's per-tensor-parallel-rank streams still differ, and dropout inside a fork uses them);
2. a process-wide ``TorchFunctionMode`` rewrites ``device="cuda"`` to cpu and makes ``.cuda()`` a
   no-op;
3. ``Tensor.type()`` reports CPU tensors with CUDA type strings, for megatron-core's asserts.

It is enabled only when ``torch.cuda.is_available()`` is false and never on a GPU machine.
``MEGALOOP_SHIM_TRACE=1`` (or ``enable(trace=True)``) records every megatron-core call site the
shim rewrote; ``call_sites()`` returns them, so a megatron-core upgrade is easy to audit.
"""

from __future__ import annotations

import collections
import logging
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False
_TRACE = False
_SITES: collections.Counter = collections.Counter()
_ORIGINAL_TYPE = torch.Tensor.type


def _record(what: str) -> None:
    """Remember the first frame outside torch and this module that led to a patched call."""
    if not _TRACE:
        return
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "megatron" in name or (
            "/torch/" not in name and not name.endswith("cpu_shim.py") and "contextlib" not in name
        ):
            break
        frame = frame.f_back
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"
    marker = "megatron/core/"
    if marker in where:
        where = "megatron/core/" + where.split(marker, 1)[1]
    _SITES[(where, what)] += 1


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare integer is a CUDA ordinal in torch's API.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Level 2: every ``device=cuda`` argument becomes cpu, ``.cuda()`` returns the tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            _record("Tensor.cuda")
            return args[0]
        device = kwargs.get("device")
        if device is not None and _is_cuda(device):
            _record(f"{getattr(func, '__name__', func)}(device=cuda)")
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            _record("Tensor.to(cuda)")
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _cpu_type(self, dtype=None, non_blocking=False, **kwargs):
    """Level 3: ``t.type()`` of a CPU tensor says ``torch.cuda.FloatTensor`` (megatron asserts)."""
    if dtype is None and not kwargs and self.device.type == "cpu":
        _record("Tensor.type()")
        name = _ORIGINAL_TYPE(self)
        # The original re-dispatches through the torch-function mode back to this patch, so the
        # name may already carry the CUDA prefix.
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
    return _ORIGINAL_TYPE(self, dtype, non_blocking, **kwargs)


class _SilenceCpuRngWarning(logging.Filter):
    """The tracker warns when the CPU RNG moves inside a fork; on CPU that *is* the fork's stream."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _patch_level1() -> None:
    import torch.cuda.random as cuda_random

    def current_device():
        _record("torch.cuda.current_device")
        return "cpu"

    def noop(*_args, **_kwargs):
        _record("torch.cuda no-op")

    def get_rng_state(device="cuda"):
        _record("torch.cuda.get_rng_state")
        return torch.get_rng_state()

    def set_rng_state(state, device="cuda"):
        _record("torch.cuda.set_rng_state")
        torch.set_rng_state(state)

    def manual_seed(seed):
        _record("torch.cuda.manual_seed")
        # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, which would recurse.
        torch.default_generator.manual_seed(seed)

    torch.cuda.current_device = current_device
    torch.cuda.synchronize = noop
    torch.cuda.empty_cache = noop
    for mod in (torch.cuda, cuda_random):
        mod.get_rng_state = get_rng_state
        mod.set_rng_state = set_rng_state
        mod.manual_seed = manual_seed

    # megatron-core swaps RNG states through its own helpers that reach for
    # torch.cuda.default_generators; route them to the CPU generator.
    from megatron.core.tensor_parallel import random as mcore_random

    def _set_state(new_state, device=-1, graph_safe=False):
        _record("tensor_parallel.random._set_cuda_rng_state")
        torch.set_rng_state(new_state)

    def _get_state(device="cuda", clone=False, graph_safe=False):
        _record("tensor_parallel.random._get_cuda_rng_state")
        return torch.get_rng_state()

    mcore_random._set_cuda_rng_state = _set_state
    mcore_random._get_cuda_rng_state = _get_state
    logging.getLogger(mcore_random.__name__).addFilter(_SilenceCpuRngWarning())


def _keep_mode_in_backward(mode: _CudaToCpuMode) -> None:
    """``torch.autograd.backward``/``grad`` are themselves overridable: the mode receives them and
    runs them with itself popped, so the backward pass would run without the shim, and
    activation recomputation (megatron-core reruns the forward, with its ``device="cuda"``
    literals, inside the backward pass) would fail. Re-enter the mode around the engine call."""
    import torch.autograd as autograd

    run = autograd._engine_run_backward

    def engine_run_backward(*args, **kwargs):
        if torch._C._len_torch_function_stack() > 0:
            return run(*args, **kwargs)
        _record("autograd backward (mode re-entered)")
        with mode:
            return run(*args, **kwargs)

    autograd._engine_run_backward = engine_run_backward


def enable(trace: bool | None = None) -> bool:
    """Install the shim if CUDA is absent. Returns whether the shim is active. Idempotent."""
    global _ENABLED, _TRACE
    if trace is None:
        trace = os.environ.get("MEGALOOP_SHIM_TRACE", "0") not in ("", "0")
    _TRACE = _TRACE or trace
    if _ENABLED or torch.cuda.is_available():
        return _ENABLED
    _patch_level1()
    torch.Tensor.type = _cpu_type
    mode = _CudaToCpuMode()
    mode.__enter__()  # process-wide: never exited
    _keep_mode_in_backward(mode)
    _ENABLED = True
    return True


def is_enabled() -> bool:
    return _ENABLED


def call_sites() -> list[tuple[str, str, int]]:
    """``(caller file:line, what was patched, count)`` for every call the shim rewrote (trace on)."""
    return sorted((where, what, n) for (where, what), n in _SITES.items())


def format_call_sites() -> str:
    return "\n".join(f"{n:6d}  {what:45s} {where}" for where, what, n in call_sites())
