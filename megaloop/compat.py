"""The megatron-core API differences megaloop meets between 0.16.1 and 0.19.x, in one place.

- ``get_batch_on_this_cp_rank`` (context parallelism's split of a batch) takes a required
  ``is_hybrid_cp`` from 0.17 on (``cp_split``).
- The optimizer's saved parameter groups are paired with the run's by a key that includes the
  schedule's bounds from 0.17 on (``groups_paired_as_in_0_16``).
- Asynchronous saves: 0.19 defaults to NVIDIA Resiliency Extension's writer (``nvrx``, a
  package of its own); megaloop keeps megatron-core's own (``async_save_options``).
- A checkpoint writer's failure: 0.19's in-process writer reports it by its class alone, which
  hid "disk full" (``keep_writer_errors``).
- A GPT dataset's sample query returns (tokens, document ids) in 0.16 and a third item in
  0.19 (``tokens_and_documents``).
- A layer spec's sub-module slots: 0.16 gives every slot as a ``ModuleSpec`` (its ``submodules``
  a dataclass); 0.19 gives the MLP slot as ``functools.partial(MLP.as_mlp_submodule,
  submodules=MLPSubmodules(...))``. ``submodules_of`` and ``with_submodules`` read and replace
  the sub-modules of either form, so the spec edits (norm schemes, LoRA, timestep conditioning)
  stay one code path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os


@functools.lru_cache(maxsize=None)
def mcore_version() -> tuple[int, int]:
    """(major, minor) of the installed megatron-core."""
    from importlib.metadata import version

    major, minor = version("megatron-core").split(".")[:2]
    return int(major), int(minor)


def submodules_of(spec):
    """The ``submodules`` dataclass of a ModuleSpec or of a partial that carries one."""
    if isinstance(spec, functools.partial):
        return spec.keywords["submodules"]
    return spec.submodules


def with_submodules(spec, **changes):
    """``spec`` (a ModuleSpec, or a partial with a ``submodules`` keyword) with these
    sub-module slots replaced."""
    submodules = dataclasses.replace(submodules_of(spec), **changes)
    if isinstance(spec, functools.partial):
        return functools.partial(spec.func, *spec.args,
                                 **{**spec.keywords, "submodules": submodules})
    return dataclasses.replace(spec, submodules=submodules)


# --- checkpoints ---------------------------------------------------------------------------------
# megatron-core 0.16 writes a checkpoint's common (non-sharded) state to common.pt; 0.17 and later
# keep it inside the torch_dist files as the ShardedObject "common_state" and still read a
# common.pt first where there is one. 0.16 reads only common.pt, so under 0.17+ megaloop writes
# common.pt too: a checkpoint saved by either version loads under the other.
COMMON_FILE = "common.pt"


def common_state_inside_shards() -> bool:
    """Whether this megatron-core keeps the common state in the torch_dist files (>= 0.17)."""
    return mcore_version() >= (0, 17)


def async_save_options() -> dict:
    """``dist_checkpointing.save`` keywords for an asynchronous save with megatron-core's own
    writer process (megaloop.training.async_checkpointing drives it): 0.19's default needs
    nvidia-resiliency-ext, which megaloop does not install; 0.16 has only this writer."""
    from megatron.core import dist_checkpointing

    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        return {"async_strategy": "mcore"}
    return {}


def write_common_file(state: dict, folder: str) -> None:
    """Rank 0: ``state``'s common part (what megatron-core's save keeps out of the shards:
    neither sharded nor local non-persistent entries) to ``folder``/common.pt, as megatron-core
    0.16 writes it. Call after ``dist_checkpointing.save`` has applied the state's factories."""
    import torch
    from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base

    _, persistent = extract_nonpersistent(state)
    _, common = extract_sharded_base(persistent)
    torch.save(common, os.path.join(folder, COMMON_FILE))


# --- data ------------------------------------------------------------------------------------
def tokens_and_documents(dataset, idx: int):
    """(token ids, document ids) of sample ``idx`` of a megatron-core GPTDataset, whatever else
    this version's ``_query_document_sample_shuffle_indices`` returns with them."""
    out = dataset._query_document_sample_shuffle_indices(idx)
    return out[0], out[1]


# --- context parallelism ----------------------------------------------------------------------
def cp_split(batch: dict, group):
    """megatron-core's load-balanced split of ``batch`` over the context-parallel ``group``
    (``megatron.core.utils.get_batch_on_this_cp_rank``; 0.17+ also asks whether hybrid context
    parallelism is on, which megaloop never uses)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)
    return get_batch_on_this_cp_rank(batch, cp_group=group)


# --- optimizer state --------------------------------------------------------------------------
SCHEDULE_BOUNDS = ("max_lr", "min_lr", "start_wd", "end_wd")


@contextlib.contextmanager
def groups_paired_as_in_0_16():
    """Around an optimizer ``load_state_dict``: pair the saved parameter groups with the run's
    by the keys megatron-core 0.16 uses. 0.17+ adds the schedule's bounds (``SCHEDULE_BOUNDS``)
    to the key, so a resume whose --lr or --min-lr differ from the checkpoint's finds no group
    at all, even with --override-opt-param-scheduler; megaloop compares and settles those bounds
    itself (megaloop/training/checkpoint_fit.py). The groups stay told apart by their weight
    decay multiplier and the decoupled-LR mark (megaloop.training.trainer's overrides)."""
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer import optimizer as mcore_optimizer

    modules = [m for m in (mcore_optimizer, distrib_optimizer)
               if hasattr(m, "param_group_identifier_keys")]
    saved = [m.param_group_identifier_keys for m in modules]
    for m, keys in zip(modules, saved):
        m.param_group_identifier_keys = tuple(k for k in keys if k not in SCHEDULE_BOUNDS)
    try:
        yield
    finally:
        for m, keys in zip(modules, saved):
            m.param_group_identifier_keys = keys


_writer_errors_kept = False


def keep_writer_errors() -> None:
    """Under megatron-core 0.17+, let a checkpoint writer's exception reach the save's error with
    its text. 0.19's ``FileSystemWriterAsync`` runs its first write bucket in the calling process
    or thread, which returns the exception it caught (an ``OSError`` with errno ENOSPC on a full
    disk) instead of the written items; its caller then fails an ``assert isinstance(..., list)``
    whose message is only the class, and the save's error no longer says which errno it was
    (megaloop.checkpoint.save names a full disk from it). Re-raising the returned exception makes
    the caller's own message quote it, as 0.16's did. The other buckets run in threads that
    report through a queue and are left as they are. Idempotent; a no-op before 0.17."""
    global _writer_errors_kept
    if _writer_errors_kept or mcore_version() < (0, 17):
        return
    _writer_errors_kept = True
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    write = FileSystemWriterAsync.write_preloaded_data

    def write_raising(*args, **kwargs):
        out = write(*args, **kwargs)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Exception):
            raise out[1]
        return out

    FileSystemWriterAsync.write_preloaded_data = staticmethod(write_raising)
