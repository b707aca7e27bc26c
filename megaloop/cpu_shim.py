"""CPU development mode: lets megatron-core 0.16 run without CUDA.

megatron-core calls CUDA directly in about twenty places (``MEGALOOP_SHIM_TRACE=1`` lists the
ones a run hits): it asks ``torch.cuda.current_device()`` for allocation devices, creates
tensors with ``device="cuda"`` in schedules, DDP buffers, the optimizer and grad clipping, keeps
its RNG streams in the CUDA generator, and asserts ``param.type() == 'torch.cuda.FloatTensor'``.
This module patches those three levels at runtime so the *same* megatron-core code paths (gloo,
fp32) run on a laptop or a CI machine:

1. ``torch.cuda`` device queries answer "cpu", synchronize/empty_cache are no-ops, and the CUDA
   RNG state used by megatron-core's ``CudaRNGStatesTracker`` is the CPU generator (so the
   tracker's per-tensor-parallel-rank streams still differ, and dropout inside a fork uses them);
2. the tensor factories (``torch.zeros``, ``torch.empty``, ``Tensor.new_zeros``, ...) take
   ``device="cuda"`` as cpu and drop ``pin_memory=True`` (no pinned allocator without CUDA);
   ``Tensor.cuda()`` returns the tensor, ``Tensor.to(cuda)`` stays on cpu, ``pin_memory()`` is a
   no-op. These are patched one by one rather than intercepted by a ``TorchFunctionMode``, which
   would cost a Python call on every torch op of every step (a fifth of a small model's CPU
   time); the mode is pushed only for the placement check below, which must see every op;
3. ``Tensor.type()`` reports CPU tensors with CUDA type strings, for megatron-core's asserts.

It is enabled only when ``torch.cuda.is_available()`` is false and never on a GPU machine.
``MEGALOOP_SHIM_TRACE=1`` (or ``enable(trace=True)``) records every megatron-core call site the
shim rewrote; ``call_sites()`` returns them, so a megatron-core upgrade is easy to audit.

Placement check (``MEGALOOP_SHIM_CHECK_PLACEMENT=1`` or ``enable_placement_check()``). Mapping
``cuda`` to cpu hides placement mistakes: a batch never moved to the GPU, a statistics tensor made
on the host and handed to an NCCL collective. With the check on, the shim remembers which tensors
would live on the *host* of a GPU machine and fails where a GPU run would:

- host tensors: made by a factory or ``torch.as_tensor``/``from_numpy`` without a CUDA device,
  moved with ``.cpu()`` / ``.to("cpu")`` / ``.to(torch.device("cpu"))``, or computed from host
  tensors only. Everything else is on the accelerator: made with ``device="cuda"`` /
  ``torch.cuda.current_device()``, moved with ``.cuda()`` / ``.to(cuda)`` (``module.cuda()`` and
  ``module.to(cuda)`` move its parameters), or computed from any accelerator tensor. ``x.device``
  answers a ``torch.device("cpu")`` that the check recognises as x's side, so
  ``torch.zeros(n, device=x.device)`` and ``y.to(x.device)`` go where x is; a
  ``torch.device("cpu")`` made elsewhere is taken as placed by factories (``with
  torch.device(torch.cuda.current_device())`` hands them one). Tensors the shim never saw made
  (autograd's gradients, tensors made before the check started) count as placed, so the check
  can miss a mistake but not invent one;
- an op that mixes accelerator tensors with a host tensor of one or more dimensions (0-d host
  tensors are scalars to CUDA kernels) raises ``PlacementError``: the model's embedding fed a
  batch left on the host is the common case. Indexing and ``copy_`` may mix, as on CUDA;
- a host tensor passed to a ``torch.distributed`` collective or point-to-point call raises
  ``PlacementError``, unless the group was created with ``backend="gloo"`` (megatron-core's CPU
  side groups, which take host tensors on a GPU machine too);
- ``.numpy()`` / ``numpy.asarray`` of an accelerator tensor raises ``PlacementError`` (numpy reads
  host memory only); ``pin_memory()`` returns a host copy the check marks as pinned (as does a
  factory's ``pin_memory=True``), and ``is_pinned()`` answers from that mark.

Transfer counter: ``with count_transfers() as seen:`` (placement check on) lists in ``seen.h2d``
and ``seen.d2h`` the copies between host and GPU memory a GPU run would make inside the block,
each a ``Transfer(op, where, blocking, pinned, non_blocking)`` whose ``where`` is the first caller
outside torch and this module. Host to device: ``torch.tensor``/``as_tensor``/``asarray``/
``new_tensor`` of host data onto the accelerator, ``.cuda()``/``.to(cuda)``/``copy_`` of a host
tensor, a host index tensor or python sequence indexing an accelerator tensor; ``blocking`` unless
the source is pinned and ``non_blocking=True`` was passed. Device to host: ``.tolist()``,
``.item()``, ``bool``/``int``/``float``/``complex``/``operator.index``, printing,
``.numpy(force=True)``, ``.cpu()``, ``.to("cpu")``, ``copy_`` into a host tensor, and each
accelerator tensor inside the list data of ``torch.tensor``; all blocking but a ``non_blocking``
copy into pinned memory. Empty tensors copy nothing and are not counted, nor are factories that
make their values on the device (``zeros``, ``arange``, ``full``, ...). Not counted either, though
they wait on a GPU too: ops that read device values to size their output or to answer python
(``nonzero``, boolean-mask indexing, ``torch.equal``). The counter runs in the check's mode only.

The marks live in an id-keyed table of weak references (never in the tensors, so nothing of them
reaches a pickle or a checkpoint); the check costs a table look-up per tensor argument of every op.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import os
import sys
import weakref

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


# Under the placement check ``t.device`` answers one of these two (both ``torch.device("cpu")``
# to torch), so ``x.to(y.device)`` and ``torch.tensor(data, device=y.device)`` go where ``y`` is.
_PLACED_DEVICE = torch.device("cpu")
_HOST_DEVICE = torch.device("cpu")


def _is_cuda(device) -> bool:
    if isinstance(device, _AcceleratorName):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda" or device is _PLACED_DEVICE
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare integer is a CUDA ordinal in torch's API.
    return isinstance(device, int) and not isinstance(device, bool)


def names_accelerator(device) -> bool:
    """Whether ``device`` names the accelerator: a CUDA device, or the stand-in
    ``torch.cuda.current_device()`` returns under the placement check."""
    return _is_cuda(device)


class _CudaToCpuMode(TorchFunctionMode):
    """Under the placement check: every op goes through ``_checked_call`` (which also maps
    ``cuda`` to cpu); with the check turned off again, it maps ``cuda`` to cpu as the level-2
    patches do."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pinned = kwargs.get("pin_memory")
        if pinned:  # no pinned allocator without CUDA (e.g. rope's CP slice)
            _record(f"{getattr(func, '__name__', func)}(pin_memory=True)")
            kwargs = dict(kwargs, pin_memory=False)
        if _CHECK:
            out = _checked_call(func, args, kwargs)
            if pinned:  # the check keeps a mark instead: a GPU run would pin it
                for t in _each_tensor(out):
                    _mark_pinned(t)
            return out
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


