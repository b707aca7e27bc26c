"""Run a test body on N gloo ranks by forking this (already warm) pytest process.

Importing megatron-core costs seconds and a torchrun launch tens of seconds, while a tiny
tensor-parallel step takes milliseconds (DESIGN.md). So the test process imports everything
once and forks a fresh rank per process: each child gets a free TCP port, its own process
group and megatron-core parallel state, and reports its return value or traceback through a
queue. A child that hangs is killed at the timeout and the test fails; nothing waits forever.
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


def _child(rank, world_size, port, fn, args, queue):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        torch.set_num_threads(1)
        backend = "gloo"
        if torch.cuda.is_available():  # the same test bodies run under NCCL on a GPU machine
            torch.cuda.set_device(rank % torch.cuda.device_count())
            backend = "nccl"
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


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks.

    Returns the list of per-rank return values (they must be picklable); raises with the
    child's traceback if any rank fails, or if a rank does not finish within ``timeout``.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, queue))
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
        raise AssertionError("distributed test failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def setup_parallel(tp: int = 1, seed: int = 7) -> None:
    """megatron-core's parallel state (TP = ``tp``, the rest data parallel) and seeded RNG
    streams, inside a rank forked by ``run_distributed``."""
    from megaloop.parallel.config import ParallelConfig
    from megaloop.parallel.initialize import initialize

    initialize(ParallelConfig(tensor_model_parallel_size=tp), seed)
