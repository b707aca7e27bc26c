"""The trainer's checkpoints: what a training run saves and resumes on top of the checkpoint format
(megaloop.checkpoint: folder layout, crash-safe save, manifest, weights).

A training checkpoint adds to the model's weights the megatron optimizer's sharded state, the LR
scheduler, every rank's RNG streams, ``consumed_samples`` and the trainer's counters, and the
run's configuration. Tensors are stored by global shape, so a checkpoint saved at one TP/PP/DP
layout loads at another (dist_checkpointing reshards on load).

What is checked (each failure is a ``CheckpointError`` naming the file and what to do, raised on
every rank alike so no rank waits in a collective the others left):

- save (megaloop.checkpoint.save): every parameter is finite; a failed save (disk full: said so,
  with the free bytes) removes its ``.tmp`` and says which checkpoint ``latest`` still names; the
  checksum manifest is written before the folder is renamed and named in ``latest``;
- load (``check_resume`` also before any process group): ``latest`` holds an iteration number;
  the checkpoint fits this run (``megaloop.training.checkpoint_fit``: architecture flags, a
  changed loop count allowed and announced, --finetune relaxing nothing; optimizer groups; LR
  schedule and every group's LR bounds; tensor shapes; a misfit is a ``CheckpointMismatch``,
  exit code 2); every file matches the manifest; a read that fails anyway names the folder and
  the previous checkpoint to fall back to (``--ckpt-step``);
- a run that diverges right after a save sets that checkpoint aside (``set_aside_diverged``).
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Optional

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel

from megaloop.checkpoint.config import read_run_config  # noqa: F401  (callers' name)
from megaloop.checkpoint.errors import CheckpointError, CheckpointMismatch
from megaloop.checkpoint.format import agree, common_state, layout, read_common, unwrap
from megaloop.checkpoint.load import load_module_state, read_shards, verify_files
from megaloop.checkpoint.manifest import MANIFEST  # noqa: F401  (callers' name)
from megaloop.checkpoint.manifest import verify_manifest as _verify_manifest  # noqa: F401
from megaloop.checkpoint.save import publish, write_shards
from megaloop.checkpoint.tracker import (TRACKER, available_iterations, checkpoint_dir,
                                         read_tracker, remove_stale_saves,  # noqa: F401
                                         resolve, write_tracker)
from megaloop.compat import groups_paired_as_in_0_16
from megaloop.training.async_checkpointing import collect_sidecars
from megaloop.training.checkpoint_fit import (ARCHITECTURE, compare_architecture,
                                              compare_optimizer_groups, compare_schedule,
                                              schedule_bounds, settle_schedule_bounds)

# The distributed optimizer's state in the canonical per-parameter form (gathered on DP rank 0
# when saving): it loads at any TP, PP and DP. 'dp_reshardable' saves faster but only reshards
# over DP; 'fully_sharded_model_space' fails in megatron-core 0.16 (flattened_range).
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


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


def _rng_sharded_object(state) -> dist_checkpointing.ShardedObject:
    # One object per (PP, TP) position. Data-parallel ranks draw the same streams (same seed,
    # same op sequence), so they are replicas and DP may change on load.
    return dist_checkpointing.ShardedObject(
        "rng_state", state,
        (parallel_state.get_pipeline_model_parallel_world_size(),
         parallel_state.get_tensor_model_parallel_world_size()),
        (parallel_state.get_pipeline_model_parallel_rank(),
         parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))


def set_aside_diverged(save_dir: str, iteration: int) -> Optional[int]:
    """Collective, when a run stops because the steps right after checkpoint ``iteration`` were
    all non-finite: those weights are what diverged, so rank 0 renames the folder to
    ``iter_XXXXXXX.diverged`` (kept for inspection, never loaded) and names the newest earlier
    checkpoint in the tracker (or removes the tracker when there is none). Returns the
    iteration ``latest`` names now, or None."""
    earlier = [i for i in available_iterations(save_dir) if i < iteration]
    error = None
    if torch.distributed.get_rank() == 0:
        try:
            folder = checkpoint_dir(save_dir, iteration)
            shutil.rmtree(folder + ".diverged", ignore_errors=True)
            os.rename(folder, folder + ".diverged")
            if earlier:
                write_tracker(save_dir, earlier[-1])
            elif os.path.exists(os.path.join(save_dir, TRACKER)):
                os.remove(os.path.join(save_dir, TRACKER))
        except OSError as exc:
            error = exc
    failures = agree(error)
    if failures:
        raise CheckpointError(f"setting the diverged {checkpoint_dir(save_dir, iteration)} aside "
                              f"failed ({failures}); do not resume from it")
    return earlier[-1] if earlier else None


def save_checkpoint(save_dir: str, iteration: int, model, optimizer=None, scheduler=None, *,
                    run_config: dict, consumed_samples: int = 0, extra: Optional[dict] = None,
                    checksums: bool = True, save_rng: bool = True, saver=None,
                    strategy=None) -> str:
    """Write ``save_dir/iter_XXXXXXX`` (collective over all ranks) and name it in the tracker.

    ``saver``: a megaloop.training.async_checkpointing.AsyncSaver (--async-save): the shards are
    written in the background and the checkpoint is published (manifest, rename, tracker) when
    the saver finalises it; the returned path exists from then on. ``strategy``: megatron-core's
    save strategy (megaloop.training.async_checkpointing.checkpoint_save_strategy; kept by the
    trainer from save to save, so a cached plan is reused), its default torch_dist one if None.

    ``extra`` is a small dict of trainer counters stored in the common part of the checkpoint.
    ``checksums``: write the per-file manifest (verified by ``load_checkpoint``). Raises
    ``CheckpointError`` (on every rank) when the parameters are not finite or the save fails;
    the partial folder is then removed and the tracker is untouched.
    """
    module = unwrap(model)
    state = {"model": module.sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=False,
                                                          metadata=OPTIM_METADATA)
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    if save_rng:
        state["rng_state"] = _rng_sharded_object(_rng_state())
    state.update(common_state(iteration, run_config, consumed_samples=consumed_samples,
                              extra=extra, has_optimizer=optimizer is not None,
                              optimizer_kind=_optimizer_kind(optimizer), has_rng=save_rng))
    if saver is not None:
        # The previous save first: if its writers failed, it stops the run here, before this
        # save leaves a folder of its own behind.
        saver.finalize_all()
    tmp, final, request = write_shards(save_dir, iteration, module, state, strategy=strategy,
                                       asynchronous=saver is not None)
    if saver is None:
        publish(save_dir, iteration, tmp, final, checksums=checksums)
        return final

    def finish():  # the finalisation, once every rank's writer has finished
        publish(save_dir, iteration, tmp, final, checksums=checksums,
                writer_hashes=collect_sidecars)

    saver.schedule(request, iteration, tmp, final, checksums, finish)
    return final


def check_resume(load_dir: Optional[str], iteration: Optional[int], run_config: dict) -> list:
    """Before any process group: the checkpoint a run would resume from is named correctly, its
    common part reads and its architecture is this run's. Returns notes (see
    ``compare_architecture``); nothing to check without --load or a checkpoint in it."""
    if not load_dir or not os.path.isdir(load_dir):
        return []
    path = resolve(load_dir, iteration)
    if path is None:
        return []
    common = read_common(path)
    notes = compare_architecture(common.get("run_config") or {}, run_config, path)
    ck = run_config["checkpoint"]
    if common.get("has_optimizer", False) and not (ck["no_load_optim"] or ck["finetune"]):
        compare_optimizer_groups(common.get("run_config") or {}, run_config, path)
    return notes


def apply_checkpoint_args(cfg) -> list[str]:
    """--use-checkpoint-args: set ``cfg``'s architecture flags (``ARCHITECTURE``, the position
    limit, the QKV bias, the loop count and the exit objective) to the values the checkpoint in
    --load was saved with; returns the flags that changed. Nothing happens when --load holds no
    checkpoint yet (a fresh run's first launch keeps its flags). No process group needed."""
    ck = cfg.checkpoint
    if not ck.load or not os.path.isdir(ck.load) or resolve(ck.load, ck.ckpt_step) is None:
        return []
    saved = read_run_config(ck.load, ck.ckpt_step)
    changed = []
    # The loop count and objective too (they decide whether the model has an exit gate), and
    # the model arguments Megatron-LM's flag also takes that a load does not compare: the
    # position limit (compared only for a learned position table, which it sizes), the QKV
    # bias (its tensors) and the RoPE base; and, beyond Megatron-LM's list, what else changes
    # the computation without changing a tensor: RoPE scaling and the norms' epsilon (an
    # imported Ouro checkpoint has theta 1e6 and eps 1e-6, not the flags' 10000 and 1e-5).
    taken = {**ARCHITECTURE,
             "model": ARCHITECTURE["model"] + (
                 "max_position_embeddings", "add_qkv_bias", "rotary_base", "use_rope_scaling",
                 "rope_scaling_factor", "norm_epsilon"),
             "loop": ARCHITECTURE["loop"] + ("num_loops", "exit_loss")}
    for section, names in taken.items():
        target = getattr(cfg, section)
        for name in names:
            if name in saved.get(section, {}) and saved[section][name] != getattr(target, name):
                setattr(target, name, saved[section][name])
                changed.append(f"--{name.replace('_', '-')} {saved[section][name]}")
    return changed


def load_checkpoint(load_dir: str, model, optimizer=None, scheduler=None, *,
                    iteration: Optional[int] = None, load_optim: bool = True,
                    load_rng: bool = True, finetune: bool = False,
                    run_config: Optional[dict] = None, verify: bool = True) -> Optional[dict]:
    """Restore what ``save_checkpoint`` wrote (collective). Returns None when ``load_dir`` has
    no checkpoint, else ``{"iteration", "consumed_samples", "run_config", "extra", "path",
    "notes"}`` (iteration and consumed samples are 0 with ``finetune``).

    ``run_config``: this run's configuration, whose architecture flags the checkpoint's must
    equal (``compare_architecture``). ``verify``: check the files against the manifest first.
    Every failure to read is one CheckpointError on every rank, naming the file and the previous
    checkpoint to fall back to."""
    path = resolve(load_dir, iteration) if os.path.isdir(load_dir) else None
    if path is None:
        return None
    common = read_common(path)
    notes = []
    if run_config is not None:
        notes = compare_architecture(common.get("run_config") or {}, run_config, path)
    if verify:
        notes += verify_files(path)
    module = unwrap(model)
    if finetune:
        load_optim = load_rng = False
    # A converted checkpoint has weights only: the optimizer then starts fresh.
    load_optim = load_optim and optimizer is not None and common.get("has_optimizer", False)
    # RNG streams belong to (PP, TP) positions: another layout has other streams.
    same_layout = {k: common["layout"][k] for k in ("tp", "pp")} == \
        {k: layout()[k] for k in ("tp", "pp")}
    load_rng = load_rng and same_layout and common.get("has_rng", True)  # --no-save-rng
    if load_optim and common.get("optimizer_kind") != _optimizer_kind(optimizer):
        raise CheckpointMismatch(
            f"{path} holds a {common.get('optimizer_kind')} optimizer state but this run uses a "
            f"{_optimizer_kind(optimizer)} one: keep --use-distributed-optimizer as it was when "
            "saving, or pass --no-load-optim to start the optimizer afresh")

    if load_optim:
        if run_config is not None:
            compare_optimizer_groups(common.get("run_config") or {}, run_config, path)
        if scheduler is not None and "opt_param_scheduler" in common:
            compare_schedule(common["opt_param_scheduler"], scheduler, path)

    state = {"model": module.sharded_state_dict()}
    if load_optim:
        _init_torch_adam_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=True,
                                                          metadata=OPTIM_METADATA)
    if load_rng:
        state["rng_state"] = _rng_sharded_object(None)
    loaded = read_shards(state, path)
    load_module_state(module, loaded["model"])  # strict but for TE's unsaved extra state
    if load_optim:
        from_flags = schedule_bounds(optimizer)
        _load_optimizer(optimizer, loaded["optimizer"], path)
        if scheduler is not None and "opt_param_scheduler" in common:
            # The groups' bounds first: the scheduler's load sets every group's LR from them.
            notes += settle_schedule_bounds(optimizer, from_flags, scheduler, path)
            scheduler.load_state_dict(common["opt_param_scheduler"])
    elif optimizer is not None:
        # The optimizer's fp32 main copies were made from the initial weights: refresh them.
        optimizer.reload_model_params()
    if load_rng:
        _set_rng_state(loaded["rng_state"])
    return {"iteration": 0 if finetune else common["iteration"],
            "consumed_samples": 0 if finetune else common["consumed_samples"],
            "run_config": common["run_config"], "extra": {} if finetune else common["extra"],
            "path": path, "loaded_rng": load_rng, "loaded_optim": load_optim, "notes": notes}


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


def _load_optimizer(optimizer, state: dict, path: str) -> None:
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
        try:
            with groups_paired_as_in_0_16():
                opt.load_state_dict(st)
        except (ValueError, KeyError) as exc:  # megatron-core matches the saved groups to ours
            raise CheckpointMismatch(
                f"{path}: the checkpoint's optimizer parameter groups are not this run's "
                f"({type(exc).__name__}: {str(exc).splitlines()[0]}); keep the optimizer flags "
                f"it was saved with (--decoupled-lr, --optimizer), or pass --no-load-optim to "
                f"start the optimizer afresh") from None
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