# Level 2: the torch functions and Tensor methods that take a device (megatron-core passes
# "cuda" literals and torch.cuda.current_device() to some of them).
FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "range", "rand", "randn",
             "randint", "randperm", "linspace", "logspace", "eye", "empty_like", "zeros_like",
             "ones_like", "full_like", "rand_like", "randn_like", "randint_like", "as_tensor",
             "asarray", "empty_strided", "scalar_tensor", "tril_indices", "triu_indices",
             "normal", "frombuffer")
TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor",
                    "new_empty_strided")
_ORIGINAL_CUDA, _ORIGINAL_TO, _ORIGINAL_PIN = torch.Tensor.cuda, torch.Tensor.to, \
    torch.Tensor.pin_memory


def _cpu_factory(fn, name: str):
    """``fn`` with ``device=cuda`` taken as cpu and ``pin_memory`` dropped. Under the placement
    check the call goes through unchanged: the check's mode sees the CUDA device and marks the
    result as placed."""
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if not _CHECK:
            device = kwargs.get("device")
            if device is not None and _is_cuda(device):
                _record(f"{name}(device=cuda)")
                kwargs["device"] = "cpu"
            if kwargs.get("pin_memory"):
                _record(f"{name}(pin_memory=True)")
                kwargs["pin_memory"] = False
        return fn(*args, **kwargs)
    factory._megaloop_cpu = True
    return factory


def _cpu_cuda(self, *args, **kwargs):
    if _CHECK:
        return _ORIGINAL_CUDA(self, *args, **kwargs)
    _record("Tensor.cuda")
    return self


