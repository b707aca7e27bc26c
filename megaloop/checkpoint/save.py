"""Writing a checkpoint folder so that ``latest`` only ever names a complete, finite one.

Every rank writes into ``iter_XXXXXXX.tmp``; only after all ranks have finished (and the
manifest is written) does rank 0 rename it to ``iter_XXXXXXX`` and replace the tracker (write +
``os.replace``). A run killed at any moment of a save leaves the previous checkpoint named in
the tracker intact; the stale ``.tmp`` folder is ignored by loads and removed by the next run
(``tracker.remove_stale_saves``). A diverged model (a parameter not finite) is never written.
A save that fails (disk full: said so, with the free bytes) removes its ``.tmp`` and says which
checkpoint the tracker still names. Each failure is one ``CheckpointError`` on every rank.

``write_shards`` + ``publish`` are the two halves (the trainer's asynchronous save runs the
second later, megaloop.training.async_checkpointing); ``save_weights`` is both at once for a
model without optimizer state (a converted checkpoint).
"""

from __future__ import annotations

import errno
import functools
import os
import queue
import re
import shutil
from typing import Callable, Optional

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from torch.distributed.checkpoint.api import CheckpointException

from megaloop.checkpoint.errors import CheckpointError
from megaloop.checkpoint.format import READ_WRITE_ERRORS, agree, common_state, unwrap
from megaloop.checkpoint.manifest import write_manifest, write_manifest_from
from megaloop.checkpoint.tracker import TRACKER, checkpoint_dir, read_tracker, write_tracker
from megaloop.compat import (async_save_options, common_state_inside_shards, keep_writer_errors,
                             write_common_file)


def check_finite_parameters(module, iteration: int, save_dir: str) -> None:
    """Collective: refuse to save weights that hold NaN or infinity (the run diverged)."""
    bad = next((name for name, p in module.named_parameters()
                if not torch.isfinite(p.detach()).all()), None)
    failures = agree(None if bad is None else FloatingPointError(f"parameter {bad}"))
    if failures:
        latest = read_tracker(save_dir) if os.path.isdir(save_dir) else None
        raise CheckpointError(
            f"not saving iteration {iteration}: parameters are not finite ({failures}); the run "
            f"has diverged. {TRACKER} in {save_dir} still names "
            f"{'no checkpoint' if latest is None else f'iteration {latest}'}: resume from there "
            "with a lower --lr or a longer --lr-warmup-iters, and keep "
            "--check-for-nan-in-loss-and-grad on (it skips non-finite steps)")


