"""Process groups and RNG: torch.distributed, megatron-core's parallel state, seeded streams."""

from __future__ import annotations

import os
import random
import socket
from datetime import timedelta

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel

from megaloop.parallel.config import ParallelConfig


def backend_for(parallel: ParallelConfig) -> str:
    """nccl needs CUDA: without a GPU, Megatron-LM's default nccl (and auto) run on gloo, so a
    Megatron-LM command line and every CPU command work unchanged."""
    if not torch.cuda.is_available():
        return "gloo"
    if parallel.distributed_backend != "auto":
        return parallel.distributed_backend
    return "nccl"


def single_process_env() -> bool:
    """Without a launcher (``python pretrain_looplm.py ...``: no RANK / WORLD_SIZE), set up a
    world of one process on a free local port, as a user trying it on a laptop expects, instead
    of torch's "RANK expected". Returns whether it did. A launcher that started several copies
    without torchrun (``srun -n 8 python ...``) is refused: eight worlds of one would each train
    alone."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return False
    tasks = int(os.environ.get("SLURM_NTASKS", "1"))
    if tasks > 1:
        raise ValueError(f"SLURM started {tasks} tasks without torchrun (no RANK/WORLD_SIZE): "
                         "start one task per node running torchrun, as "
                         "examples/slurm/pretrain_looplm.sbatch does")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    return True


def initialize(parallel: ParallelConfig, seed: int) -> None:
    """Start torch.distributed (env:// from torchrun/SLURM, or a world of one without a
    launcher), megatron-core's groups, the RNGs."""
    if not torch.distributed.is_initialized():
        single_process_env()
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        store = {}
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            # A world of one needs no rendezvous: an in-process store, not a TCP port (a port
            # found free may be taken before the store listens on it: EADDRINUSE).
            store = dict(store=torch.distributed.HashStore(), rank=0, world_size=1)
        torch.distributed.init_process_group(backend=backend_for(parallel),
                                             timeout=timedelta(
                                                 minutes=parallel.distributed_timeout_minutes),
                                             **store)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size)
    set_seed(seed)


def initialize_single_process(parallel: ParallelConfig | None = None, seed: int = 1234) -> None:
    """A world of one process for tools and benchmarks (converter, probes, timing scripts):
    env:// on a free local port unless a launcher already set one, then ``initialize``."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if os.environ["WORLD_SIZE"] != "1":
        raise ValueError("this script runs as one process; launch it with python, not torchrun")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    initialize(parallel or ParallelConfig(distributed_backend="gloo"), seed)


def set_seed(seed: int) -> None:
    """Same seed on every rank; megatron-core derives distinct per-TP-rank streams for dropout
    inside tensor-parallel regions from it."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