def _cpu_to(self, *args, **kwargs):
    if not _CHECK:
        if "device" in kwargs and kwargs["device"] is not None and _is_cuda(kwargs["device"]):
            _record("Tensor.to(cuda)")
            kwargs["device"] = "cpu"
        elif args and not isinstance(args[0], (torch.Tensor, torch.dtype)) \
                and args[0] is not None and _is_cuda(args[0]):
            _record("Tensor.to(cuda)")
            args = ("cpu", *args[1:])
    return _ORIGINAL_TO(self, *args, **kwargs)


def _cpu_pin_memory(self, *args, **kwargs):
    if _CHECK:
        return _ORIGINAL_PIN(self, *args, **kwargs)
    _record("Tensor.pin_memory")
    return self


def _patch_level2() -> None:
    for name in FACTORIES:
        fn = getattr(torch, name, None)
        if fn is not None and not getattr(fn, "_megaloop_cpu", False):
            setattr(torch, name, _cpu_factory(fn, name))
    for name in TENSOR_FACTORIES:
        fn = getattr(torch.Tensor, name, None)
        if fn is not None and not getattr(fn, "_megaloop_cpu", False):
            setattr(torch.Tensor, name, _cpu_factory(fn, name))
    torch.Tensor.cuda, torch.Tensor.to = _cpu_cuda, _cpu_to
    torch.Tensor.pin_memory = _cpu_pin_memory


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
        return _ACCELERATOR if _CHECK else "cpu"

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

    class HostStream:
        """The one stream of the host: everything already ran in order, nothing to wait for
        (megatron-core 0.19's gradient sync waits on the current stream for CUDA-graph events)."""

        def wait_event(self, _event):
            _record("torch.cuda stream wait (no-op)")

        def wait_stream(self, _stream):
            _record("torch.cuda stream wait (no-op)")

        def synchronize(self):
            _record("torch.cuda stream synchronize (no-op)")

    host_stream = HostStream()

    def current_stream(device=None):
        _record("torch.cuda.current_stream")
        return host_stream

    torch.cuda.current_device = current_device
    torch.cuda.current_stream = current_stream
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
    _patch_level2()
    torch.Tensor.type = _cpu_type
    _ENABLED = True
    if os.environ.get("MEGALOOP_SHIM_CHECK_PLACEMENT", "0") not in ("", "0"):
        enable_placement_check()
    return True


def is_enabled() -> bool:
    return _ENABLED


def call_sites() -> list[tuple[str, str, int]]:
    """``(caller file:line, what was patched, count)`` for every call the shim rewrote (trace on)."""
    return sorted((where, what, n) for (where, what), n in _SITES.items())


def format_call_sites() -> str:
    return "\n".join(f"{n:6d}  {what:45s} {where}" for where, what, n in call_sites())


# --- placement check (see the module docstring) ------------------------------------------------
class PlacementError(RuntimeError):
    """A tensor would be on the wrong device on a GPU machine (raised by the placement check)."""


class _AcceleratorName(str):
    """What ``torch.cuda.current_device()`` answers under the check: "cpu" to torch, but the
    shim's mode recognises it as the accelerator (megatron-core and megaloop pass it as a device)."""


_ACCELERATOR = _AcceleratorName("cpu")
_CHECK = False
_HOST: dict = {}            # id(tensor) -> weak reference, for tensors on the host
_CPU_GROUPS: list = []      # process groups created with backend="gloo"
_PATCHED = False
_T = torch.Tensor
_DATA = torch._C.TensorBase.__dict__["data"]
_DEVICE = torch._C.TensorBase.__dict__["device"]
# What reads an accelerator tensor into python (a device-to-host copy and a wait on a GPU).
_TO_PYTHON = {_T.tolist: "Tensor.tolist", _T.item: "Tensor.item", _T.__bool__: "Tensor.__bool__",
              _T.__int__: "Tensor.__int__", _T.__float__: "Tensor.__float__",
              _T.__index__: "Tensor.__index__", _T.__complex__: "Tensor.__complex__",
              _T.__repr__: "Tensor.__repr__", _T.__format__: "Tensor.__format__"}
# numpy reads host memory only: .numpy() of a CUDA tensor raises (unless force=True, a copy).
_TO_NUMPY = {_T.numpy: "Tensor.numpy()", _T.__array__: "numpy.asarray"}
# Factories that copy their data (Tensor.new_tensor too, which the shim wraps: _count_other).
_FROM_DATA = {torch._C._VariableFunctions.tensor: "torch.tensor",
              torch._C._VariableFunctions.as_tensor: "torch.as_tensor",
              torch._C._VariableFunctions.asarray: "torch.asarray"}
