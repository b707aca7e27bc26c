"""What a checkpoint folder holds besides the tensors, and the rank agreement every read and
write goes through.

A checkpoint is megatron-core ``dist_checkpointing`` (torch_dist) in Megatron-LM's layout
(``megaloop.checkpoint.tracker``). Its common part (``common.pt``) holds the iteration,
``consumed_samples``, the run's configuration as a dict (``run_config``: one section per config
dataclass), the parallel layout that saved it, trainer counters (``extra``) and what else it
holds (``has_optimizer``, ``optimizer_kind``, ``has_rng``). Tensors are stored by global shape,
so a checkpoint saved at one TP/PP/DP layout loads at another (dist_checkpointing reshards).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from megatron.core import dist_checkpointing, parallel_state
from torch.distributed.checkpoint.api import CheckpointException

from megaloop.checkpoint.errors import CheckpointError
from megaloop.checkpoint.tracker import unreadable
from megaloop.device import current_device

FORMAT_VERSION = 1
# torch DCP reports a rank's failed read or write as CheckpointException, a BaseException.
READ_WRITE_ERRORS = (Exception, CheckpointException)


def unwrap(model) -> torch.nn.Module:
    """The LoopedGPTModel inside DDP / Float16Module (a list means pipeline chunks: chunk 0
    owns the stage's parameters)."""
    if isinstance(model, (list, tuple)):
        model = model[0]
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def layout() -> dict:
    """The parallel layout of this process's world (recorded in the common part)."""
    return {"tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size()}


def common_state(iteration: int, run_config: dict, *, consumed_samples: int = 0,
                 extra: Optional[dict] = None, has_optimizer: bool = False,
                 optimizer_kind: Optional[str] = None, has_rng: bool = False) -> dict:
    """The common part's entries (see the module docstring)."""
    return {"iteration": iteration, "consumed_samples": consumed_samples,
            "run_config": run_config, "has_rng": has_rng, "layout": layout(),
            "format_version": FORMAT_VERSION, "extra": extra or {},
            "has_optimizer": has_optimizer, "optimizer_kind": optimizer_kind}


def agree(error: Optional[BaseException]) -> Optional[str]:
    """Collective: every rank says whether its part failed; returns the failures ("rank r:
    message"), the same on every rank, or None. Each rank catches its own exception and calls
    this, so a failure on one rank never leaves the others waiting in a later collective."""
    flag = torch.tensor([0.0 if error is None else 1.0], device=current_device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if flag.item() == 0:
        return None
    text = None if error is None else first_lines(error)
    messages = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(messages, text)
    return "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m) or \
        "a rank failed without saying why"


def first_lines(error: BaseException) -> str:
    """``Type: message`` in one line; for torch DCP's CheckpointException, whose own first line
    names only the failing ranks, the first line of each rank's exception. Empty for the
    CheckpointException megatron-core raises on the ranks other than the one that gathered the
    failures (it has none to name: that rank's message names them)."""
    if isinstance(error, CheckpointException):
        return "; ".join(first_lines(inner) for inner, _ in error.failures.values())
    return f"{type(error).__name__}: {error}".splitlines()[0]


def read_common(path: str) -> dict:
    """The common part of checkpoint folder ``path`` (iteration, run config, ...), or a
    CheckpointError naming the file and the checkpoint to fall back to."""
    try:
        return dist_checkpointing.load_common_state_dict(path)
    except Exception as exc:  # missing or damaged common.pt: torch.load / pickle errors
        raise CheckpointError(unreadable(path, f"{os.path.join(path, 'common.pt')}: "
                                               f"{type(exc).__name__}: {exc}")) from None

