"""Run a test body on N ranks: forked gloo ranks on CPU, spawned NCCL ranks on a GPU machine.

Importing megatron-core costs seconds and a torchrun launch tens of seconds, while a tiny
tensor-parallel step takes milliseconds. So on CPU the test process imports everything once and
forks a fresh rank per process: each child gets a free TCP port, its own process group and
megatron-core parallel state, and reports its return value or traceback through a queue. A child
that hangs is killed at the timeout and the test fails; nothing waits forever.

On a GPU machine CUDA cannot be used in a child forked from a parent that initialised it, and
two ranks on one GPU hit NCCL's duplicate-device error. There the ranks are *spawned* (fresh
interpreters: the test body must be a module-level function, pickled by reference), one GPU
each, and a test that needs more ranks than GPUs is skipped. The parent never initialises CUDA:
it counts GPUs through NVML (``PYTORCH_NVML_BASED_CUDA_CHECK``, set in conftest.py).
``MEGALOOP_TEST_GPUS=1`` runs the suite in single-GPU mode: one-rank tests on the GPU, every
multi-rank test skipped (e.g. on a shared node where only one GPU is free).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import traceback

import torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_count() -> int:
    """GPUs the tests may use (0 on CPU), without initialising CUDA in this process."""
    if not torch.cuda.is_available():
        return 0
    count = torch.cuda.device_count()
    limit = os.environ.get("MEGALOOP_TEST_GPUS")
    return min(count, int(limit)) if limit else count


def _child(rank, world_size, port, fn, args, queue, on_gpu=False):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        torch.set_num_threads(1)
        backend = "gloo"
        if on_gpu:  # the same test bodies run under NCCL, one GPU per rank
            torch.cuda.set_device(rank)
            backend = "nccl"
        else:  # already on in a forked rank; a spawned one starts without it
            from megaloop import cpu_shim

            cpu_shim.enable()
        torch.distributed.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Plain pickle, by value: the queue's ForkingPickler would pass tensors as shared-memory
        # handles that die with this process.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        # os._exit skips the queue's feeder thread: flush it first or large results are lost.
        queue.close()
        queue.join_thread()
        os._exit(0)


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0,
                    start_method: str | None = None):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks: forked gloo ranks on CPU,
    spawned NCCL ranks (one GPU each) on a GPU machine, where a test that needs more ranks than
    GPUs is skipped.

    Returns the list of per-rank return values (they must be picklable); raises with the
    child's traceback if any rank fails, or if a rank does not finish within ``timeout``.
    ``start_method="spawn"`` spawns CPU ranks too (to test the GPU path's start on CPU).
    """
    gpus = gpu_count()
    if gpus:
        if world_size > gpus:
            import pytest

            pytest.skip(f"needs {world_size} GPUs (one per rank), {gpus} available")
        start_method, on_gpu = "spawn", True
    else:
        start_method, on_gpu = start_method or "fork", False
    if start_method == "spawn":
        timeout += 120.0  # spawned interpreters import megatron-core afresh
    for attempt in range(3):
        try:
            return _run_ranks(fn, world_size, args, timeout, start_method, on_gpu)
        except _PortTaken:
            # The port was free when chosen and taken before rank 0's store listened on it
            # (another test's process, on a busy machine). No rank has run ``fn`` yet: rank 0
            # failed inside init_process_group and the others were waiting there for it.
            if attempt == 2:
                raise


class _PortTaken(AssertionError):
    pass


def _run_ranks(fn, world_size, args, timeout, start_method, on_gpu):
    ctx = mp.get_context(start_method)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, queue, on_gpu))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    except Exception as exc:  # queue.Empty: a rank hung or died without reporting
        errors.append(f"ranks did not finish within {timeout}s ({type(exc).__name__})")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        text = "distributed test failed\n" + "\n".join(errors)
        taken = "EADDRINUSE" in text or "address already in use" in text.lower()
        raise (_PortTaken if taken and "init_process_group" in text else AssertionError)(text)
    return [results[r] for r in range(world_size)]


def run_main(rank, world, argv, out_dir):
    """``pretrain_looplm.main(argv)`` in a rank of ``run_distributed``, with the console of a
    launched process: file descriptors 1 and 2 (C-level output too) go to
    ``out_dir/rank<N>.out`` / ``.err``, and the warning filters and root logger are a fresh
    interpreter's (pytest's ignore UserWarning and capture log records, so a warning a user would
    see could not fail a test here), before the entry point installs its own filters. What a
    fresh interpreter prints while importing is not seen here: one real launch
    (tests/test_functional.py) checks that. Returns main's exit code; console_of() reads the
    output."""
    import logging
    import sys
    import warnings

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    import pretrain_looplm
    from megaloop import runtime

    for fd, suffix in ((1, "out"), (2, "err")):
        target = os.open(os.path.join(out_dir, f"rank{rank}.{suffix}"),
                         os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # pytest had swapped them
    warnings.resetwarnings()  # Python's own defaults (the warnings module's documentation)
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning,
                     ResourceWarning):
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")

    def show(message, category, filename, lineno, file=None, line=None):
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = show  # pytest records warnings instead of printing them
    for handler in list(logging.root.handlers):
        logging.root.removeHandler(handler)
    logging.root.setLevel(logging.WARNING)
    runtime._quieted = False  # the entry point's filters, installed afresh by main
    try:
        return pretrain_looplm.main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def console_of(out_dir, world):
    """(stdout, stderr) of a ``run_main`` run: each stream of the ranks in rank order, as one
    launcher's console shows them (torchrun interleaves them; the lines are the same)."""
    def read(suffix):
        return "".join(open(os.path.join(out_dir, f"rank{r}.{suffix}")).read()
                       for r in range(world))

    return read("out"), read("err")


def setup_parallel(tp: int = 1, seed: int = 7) -> None:
    """megatron-core's parallel state (TP = ``tp``, the rest data parallel) and seeded RNG
    streams, inside a rank forked by ``run_distributed``."""
    from megaloop.parallel.config import ParallelConfig
    from megaloop.parallel.initialize import initialize

    initialize(ParallelConfig(tensor_model_parallel_size=tp), seed)