# Ops that accept host tensors next to CUDA ones: host indices, cross-device copies.
_MIXING_ALLOWED = frozenset((_T.__getitem__, _T.__setitem__, _T.copy_, _T.set_))
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
               "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast",
               "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
               "isend", "irecv", "batch_isend_irecv")


def is_host(t: torch.Tensor) -> bool:
    """Whether the placement check holds ``t`` for a host tensor."""
    ref = _HOST.get(id(t))
    return ref is not None and ref() is t


def _forget(key, ref):
    if _HOST.get(key) is ref:
        del _HOST[key]


def _mark_host(t: torch.Tensor) -> None:
    if not is_host(t):
        key = id(t)
        _HOST[key] = weakref.ref(t, lambda ref, key=key: _forget(key, ref))


def _unmark(t: torch.Tensor) -> None:
    _HOST.pop(id(t), None)


def _each_tensor(obj):
    """Tensors of a result: one, or the elements of a tuple/list."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            if isinstance(x, torch.Tensor):
                yield x


def _placed(out: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``out`` as a tensor on the accelerator. A move that returned its (host) input itself gets
    an alias, so the original stays a host tensor as it would on a GPU."""
    if out is src and is_host(src):
        out = src.view_as(src)
    _unmark(out)
    return out


def _on_host(out: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    if out is src and not is_host(src):
        out = src.view_as(src)
    _mark_host(out)
    return out


def _move_target(args, kwargs):
    """The device argument of ``Tensor.to`` (None for a dtype-only conversion)."""
    if "device" in kwargs:
        return kwargs["device"]
    if len(args) > 1 and isinstance(args[1], (str, int, torch.device)) \
            and not isinstance(args[1], bool):
        return args[1]
    if len(args) > 1 and isinstance(args[1], torch.Tensor):  # .to(other): other's device
        return _ACCELERATOR if not is_host(args[1]) else "cpu"
    return None


def _where() -> str:
    """The innermost caller outside torch and this module (for error messages)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/" not in name and not name.endswith("cpu_shim.py"):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


# --- transfer counter (see the module docstring) -----------------------------------------------
@dataclasses.dataclass(frozen=True)
class Transfer:
    """One copy between host and accelerator that a GPU run would make at this point."""

    op: str                     # what made it: "Tensor.to(cuda)", "Tensor.item", "torch.tensor"
    where: str                  # the first caller outside torch and this module, as file:line
    blocking: bool              # whether the host waits for the device (see count_transfers)
    pinned: bool = False        # the host side is (would be) pinned memory
    non_blocking: bool = False  # non_blocking=True was passed

    def __str__(self) -> str:
        return f"{'blocking' if self.blocking else 'non-blocking'} {self.op} at {self.where}"


@dataclasses.dataclass(eq=False)
class Transfers:
    """What ``count_transfers()`` saw, in order: host-to-device and device-to-host copies."""

    h2d: list = dataclasses.field(default_factory=list)
    d2h: list = dataclasses.field(default_factory=list)

    @property
    def blocking(self) -> list:
        """The copies, both ways, that make the host wait for the device."""
        return [r for r in (*self.h2d, *self.d2h) if r.blocking]

    def __str__(self) -> str:
        return "\n".join([f"h2d: {r}" for r in self.h2d] + [f"d2h: {r}" for r in self.d2h]) \
            or "no transfers"


_COUNTERS: list = []        # the active count_transfers() blocks, innermost last
_PINNED: dict = {}          # storage address -> weak reference, for (would-be) pinned host memory


@contextlib.contextmanager
def count_transfers():
    """Count, inside a ``with`` block, the copies between host and accelerator a GPU run would
    make, from the placement check's marks: ``with count_transfers() as seen: ...`` then
    ``seen.h2d``, ``seen.d2h`` (lists of ``Transfer``) and ``seen.blocking``."""
    if not _CHECK:
        raise RuntimeError(
            "count_transfers() reads the placement check's marks: turn the check on first "
            "(cpu_shim.enable_placement_check() or MEGALOOP_SHIM_CHECK_PLACEMENT=1; the check "
            "runs under the CPU shim, on a machine without CUDA)")
    seen = Transfers()
    _COUNTERS.append(seen)
    try:
        yield seen
    finally:
        del _COUNTERS[next(i for i, c in enumerate(_COUNTERS) if c is seen)]


def _add(kind: str, op: str, pinned: bool = False, non_blocking: bool = False) -> None:
    # A copy from or into pageable memory waits for the device, whatever non_blocking says.
    record = Transfer(op, _where(), not (pinned and non_blocking), pinned, non_blocking)
    for seen in _COUNTERS:
        getattr(seen, kind).append(record)


def _count_h2d(op: str, src: torch.Tensor, non_blocking) -> None:
    if src.numel():
        _add("h2d", op, _is_pinned(src), bool(non_blocking))


def _count_d2h(op: str, src: torch.Tensor, non_blocking=False, pinned: bool = False) -> None:
    if src.numel():
        _add("d2h", op, pinned, bool(non_blocking))


def _mark_pinned(t: torch.Tensor) -> None:
    if t.layout == torch.strided and t.untyped_storage().data_ptr():
        key = t.untyped_storage().data_ptr()
        _PINNED[key] = weakref.ref(t, lambda ref, key=key: _PINNED.pop(key, None)
                                   if _PINNED.get(key) is ref else None)


def _is_pinned(t: torch.Tensor) -> bool:
    """Whether ``t`` (or the tensor it views) was pinned under the check. A view that outlives
    its pinned base counts as pageable: the counter may call a copy blocking, never the reverse."""
    if t.layout != torch.strided or not _PINNED:
        return False
    key = t.untyped_storage().data_ptr()
    ref = _PINNED.get(key)
    return ref is not None and ref() is not None


def _flag(kwargs, name: str, args=(), index: int = -1) -> bool:
    """A boolean argument given by keyword or at position ``index``."""
    if name in kwargs:
        return bool(kwargs[name])
    return 0 <= index < len(args) and bool(args[index])


def _to_non_blocking(args, kwargs) -> bool:
    """``non_blocking`` of ``Tensor.to``: by keyword, or the first bool after the target
    (``to(device, dtype, non_blocking)``, ``to(dtype, non_blocking)``, ``to(other,
    non_blocking)``)."""
    if "non_blocking" in kwargs:
        return bool(kwargs["non_blocking"])
    return next((a for a in args[2:] if isinstance(a, bool)), False)


def _has_elements(data) -> bool:
    """Whether the data of ``torch.tensor(data)`` (python numbers, nested lists, an array, a
    tensor) has at least one element: an empty one copies nothing."""
    if isinstance(data, torch.Tensor):
        return data.numel() > 0
    if isinstance(data, (list, tuple)):
        return any(_has_elements(x) for x in data)
    size = getattr(data, "size", None)  # a numpy array
    return size > 0 if isinstance(size, int) else True


def _tensors_in(data):
    """Tensors inside nested lists (``torch.tensor([t0, t1])`` reads each with ``.item()``)."""
    if isinstance(data, (list, tuple)):
        for x in data:
            if isinstance(x, torch.Tensor):
                yield x
            else:
                yield from _tensors_in(x)


def _target_of(device):
    """"accelerator", "host", or None (not given, or a torch.device("cpu") made elsewhere)."""
    if device is None:
        return None
    if _is_cuda(device):
        return "accelerator"
    if device is _HOST_DEVICE or isinstance(device, str) and device.startswith("cpu"):
        return "host"
    return None


def _index_items(index):
    """The items of an index as torch reads them: a tuple, a short list holding tensors,
    sequences, slices, None or Ellipsis, or one index (a list of numbers is one index)."""
    if isinstance(index, tuple):
        return index
    if isinstance(index, list) and len(index) < 32 and any(
            x is None or x is Ellipsis or isinstance(x, (torch.Tensor, list, tuple, slice))
            for x in index):
        return index
    return (index,)


def _count_other(func, args, kwargs) -> None:
    """Transfers of the ops that do not move a tensor by name (.to/.cuda/.cpu are counted in
    _checked_call): reads into python, torch.tensor & co, copy_, indexing."""
    name = _TO_PYTHON.get(func)
    if name is not None:
        if not is_host(args[0]):
            _count_d2h(name, args[0])
        return
    if func in _TO_NUMPY:  # numpy(force=True): without it an accelerator tensor raised
        if not is_host(args[0]):
            _count_d2h(_TO_NUMPY[func], args[0])
        return
    new = func is _T.new_tensor
    name = "Tensor.new_tensor" if new else _FROM_DATA.get(func)
    if name is not None:
        data = args[1 if new else 0] if len(args) > (1 if new else 0) \
            else kwargs.get("data", kwargs.get("obj"))
        for t in _tensors_in(data):
            if not is_host(t):
                _count_d2h(f"{name} (a tensor in its data)", t)
        target = _target_of(kwargs.get("device"))
        if target is None and new:
            target = "host" if is_host(args[0]) else "accelerator"
        if isinstance(data, torch.Tensor):
            if target == "accelerator" and is_host(data):
                _count_h2d(name, data, False)
            elif target == "host" and not is_host(data):
                _count_d2h(name, data)
        elif target == "accelerator" and _has_elements(data):
            _add("h2d", name)
        return
    if func is _T.copy_:
        dst = args[0]
        src = args[1] if len(args) > 1 else kwargs.get("src")
        non_blocking = _flag(kwargs, "non_blocking", args, 2)
        if is_host(src) and not is_host(dst):
            _count_h2d("Tensor.copy_", src, non_blocking)
        elif is_host(dst) and not is_host(src):
            _count_d2h("Tensor.copy_", src, non_blocking, pinned=_is_pinned(dst))
        return
    if func is _T.__getitem__ or func is _T.__setitem__:
        op = "Tensor.__getitem__" if func is _T.__getitem__ else "Tensor.__setitem__"
        if not is_host(args[0]):
            # A host index tensor or a python sequence is copied to the device (a 0-d one is
            # read as a number); a 0-d value is a fill, an n-d value a copy.
            for item in _index_items(args[1]):
                if isinstance(item, torch.Tensor) and item.dim() and is_host(item):
                    _count_h2d(f"{op} (host index)", item, False)
                elif isinstance(item, (list, tuple)) and _has_elements(item):
                    _add("h2d", f"{op} (sequence index)")
        if func is _T.__setitem__ and isinstance(args[2], torch.Tensor) and args[2].dim():
            if is_host(args[2]) and not is_host(args[0]):
                _count_h2d(f"{op} (host value)", args[2], False)
            elif is_host(args[0]) and not is_host(args[2]):
                _count_d2h(f"{op} (accelerator value)", args[2])


def _is_host_target(target) -> bool:
    """Whether a ``Tensor.to`` target names the host: "cpu", or a ``torch.device("cpu")`` that
    is not the accelerator's (``y.device`` of an accelerator tensor ``y``, see _PLACED_DEVICE)."""
    if isinstance(target, str):
        return target.startswith("cpu") and not isinstance(target, _AcceleratorName)
    return isinstance(target, torch.device) and target.type == "cpu" \
        and target is not _PLACED_DEVICE


def _checked_call(func, args, kwargs):
    if func is _T.cuda:
        _record("Tensor.cuda")
        if _COUNTERS and is_host(args[0]):
            _count_h2d("Tensor.cuda", args[0], _flag(kwargs, "non_blocking", args, 2))
        return _placed(args[0], args[0])
    if func is _T.cpu:
        if _COUNTERS and not is_host(args[0]):
            _count_d2h("Tensor.cpu", args[0])
        return _on_host(func(*args, **kwargs), args[0])
    if func is _T.to:
        target = _move_target(args, kwargs)
        if target is not None and _is_cuda(target):
            _record("Tensor.to(cuda)")
            if _COUNTERS and is_host(args[0]):
                _count_h2d("Tensor.to(cuda)", args[0], _to_non_blocking(args, kwargs))
            if "device" in kwargs:
                kwargs = dict(kwargs, device="cpu")
            else:
                args = (args[0], "cpu", *args[2:])
            return _placed(func(*args, **kwargs), args[0])
        out = func(*args, **kwargs)
        if _is_host_target(target):  # an explicit move to the host
            if is_host(args[0]):
                return _on_host(out, args[0])
            # A non-blocking copy to the host lands in pinned memory (torch pins the result).
            non_blocking = _to_non_blocking(args, kwargs)
            if _COUNTERS:
                _count_d2h("Tensor.to(cpu)", args[0], non_blocking, pinned=non_blocking)
            if non_blocking:
                out = out.clone() if out is args[0] else out  # its own (pinned) storage
                _mark_pinned(out)
            return _on_host(out, args[0])
        if out is not args[0]:  # a dtype conversion (or a torch.device made elsewhere)
            (_mark_host if is_host(args[0]) else _unmark)(out)
        return out
    if func is _T.pin_memory:  # a pinned copy on a GPU; here a host copy marked as pinned
        if not is_host(args[0]):
            raise PlacementError(
                f"placement check: pin_memory() of an accelerator tensor {_describe(args[0])} at "
                f"{_where()}; only host tensors can be pinned")
        if _is_pinned(args[0]):
            return args[0]
        out = args[0].clone()
        _mark_host(out)
        _mark_pinned(out)
        return out
    if func is _T.is_pinned:
        return _is_pinned(args[0])
    if func in _TO_NUMPY and not is_host(args[0]) and not kwargs.get("force"):
        raise PlacementError(
            f"placement check: {_TO_NUMPY[func]} of an accelerator tensor {_describe(args[0])} "
            f"at {_where()}; on a GPU numpy cannot read CUDA memory: call .cpu() first")
    if _COUNTERS:
        _count_other(func, args, kwargs)
    device = kwargs.get("device")
    if device is not None:
        if _is_cuda(device):
            _record(f"{getattr(func, '__name__', func)}(device=cuda)")
            out = func(*args, **dict(kwargs, device="cpu"))
            if args and out is args[0]:  # torch.as_tensor(host, device=cuda) returned its input
                return _placed(out, out)
            for t in _each_tensor(out):
                _unmark(t)
            return out
        if device is _HOST_DEVICE or isinstance(device, str) and device.startswith("cpu"):
            out = func(*args, **kwargs)
            if args and out is args[0]:
                return _on_host(out, out)
            for t in _each_tensor(out):
                _mark_host(t)
            return out
        # Any other torch.device("cpu") is undecidable: ``with torch.device(
        # torch.cuda.current_device())`` hands one to every factory (megatron-core's YaRN rope),
        # so it is treated as placed below.
    owner = getattr(func, "__self__", None)
    if owner is _DEVICE:  # ``t.device``: the accelerator's or the host's (see _PLACED_DEVICE)
        out = func(*args, **kwargs)
        if out.type != "cpu":  # meta tensors
            return out
        return _HOST_DEVICE if is_host(args[0]) else _PLACED_DEVICE
    if owner is _DATA:
        out = func(*args, **kwargs)
        if func.__name__ == "__set__":  # ``t.data = other`` moves t to where other is
            (_mark_host if is_host(args[1]) else _unmark)(args[0])
        elif is_host(args[0]):
            _mark_host(out)
        return out
    if device is None and func in _FROM_DATA and args and not isinstance(args[0], torch.Tensor):
        # Python data (even a list of accelerator tensors, read one by one) lands on the host.
        out = func(*args, **kwargs)
        _mark_host(out)
        return out

    host_nd, placed = None, None
    for group in (args, kwargs.values()):
        for a in group:
            if isinstance(a, torch.Tensor):
                items = (a,)
            elif isinstance(a, (list, tuple)):
                items = a
            else:
                continue
            for t in items:
                if not isinstance(t, torch.Tensor):
                    continue
                if is_host(t):
                    if host_nd is None and t.dim() > 0:
                        host_nd = t
                elif placed is None:
                    placed = t
    if device is not None and not isinstance(device, str) and placed is None:
        placed = device  # the undecidable torch.device: not host
    out = func(*args, **kwargs)
    # Only ops that compute tensors mix devices (queries such as _has_compatible_shallow_copy_type
    # compare tensors without touching their data).
    if placed is not None and host_nd is not None and func not in _MIXING_ALLOWED \
            and next(_each_tensor(out), None) is not None:
        name = getattr(func, "__name__", str(func))
        hint = ("the model was fed a batch left on the host: move it to "
                "torch.cuda.current_device() before the forward" if name == "embedding" else
                "move the host tensor to torch.cuda.current_device() (or create it there)")
        raise PlacementError(
            f"placement check: {name} mixes accelerator tensors with a host tensor "
            f"{_describe(host_nd)} at {_where()}; on a GPU this is a device mismatch: {hint}")
    if func in _MIXING_ALLOWED:  # the result is where self is
        if isinstance(args[0], torch.Tensor):
            for t in _each_tensor(out):
                (_mark_host if is_host(args[0]) else _unmark)(t)
    elif placed is None:
        for t in _each_tensor(out):
            _mark_host(t)
    return out


def _group_of(args, kwargs):
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, torch.distributed.ProcessGroup)), None)
    return group