def _use_in_process_results_queue() -> None:
    """megatron-core's torch_dist writer hands its results back through a queue it creates
    from a *spawn*-context Manager: a server process that re-imports ``__main__`` (a script
    without a main guard hangs), costs seconds to start, and outlives a rank that exits with
    ``os._exit`` (holding its stdout open). A synchronous save runs the writer in the calling
    process, so a plain in-process queue carries the same results."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def write_shards(save_dir: str, iteration: int, module, state: dict, *, strategy=None,
                 asynchronous: bool = False):
    """Collective: the first half of a save. ``state``: megatron-core's sharded state dict plus
    the common entries (``format.common_state``); ``module``: the model whose parameters must
    be finite. Returns ``(tmp, final, request)``: the folder written, the name it will be
    published under, and megatron-core's AsyncRequest when ``asynchronous`` (else None, the
    shards are on disk on every rank). ``strategy``: megatron-core's save strategy, its
    default torch_dist one if None."""
    check_finite_parameters(module, iteration, save_dir)
    final = checkpoint_dir(save_dir, iteration)
    tmp = final + ".tmp"
    error = None
    if torch.distributed.get_rank() == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            if os.path.isdir(tmp):  # left behind by a run killed while saving this iteration
                shutil.rmtree(tmp)
            os.makedirs(tmp)
        except OSError as exc:
            error = exc
    fail_save_if_any(error, save_dir, iteration, tmp)
    if not asynchronous:
        _use_in_process_results_queue()
    keep_writer_errors()  # (before the save forks its writer: the fork inherits it)
    _keep_write_errno()
    request = None
    try:
        request = dist_checkpointing.save(state, tmp,
                                          sharded_strategy=strategy
                                          or get_default_save_sharded_strategy(),
                                          async_sharded_save=asynchronous,
                                          **(async_save_options() if asynchronous else {}))
        if common_state_inside_shards() and torch.distributed.get_rank() == 0:
            write_common_file(state, tmp)  # readable by megatron-core 0.16 too
    except READ_WRITE_ERRORS as exc:  # disk full, quota, I/O error: every rank reports below
        error = exc
    # (the agreement is also the barrier: every rank's shards are on disk before going on)
    fail_save_if_any(error, save_dir, iteration, tmp)
    return tmp, final, request


def publish(save_dir: str, iteration: int, tmp: str, final: str, *, checksums: bool = True,
            writer_hashes: Optional[Callable[[str], Optional[dict]]] = None) -> None:
    """Collective: the second half of a save: the manifest (``checksums``), then rank 0
    renames the complete ``tmp`` to ``final`` and names it in the tracker (a crash before
    that leaves the previous checkpoint). ``writer_hashes(tmp)``: on rank 0, the hashes the
    asynchronous writers took (the manifest then hashes only the rest); None: every rank
    hashes a share now."""
    if checksums:
        error = None
        try:
            if writer_hashes is None:
                write_manifest(tmp)
            else:
                write_manifest_from(tmp, writer_hashes(tmp))
        except (OSError, ValueError) as exc:
            error = exc
        fail_save_if_any(error, save_dir, iteration, tmp)
    error = None
    if torch.distributed.get_rank() == 0:
        try:
            old = final + ".old"
            if os.path.isdir(final):  # saving the same iteration again: keep it until replaced
                os.rename(final, old)
            os.rename(tmp, final)
            if os.path.isdir(old):
                shutil.rmtree(old)
            write_tracker(save_dir, iteration)
        except OSError as exc:
            error = exc
    fail_save_if_any(error, save_dir, iteration, tmp)


def save_weights(save_dir: str, iteration: int, model, *, run_config: dict,
                 checksums: bool = True) -> str:
    """Collective: a checkpoint of ``model``'s weights only (no optimizer state, no RNG
    streams; a run loading it starts both afresh). Returns the published folder."""
    module = unwrap(model)
    state = {"model": module.sharded_state_dict(), **common_state(iteration, run_config)}
    tmp, final, _ = write_shards(save_dir, iteration, module, state)
    publish(save_dir, iteration, tmp, final, checksums=checksums)
    return final


def _keep_write_errno() -> None:
    """Make a shard write that fails in the file system raise the OSError itself (its errno).

    torch.save into a file whose write fails (ENOSPC on a full disk) raises torch's
    RuntimeError("[enforce fail at inline_container.cc:...] unexpected pos ..."), with the
    OSError only as its ``__context__``; megatron-core's writer processes send that exception
    back pickled, which drops the context, so a full disk read as "unexpected pos" and
    ``_disk_full`` could not tell. Installed once, before the save forks its writers (they
    inherit it); megatron-core looks ``_write_item`` up in its module at each call."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    write_item = filesystem_async._write_item
    if getattr(write_item, "keeps_errno", False):
        return

    @functools.wraps(write_item)  # megatron-core inspects its signature
    def write_keeping_errno(*args, **kwargs):
        try:
            return write_item(*args, **kwargs)
        except OSError:
            raise
        except Exception as exc:
            cause, seen = exc.__cause__ or exc.__context__, set()
            while cause is not None and id(cause) not in seen and \
                    not (isinstance(cause, OSError) and cause.errno):
                seen.add(id(cause))  # (a chain made with ``raise ... from`` may loop)
                cause = cause.__cause__ or cause.__context__
            if not isinstance(cause, OSError):
                raise
            raise OSError(cause.errno, cause.strerror, cause.filename) from exc

    write_keeping_errno.keeps_errno = True
    filesystem_async._write_item = write_keeping_errno


def _disk_full(error: Optional[BaseException], save_dir: str) -> Optional[BaseException]:
    """A failure that is (or wraps, as torch DCP's writer does) running out of disk space or
    quota, restated to say so with the free bytes of ``save_dir``'s file system; else ``error``."""
    inner = [error] + ([e for e, _ in error.failures.values()]
                       if isinstance(error, CheckpointException) else [])
    for exc in inner:
        while exc is not None:
            code = _errno(exc)
            if code in (errno.ENOSPC, errno.EDQUOT):
                try:
                    free = f"{shutil.disk_usage(save_dir).free:,} bytes free"
                except OSError:
                    free = "free space unknown"
                what = "the disk is full" if code == errno.ENOSPC else \
                    "the disk quota is exceeded"
                return OSError(code, f"{what}: {free} on the file system of {save_dir} "
                                     f"({os.strerror(code)})")
            exc = exc.__cause__ or exc.__context__
    return error


def _errno(exc: BaseException) -> Optional[int]:
    """The errno of an OSError, or of the one megatron-core's writer reported: its worker
    processes send the OSError back, megatron-core wraps it in a RuntimeError("Worker failure:
    [Errno 28] ...") and torch DCP gathers the ranks' failures with pickle, which drops
    ``__cause__``; so the errno survives only in the message, in Python's own OSError format."""
    if isinstance(exc, OSError):
        return exc.errno
    match = re.search(r"\[Errno (\d+)\]", str(exc))
    return int(match.group(1)) if match else None


def fail_save_if_any(error, save_dir: str, iteration: int, tmp: str) -> None:
    """Collective: when any rank's part of the save failed, rank 0 removes the partial folder and
    every rank raises the same CheckpointError."""
    failures = agree(_disk_full(error, save_dir))
    if failures is None:
        return
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    torch.distributed.barrier()
    try:
        latest = read_tracker(save_dir)
    except CheckpointError:
        latest = None
    raise CheckpointError(
        f"saving iteration {iteration} to {save_dir} failed ({failures}); removed the partial "
        f"{tmp}. {TRACKER} still names "
        f"{'no checkpoint' if latest is None else f'iteration {latest}'}: free space or fix the "
        f"folder, then resume from it with --load {save_dir}")
