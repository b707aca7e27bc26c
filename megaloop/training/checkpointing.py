"""Distributed checkpoints: megatron-core ``dist_checkpointing`` (torch_dist) in Megatron-LM's layout.

A checkpoint is ``<dir>/iter_XXXXXXX/`` plus ``<dir>/latest_checkpointed_iteration.txt``. It holds
the model (one key per parameter: the core block is one module whatever the loop count, and a
tied LM head is stored once as the embedding), the megatron optimizer's sharded state, the LR
scheduler, every rank's RNG streams, the iteration, ``consumed_samples`` and the run's
configuration. Tensors are stored by global shape, so a checkpoint saved at one TP/DP layout loads
at another (dist_checkpointing reshards on load).

Crash safety: every rank writes into ``iter_XXXXXXX.tmp``; only after all ranks have finished does
rank 0 rename it to ``iter_XXXXXXX`` and then replace the ``latest`` file (write + ``os.replace``).
A run killed at any moment of a save leaves the previous checkpoint named in ``latest`` intact;
the stale ``.tmp`` directory is ignored by loads and removed by the next save of that iteration.
"""

from __future__ import annotations

import os
import queue
import random
import shutil
from typing import Optional

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1
# The distributed optimizer's state in the canonical per-parameter form (gathered on DP rank 0
# when saving): it loads at any TP, PP and DP. 'dp_reshardable' saves faster but only reshards
# over DP; 'fully_sharded_model_space' fails in megatron-core 0.16 (flattened_range).
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    """The iteration named in ``root``'s latest file, or None when there is no checkpoint."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path} holds {text!r} instead of an iteration number; fix or delete it, "
                         "or pick a checkpoint with --ckpt-step") from None


def unwrap(model) -> torch.nn.Module:
    """The LoopedGPTModel inside DDP / Float16Module (a list means pipeline chunks: chunk 0
    owns the stage's parameters)."""
    if isinstance(model, (list, tuple)):
        model = model[0]
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _layout() -> dict:
    return {"tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size()}


def _rng_state() -> dict:
    state = {"random": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(state) -> ShardedObject:
    # One object per (PP, TP) position. Data-parallel ranks draw the same streams (same seed,
    # same op sequence), so they are replicas and DP may change on load.
    return ShardedObject(
        "rng_state", state,
        (parallel_state.get_pipeline_model_parallel_world_size(),
         parallel_state.get_tensor_model_parallel_world_size()),
        (parallel_state.get_pipeline_model_parallel_rank(),
         parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))


def _use_in_process_results_queue() -> None:
    """megatron-core's torch_dist writer hands its results back through a queue it creates
    from a *spawn*-context Manager: a server process that re-imports ``__main__`` (a script
    without a main guard hangs), costs seconds to start, and outlives a rank that exits with
    ``os._exit`` (holding its stdout open). megaloop saves synchronously, where the writer
    runs in the calling process, so a plain in-process queue carries the same results."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _barrier() -> None:
    torch.distributed.barrier()


def save_checkpoint(save_dir: str, iteration: int, model, optimizer=None, scheduler=None, *,
                    run_config: dict, consumed_samples: int = 0, extra: Optional[dict] = None
                    ) -> str:
    """Write ``save_dir/iter_XXXXXXX`` (collective over all ranks) and name it in the tracker.

    ``extra`` is a small dict of trainer counters stored in the common part of the checkpoint.
    """
    module = unwrap(model)
    final = checkpoint_dir(save_dir, iteration)
    tmp = final + ".tmp"
    rank = torch.distributed.get_rank()
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        if os.path.isdir(tmp):  # left behind by a run killed while saving this iteration
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    _barrier()

    state = {"model": module.sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=False,
                                                          metadata=OPTIM_METADATA)
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    state["rng_state"] = _rng_sharded_object(_rng_state())
    state.update(iteration=iteration, consumed_samples=consumed_samples, run_config=run_config,
                 layout=_layout(), format_version=FORMAT_VERSION, extra=extra or {},
                 has_optimizer=optimizer is not None, optimizer_kind=_optimizer_kind(optimizer))
    _use_in_process_results_queue()
    dist_checkpointing.save(state, tmp, sharded_strategy=get_default_save_sharded_strategy())
    _barrier()  # every rank's shards are on disk before the checkpoint becomes visible

    if rank == 0:
        old = final + ".old"
        if os.path.isdir(final):  # saving the same iteration again: keep it until replaced
            os.rename(final, old)
        os.rename(tmp, final)
        if os.path.isdir(old):
            shutil.rmtree(old)
        tracker = os.path.join(save_dir, TRACKER)
        with open(tracker + ".tmp", "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker + ".tmp", tracker)  # atomic: readers see the old or the new name
    _barrier()
    return final


def _resolve(load_dir: str, iteration: Optional[int]) -> Optional[str]:
    if iteration is None:
        iteration = read_tracker(load_dir)
        if iteration is None:
            return None
    path = checkpoint_dir(load_dir, iteration)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"checkpoint {path} does not exist (named by {TRACKER} or --ckpt-step); "
            f"available: {sorted(d for d in os.listdir(load_dir) if d.startswith('iter_'))}")
    return path


def read_run_config(load_dir: str, iteration: Optional[int] = None) -> dict:
    """The RunConfig (as a dict) a checkpoint was saved with; no process group needed."""
    path = _resolve(load_dir, iteration)
    if path is None:
        raise FileNotFoundError(f"no checkpoint in {load_dir} (no {TRACKER})")
    return dist_checkpointing.load_common_state_dict(path)["run_config"]


def load_checkpoint(load_dir: str, model, optimizer=None, scheduler=None, *,
                    iteration: Optional[int] = None, load_optim: bool = True,
                    load_rng: bool = True, finetune: bool = False) -> Optional[dict]:
    """Restore what ``save_checkpoint`` wrote (collective). Returns None when ``load_dir`` has
    no checkpoint, else ``{"iteration", "consumed_samples", "run_config", "extra", "path"}``
    (iteration and consumed samples are 0 with ``finetune``)."""
    path = _resolve(load_dir, iteration) if os.path.isdir(load_dir) else None
    if path is None:
        return None
    module = unwrap(model)
    common = dist_checkpointing.load_common_state_dict(path)
    if finetune:
        load_optim = load_rng = False
    # A converted checkpoint has weights only: the optimizer then starts fresh.
    load_optim = load_optim and optimizer is not None and common.get("has_optimizer", False)
    # RNG streams belong to (PP, TP) positions: another layout has other streams.
    same_layout = {k: common["layout"][k] for k in ("tp", "pp")} == \
        {k: _layout()[k] for k in ("tp", "pp")}
    load_rng = load_rng and same_layout
    if load_optim and common.get("optimizer_kind") != _optimizer_kind(optimizer):
        raise ValueError(
            f"{path} holds a {common.get('optimizer_kind')} optimizer state but this run uses a "
            f"{_optimizer_kind(optimizer)} one: keep --use-distributed-optimizer as it was when "
            "saving, or pass --no-load-optim to start the optimizer afresh")

    state = {"model": module.sharded_state_dict()}
    if load_optim:
        _init_torch_adam_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=True,
                                                          metadata=OPTIM_METADATA)
    if load_rng:
        state["rng_state"] = _rng_sharded_object(None)
    loaded = dist_checkpointing.load(state, path)
    module.load_state_dict(loaded["model"], strict=True)
    if load_optim:
        _load_optimizer(optimizer, loaded["optimizer"])
        if scheduler is not None and "opt_param_scheduler" in common:
            try:
                scheduler.load_state_dict(common["opt_param_scheduler"])
            except AssertionError as exc:  # megatron-core's check of each schedule value
                raise ValueError(
                    f"{path}: the checkpoint's LR / weight-decay schedule differs from this "
                    f"run's flags ({exc}); pass --override-opt_param-scheduler to follow the new "
                    f"flags or --use-checkpoint-opt_param-scheduler to keep the checkpoint's"
                ) from None
    elif optimizer is not None:
        # The optimizer's fp32 main copies were made from the initial weights: refresh them.
        optimizer.reload_model_params()
    if load_rng:
        _set_rng_state(loaded["rng_state"])
    return {"iteration": 0 if finetune else common["iteration"],
            "consumed_samples": 0 if finetune else common["consumed_samples"],
            "run_config": common["run_config"], "extra": {} if finetune else common["extra"],
            "path": path, "loaded_rng": load_rng, "loaded_optim": load_optim}


def _optimizer_kind(optimizer) -> Optional[str]:
    """'distributed' or 'replicated': their saved states have different forms."""
    from megatron.core.optimizer import distrib_optimizer

    if optimizer is None:
        return None
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return "distributed" if any(isinstance(o, distrib_optimizer.DistributedOptimizer)
                                for o in chained) else "replicated"


def _init_torch_adam_state(optimizer) -> None:
    """Give a fresh distributed optimizer's torch Adam a zero state before loading into it.

    megatron-core 0.16's DistributedOptimizer.state_dict() reads the per-parameter ``step`` that
    torch's Adam keeps (the path taken without Apex/TE, i.e. on CPU) and fails while no step has
    been taken; its own init_state_fn creates the moments but not ``step``. The zeros are
    overwritten by the checkpoint's values.
    """
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, distrib_optimizer.DistributedOptimizer):
            continue
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                state = opt.optimizer.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)
                    state["step"] = torch.tensor(0.0)


def _load_optimizer(optimizer, state: dict) -> None:
    """``optimizer.load_state_dict`` plus a work-around for torch Adam under the distributed
    optimizer (no Apex/TE, i.e. CPU): megatron-core 0.16 re-creates a per-parameter ``step``
    and then copies every state key, ``step`` included, from the saved per-parameter state,
    which deliberately omits it (KeyError). The parameter state is therefore loaded with
    ``step`` set aside; the step itself comes from the param groups as megatron intends, one
    tensor per parameter."""
    from megatron.core.optimizer import distrib_optimizer

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [state] if len(chained) == 1 else [v for _, v in sorted(state.items())]
    for opt, st in zip(chained, states):
        deferred = None
        if (isinstance(opt, distrib_optimizer.DistributedOptimizer)
                and not distrib_optimizer.HAVE_APEX_OR_TE
                and st.get("param_state_sharding_type") == "fully_reshardable"):
            deferred = st.pop("param_state")
            st.pop("param_state_sharding_type")
        opt.load_state_dict(st)
        if deferred is not None:
            inner = opt.optimizer.state
            steps = {p: inner[p].pop("step") for p in list(inner) if "step" in inner[p]}
            opt.load_parameter_state_from_fully_reshardable(deferred)
            for p, step in steps.items():
                # megatron assigns one shared tensor to every parameter's step; torch Adam
                # increments each in place, so a shared one would advance once per parameter.
                inner[p]["step"] = step.detach().clone()
    if len(chained) > 1:
        optimizer._synchronize_steps()