def _check_collective(name: str, args, kwargs) -> None:
    group = _group_of(args, kwargs)
    tensors = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            tensors.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor):
                    tensors.append(x)
                elif isinstance(x, torch.distributed.P2POp):  # batch_isend_irecv
                    if not any(x.group is g for g in _CPU_GROUPS):
                        tensors.append(x.tensor)
    if group is not None and any(group is g for g in _CPU_GROUPS):
        return
    for t in tensors:
        if is_host(t):
            raise PlacementError(
                f"placement check: torch.distributed.{name} got a host tensor {_describe(t)} at "
                f"{_where()}; NCCL takes only GPU tensors: create it with "
                f"device=torch.cuda.current_device() or move it there first")


def _wrap_collective(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _CHECK:
            _check_collective(name, args, kwargs)
        return fn(*args, **kwargs)
    wrapper._megaloop_checked = True
    return wrapper


def _install_placement_patches() -> None:
    """Wrappers that do nothing while the check is off (installed once, never removed)."""
    global _PATCHED
    if _PATCHED:
        return
    _PATCHED = True
    dist = torch.distributed
    wrapped = {}
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "_megaloop_checked", False):
            wrapped[name] = _wrap_collective(name, fn)
            setattr(dist, name, wrapped[name])
    # megatron-core binds these two at import time.
    try:
        from megatron.core.distributed import param_and_grad_buffer as pgb
    except ImportError:  # pragma: no cover - megatron-core is a dependency
        pgb = None
    for alias, name in (("dist_all_gather_func", "all_gather_into_tensor"),
                        ("dist_reduce_scatter_func", "reduce_scatter_tensor")):
        if pgb is not None and name in wrapped and getattr(pgb, alias, None) is not None:
            setattr(pgb, alias, wrapped[name])

    new_group = dist.new_group

    @functools.wraps(new_group)
    def new_group_recording_gloo(*args, **kwargs):
        group = new_group(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if backend is not None and str(backend).lower() == "gloo":
            _CPU_GROUPS.append(group)
        return group

    dist.new_group = new_group_recording_gloo

    from_numpy = torch.from_numpy

    @functools.wraps(from_numpy)
    def from_numpy_on_host(array):
        out = from_numpy(array)
        if _CHECK:
            _mark_host(out)
        return out

    torch.from_numpy = from_numpy_on_host

    parameter_new = torch.nn.Parameter.__new__

    def parameter_keeps_placement(cls, data=None, requires_grad=True):
        p = parameter_new(cls, data, requires_grad)
        if _CHECK and isinstance(data, torch.Tensor) and is_host(data):
            _mark_host(p)
        return p

    torch.nn.Parameter.__new__ = staticmethod(parameter_keeps_placement)

    module_to = torch.nn.Module.to

    @functools.wraps(module_to)
    def module_to_keeps_the_accelerator(self, *args, **kwargs):
        # Module.to parses its device before any tensor sees it: the accelerator's stand-in
        # (or "cuda") arrives at Tensor.to as torch.device("cpu"), undecidable, and the
        # parameters would keep their host marks although a GPU run moves them. Move them as
        # module.cuda() does, then apply what else was asked (a dtype) with the device left out.
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, torch.Tensor):
            where = "cpu" if is_host(target) else "cuda"
        elif isinstance(target, str) and not isinstance(target, _AcceleratorName):
            where = "cpu" if target.startswith("cpu") else "cuda" if _is_cuda(target) else None
        else:  # torch.device("cpu") stays undecidable (see _checked_call)
            where = "cuda" if target is not None and _is_cuda(target) else None
        if _CHECK and where is not None:
            self.cuda() if where == "cuda" else self.cpu()
            rest = {k: v for k, v in kwargs.items() if k != "device"}
            if isinstance(target, torch.Tensor):  # to(tensor, non_blocking)
                rest.update(zip(("non_blocking",), args[1:]), dtype=target.dtype)
            else:  # to(device, dtype, non_blocking)
                rest.update(zip(("dtype", "non_blocking"), args[1:]))
            if rest.get("dtype") is not None or "memory_format" in rest:
                return module_to(self, **rest)
            return self
        return module_to(self, *args, **kwargs)

    torch.nn.Module.to = module_to_keeps_the_accelerator


def enable_placement_check(on: bool = True) -> None:
    """Turn the placement check on (or off). Needs the shim: on a GPU there is nothing to check,
    the devices are real."""
    global _CHECK
    if on and not _ENABLED:
        raise RuntimeError("the placement check runs under the CPU shim (cpu_shim.enable() on a "
                           "machine without CUDA)")
    if on:
        _install_placement_patches()
        _push_check_mode()
    _CHECK = on


_MODE = None


def _push_check_mode() -> None:
    """The check's mode, pushed once and never popped (process-wide, as the check is meant for
    a whole forked test rank)."""
    global _MODE
    if _MODE is None:
        _MODE = _CudaToCpuMode()
        _MODE.__enter__()
        _keep_mode_in_backward(_MODE)


def placement_check_enabled() -> bool:
    return _CHECK


@contextlib.contextmanager
def placement_check():
    """The placement check inside a ``with`` block (restores the previous setting)."""
    before = _CHECK
    enable_placement_check(True)
    try:
        yield
    finally:
        enable_placement_check(before)
