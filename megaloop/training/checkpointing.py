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
the stale ``.tmp`` directory is ignored by loads and removed when the next run starts.

What is checked (each failure is a ``CheckpointError`` naming the file and what to do, raised on
every rank alike so no rank waits in a collective the others left):

- save: every parameter is finite (a diverged model is never written, ``latest`` never names
  one); a save that fails (disk full: said so, with the free bytes) removes its ``.tmp`` and
  says which checkpoint ``latest`` still names; a manifest with every file's size and SHA-256
  (``megaloop_manifest.json``, hashed by all ranks, a share each) is written before the rename;
- load (``check_resume`` also before any process group): ``latest`` holds an iteration number;
  the checkpoint fits this run (``megaloop.training.checkpoint_fit``: architecture flags, a
  changed loop count allowed and announced, --finetune relaxing nothing; optimizer groups; LR
  schedule and every group's LR bounds; tensor shapes; a misfit is a ``CheckpointMismatch``,
  exit code 2); every file matches the manifest; a read that fails anyway names the folder and
  the previous checkpoint to fall back to (``--ckpt-step``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import random
import shutil
from typing import Optional

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from torch.distributed.checkpoint.api import CheckpointException

from megaloop.device import current_device
from megaloop.training.checkpoint_fit import (ARCHITECTURE, CheckpointError,  # noqa: F401
                                              CheckpointMismatch,
                                              compare_architecture, compare_optimizer_groups,
                                              compare_schedule, compare_tensor_shapes,
                                              schedule_bounds,
                                              settle_schedule_bounds)

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "megaloop_manifest.json"
# torch DCP reports a rank's failed read or write as CheckpointException, a BaseException.
_READ_WRITE_ERRORS = (Exception, CheckpointException)
FORMAT_VERSION = 1
# The distributed optimizer's state in the canonical per-parameter form (gathered on DP rank 0
# when saving): it loads at any TP, PP and DP. 'dp_reshardable' saves faster but only reshards
# over DP; 'fully_sharded_model_space' fails in megatron-core 0.16 (flattened_range).
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def available_iterations(root: str) -> list:
    """Iterations with a complete (renamed) checkpoint folder in ``root``, ascending."""
    if not os.path.isdir(root):
        return []
    its = []
    for name in os.listdir(root):
        if name.startswith("iter_") and name[5:].isdigit() and \
                os.path.isdir(os.path.join(root, name)):
            its.append(int(name[5:]))
    return sorted(its)


def fallback_hint(root: str, below: Optional[int] = None) -> str:
    """How to load another checkpoint instead: the newest one below ``below`` (else the newest)."""
    its = [i for i in available_iterations(root) if below is None or i < below]
    if not its:
        return f"{root} holds no other checkpoint folder to pick with --ckpt-step"
    return (f"load the previous checkpoint instead with --ckpt-step {its[-1]} (available in "
            f"{root}: {', '.join(map(str, available_iterations(root)))})")


def read_tracker(root: str) -> Optional[int]:
    """The iteration named in ``root``'s latest file, or None when there is no checkpoint."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:  # bytes: a damaged file must not end in a UnicodeDecodeError
        raw = f.read()
    text = raw.decode("ascii", errors="replace").strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {raw[:40]!r} instead of an iteration number; "
                              f"{fallback_hint(root)} (or fix or delete the file)")
    return int(text)


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


def _agree(error: Optional[BaseException]) -> Optional[str]:
    """Collective: every rank says whether its part failed; returns the failures ("rank r:
    message"), the same on every rank, or None. Each rank catches its own exception and calls
    this, so a failure on one rank never leaves the others waiting in a later collective."""
    flag = torch.tensor([0.0 if error is None else 1.0], device=current_device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if flag.item() == 0:
        return None
    text = None if error is None else _first_lines(error)
    messages = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(messages, text)
    return "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None)


def _first_lines(error: BaseException) -> str:
    """``Type: message`` in one line; for torch DCP's CheckpointException, whose own first line
    names only the failing ranks, the first line of each rank's exception."""
    if isinstance(error, CheckpointException) and error.failures:
        return "; ".join(_first_lines(inner) for inner, _ in error.failures.values())
    return f"{type(error).__name__}: {error}".splitlines()[0]


def _check_finite_parameters(module, iteration: int, save_dir: str) -> None:
    """Collective: refuse to save weights that hold NaN or infinity (the run diverged)."""
    bad = next((name for name, p in module.named_parameters()
                if not torch.isfinite(p.detach()).all()), None)
    failures = _agree(None if bad is None else FloatingPointError(f"parameter {bad}"))
    if failures:
        latest = read_tracker(save_dir) if os.path.isdir(save_dir) else None
        raise CheckpointError(
            f"not saving iteration {iteration}: parameters are not finite ({failures}); the run "
            f"has diverged. {TRACKER} in {save_dir} still names "
            f"{'no checkpoint' if latest is None else f'iteration {latest}'}: resume from there "
            "with a lower --lr or a longer --lr-warmup-iters, and keep "
            "--check-for-nan-in-loss-and-grad on (it skips non-finite steps)")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _checkpoint_files(path: str) -> list:
    out = []
    for dirpath, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), path)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _hash_share(path: str, files: list) -> dict:
    """This rank's share of the files (every world_size-th): relpath -> [size, sha256]."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return {rel: [os.path.getsize(os.path.join(path, rel)), _sha256(os.path.join(path, rel))]
            for rel in files[rank::world]}


def _write_manifest(path: str) -> None:
    """Collective: every rank hashes a share of the files; rank 0 writes the manifest."""
    files = _checkpoint_files(path)
    shares = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(shares, _hash_share(path, files))
    if torch.distributed.get_rank() == 0:
        _write_manifest_file(path, {k: v for share in shares for k, v in share.items()})


def _write_manifest_from(path: str, hashed: Optional[dict]) -> None:
    """Rank 0: the manifest from the hashes the async writers took (``hashed``: relpath ->
    [size, sha256]), hashing only the files they did not write (megatron-core's metadata)."""
    if torch.distributed.get_rank() == 0:
        entries = dict(hashed)
        for rel in _checkpoint_files(path):
            if rel not in entries:
                full = os.path.join(path, rel)
                entries[rel] = [os.path.getsize(full), _sha256(full)]
        _write_manifest_file(path, entries)


def _write_manifest_file(path: str, entries: dict) -> None:
    manifest = {"format": 1, "algorithm": "sha256",
                "files": {k: {"size": size, "sha256": digest}
                          for k, (size, digest) in sorted(entries.items())}}
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _verify_manifest(path: str) -> Optional[str]:
    """Collective: every rank checks a share of the manifest's files. Returns None when all
    match, else what differs (the same text on every rank); a note when there is no manifest."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        return None
    try:
        with open(manifest_path) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as exc:
        return f"{manifest_path} is unreadable ({type(exc).__name__}: {exc})"
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    problems = []
    for rel in sorted(files)[rank::world]:
        full, want = os.path.join(path, rel), files[rel]
        if not os.path.isfile(full):
            problems.append(f"{full} is missing")
        elif os.path.getsize(full) != want["size"]:
            problems.append(f"{full} has {os.path.getsize(full)} bytes, the manifest "
                            f"{want['size']} (cut short or overwritten)")
        elif _sha256(full) != want["sha256"]:
            problems.append(f"{full} differs from its checksum (corrupted bytes)")
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, problems)
    found = sorted(p for share in gathered for p in share)
    return "; ".join(found) if found else None


def remove_stale_saves(save_dir: str) -> list:
    """Rank 0: delete the ``iter_*.tmp`` folders of saves that never finished (a run killed or
    failed while saving; loads never read them). Returns what was removed."""
    removed = []
    if save_dir and os.path.isdir(save_dir):
        for name in sorted(os.listdir(save_dir)):
            path = os.path.join(save_dir, name)
            if name.startswith("iter_") and name.endswith(".tmp") and os.path.isdir(path):
                shutil.rmtree(path)
                removed.append(path)
    return removed


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
                _write_tracker(save_dir, earlier[-1])
            elif os.path.exists(os.path.join(save_dir, TRACKER)):
                os.remove(os.path.join(save_dir, TRACKER))
        except OSError as exc:
            error = exc
    failures = _agree(error)
    if failures:
        raise CheckpointError(f"setting the diverged {checkpoint_dir(save_dir, iteration)} aside "
                              f"failed ({failures}); do not resume from it")
    return earlier[-1] if earlier else None


def _write_tracker(save_dir: str, iteration: int) -> None:
    tracker = os.path.join(save_dir, TRACKER)
    with open(tracker + ".tmp", "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker + ".tmp", tracker)  # atomic: readers see the old or the new name


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
    _check_finite_parameters(module, iteration, save_dir)
    final = checkpoint_dir(save_dir, iteration)
    tmp = final + ".tmp"
    rank = torch.distributed.get_rank()
    error = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            if os.path.isdir(tmp):  # left behind by a run killed while saving this iteration
                shutil.rmtree(tmp)
            os.makedirs(tmp)
        except OSError as exc:
            error = exc
    _fail_save_if_any(error, save_dir, iteration, tmp)

    state = {"model": module.sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=False,
                                                          metadata=OPTIM_METADATA)
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    if save_rng:
        state["rng_state"] = _rng_sharded_object(_rng_state())
    state.update(iteration=iteration, consumed_samples=consumed_samples, run_config=run_config,
                 has_rng=save_rng,
                 layout=_layout(), format_version=FORMAT_VERSION, extra=extra or {},
                 has_optimizer=optimizer is not None, optimizer_kind=_optimizer_kind(optimizer))
    if saver is None:
        _use_in_process_results_queue()
    request = None
    try:
        request = dist_checkpointing.save(state, tmp,
                                          sharded_strategy=strategy
                                          or get_default_save_sharded_strategy(),
                                          async_sharded_save=saver is not None)
    except _READ_WRITE_ERRORS as exc:  # disk full, quota, I/O error: every rank reports below
        error = exc
    # (the agreement is also the barrier: every rank's shards are on disk before going on)
    _fail_save_if_any(error, save_dir, iteration, tmp)
    if saver is not None:
        def publish():  # the finalisation, once every rank's writer has finished
            failed = None
            if checksums:
                from megaloop.training.async_checkpointing import collect_sidecars

                try:
                    _write_manifest_from(tmp, collect_sidecars(tmp))
                except (OSError, ValueError) as exc:
                    failed = exc
                _fail_save_if_any(failed, save_dir, iteration, tmp)
            _publish(save_dir, iteration, tmp, final)

        saver.schedule(request, iteration, tmp, final, checksums, publish)
        return final
    if checksums:
        try:
            _write_manifest(tmp)
        except OSError as exc:
            error = exc
        _fail_save_if_any(error, save_dir, iteration, tmp)
    _publish(save_dir, iteration, tmp, final)
    return final


def _publish(save_dir: str, iteration: int, tmp: str, final: str) -> None:
    """Collective: rank 0 renames the complete ``tmp`` to ``final`` and names it in the
    tracker (the last step of a save: a crash before it leaves the previous checkpoint)."""
    error = None
    if torch.distributed.get_rank() == 0:
        try:
            old = final + ".old"
            if os.path.isdir(final):  # saving the same iteration again: keep it until replaced
                os.rename(final, old)
            os.rename(tmp, final)
            if os.path.isdir(old):
                shutil.rmtree(old)
            _write_tracker(save_dir, iteration)
        except OSError as exc:
            error = exc
    _fail_save_if_any(error, save_dir, iteration, tmp)


def _disk_full(error: Optional[BaseException], save_dir: str) -> Optional[BaseException]:
    """A failure that is (or wraps, as torch DCP's writer does) running out of disk space or
    quota, restated to say so with the free bytes of ``save_dir``'s file system; else ``error``."""
    inner = [error] + ([e for e, _ in error.failures.values()]
                       if isinstance(error, CheckpointException) else [])
    for exc in inner:
        while exc is not None:
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                try:
                    free = f"{shutil.disk_usage(save_dir).free:,} bytes free"
                except OSError:
                    free = "free space unknown"
                what = "the disk is full" if exc.errno == errno.ENOSPC else \
                    "the disk quota is exceeded"
                return OSError(exc.errno, f"{what}: {free} on the file system of {save_dir} "
                                          f"({exc.strerror})")
            exc = exc.__cause__ or exc.__context__
    return error


def _fail_save_if_any(error, save_dir: str, iteration: int, tmp: str) -> None:
    """Collective: when any rank's part of the save failed, rank 0 removes the partial folder and
    every rank raises the same CheckpointError."""
    failures = _agree(_disk_full(error, save_dir))
    if failures is None:
        return
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    try:
        latest = read_tracker(save_dir)
    except CheckpointError:
        latest = None
    raise CheckpointError(
        f"saving iteration {iteration} to {save_dir} failed ({failures}); removed the partial "
        f"{tmp}. {TRACKER} still names "
        f"{'no checkpoint' if latest is None else f'iteration {latest}'}: free space or fix the "
        f"folder, then resume from it with --load {save_dir}")


def _resolve(load_dir: str, iteration: Optional[int]) -> Optional[str]:
    if iteration is None:
        iteration = read_tracker(load_dir)
        if iteration is None:
            return None
    path = checkpoint_dir(load_dir, iteration)
    if not os.path.isdir(path):
        raise CheckpointError(
            f"checkpoint {path} does not exist (named by {TRACKER} or --ckpt-step); "
            f"{fallback_hint(load_dir, iteration)}")
    return path


def _read_common(path: str) -> dict:
    """The checkpoint's common part (iteration, run config, ...), or a CheckpointError naming
    the file and the checkpoint to fall back to."""
    try:
        return dist_checkpointing.load_common_state_dict(path)
    except Exception as exc:  # missing or damaged common.pt: torch.load / pickle errors
        raise CheckpointError(_unreadable(path, f"{os.path.join(path, 'common.pt')}: "
                                                f"{type(exc).__name__}: {exc}")) from None


def _unreadable(path: str, detail: str) -> str:
    root, name = os.path.split(os.path.normpath(path))
    below = int(name[5:]) if name[5:].isdigit() else None
    return f"cannot load checkpoint {path}: {detail}. {fallback_hint(root, below)}"


def check_resume(load_dir: Optional[str], iteration: Optional[int], run_config: dict) -> list:
    """Before any process group: the checkpoint a run would resume from is named correctly, its
    common part reads and its architecture is this run's. Returns notes (see
    ``compare_architecture``); nothing to check without --load or a checkpoint in it."""
    if not load_dir or not os.path.isdir(load_dir):
        return []
    path = _resolve(load_dir, iteration)
    if path is None:
        return []
    common = _read_common(path)
    notes = compare_architecture(common.get("run_config") or {}, run_config, path)
    ck = run_config["checkpoint"]
    if common.get("has_optimizer", False) and not (ck["no_load_optim"] or ck["finetune"]):
        compare_optimizer_groups(common.get("run_config") or {}, run_config, path)
    return notes


def apply_checkpoint_args(cfg) -> list[str]:
    """--use-checkpoint-args: set ``cfg``'s architecture flags (``ARCHITECTURE``, the loop count
    and the exit objective) to the values the checkpoint in --load was saved with; returns the flags that changed. Nothing happens when
    --load holds no checkpoint yet (a fresh run keeps its flags). No process group needed."""
    ck = cfg.checkpoint
    if not ck.load or not os.path.isdir(ck.load) or _resolve(ck.load, ck.ckpt_step) is None:
        return []
    saved = read_run_config(ck.load, ck.ckpt_step)
    changed = []
    # The loop count and objective too (they decide whether the model has an exit gate), as
    # Megatron-LM's flag takes every model argument.
    taken = {**ARCHITECTURE, "loop": ARCHITECTURE["loop"] + ("num_loops", "exit_loss")}
    for section, names in taken.items():
        target = getattr(cfg, section)
        for name in names:
            if name in saved.get(section, {}) and saved[section][name] != getattr(target, name):
                setattr(target, name, saved[section][name])
                changed.append(f"--{name.replace('_', '-')} {saved[section][name]}")
    return changed


def read_run_config(load_dir: str, iteration: Optional[int] = None) -> dict:
    """The RunConfig (as a dict) a checkpoint was saved with; no process group needed."""
    path = _resolve(load_dir, iteration)
    if path is None:
        raise FileNotFoundError(f"no checkpoint in {load_dir} (no {TRACKER})")
    return _read_common(path)["run_config"]


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
    path = _resolve(load_dir, iteration) if os.path.isdir(load_dir) else None
    if path is None:
        return None
    common = _read_common(path)
    notes = []
    if run_config is not None:
        notes = compare_architecture(common.get("run_config") or {}, run_config, path)
    if verify:
        if not os.path.isfile(os.path.join(path, MANIFEST)):
            notes.append(f"> {path} has no checksum manifest (saved without --ckpt-checksums or "
                         "by an older megaloop): its files are not verified")
        problems = _verify_manifest(path)
        if problems:
            raise CheckpointError(_unreadable(path, problems))
    module = unwrap(model)
    if finetune:
        load_optim = load_rng = False
    # A converted checkpoint has weights only: the optimizer then starts fresh.
    load_optim = load_optim and optimizer is not None and common.get("has_optimizer", False)
    # RNG streams belong to (PP, TP) positions: another layout has other streams.
    same_layout = {k: common["layout"][k] for k in ("tp", "pp")} == \
        {k: _layout()[k] for k in ("tp", "pp")}
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
    _compare_shapes(state["model"], path)
    error = loaded = None
    try:
        loaded = dist_checkpointing.load(state, path)
    except _READ_WRITE_ERRORS as exc:  # a shard cut short or missing: megatron-core's chain
        error = exc
    failures = _agree(error)
    if failures:
        raise CheckpointError(_unreadable(path, failures))
    module.load_state_dict(loaded["model"], strict=True)
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


def _compare_shapes(model_state: dict, path: str) -> None:
    """The checkpoint's tensor shapes (its .metadata, read by every rank alike) against this
    model's, before torch's reader meets them (``compare_tensor_shapes``)."""
    # (allow_shape_mismatch: megatron-core's vocabulary-padded embedding and output layer,
    # whose padding follows the TP size and which it loads across paddings.)
    expected = {t.key: t.global_shape for t in nested_values(model_state)
                if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch}
    try:
        saved = {k: v.global_shape for k, v in
                 dist_checkpointing.load_tensors_metadata(path).items()}
    except _READ_WRITE_ERRORS:
        return  # unreadable metadata: the load names the file
    compare_tensor_shapes(expected, saved, path)


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
