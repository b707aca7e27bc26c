"""--async-save: megatron-core's asynchronous dist-checkpointing (torch_dist) with megaloop's
guarantees kept.

What blocks the training loop is megatron-core's synchronous part of ``dist_checkpointing.save``
(planning, the common state, the copy of device tensors to the host) and a fork; a forked
process per rank then writes the shards (``AsyncCallsQueue``, its non-persistent caller) while
training goes on. The checkpoint becomes visible only in the finalisation, which runs once every
rank's writer has finished (``maybe_finalize``, a collective the trainer calls after every step
while a save is pending): megatron-core's metadata, then the checksum manifest, then the rename
of ``iter_N.tmp`` to ``iter_N`` and ``latest_checkpointed_iteration.txt``. So:

- ``latest`` never names a save that is not finalised on every rank;
- a crash (kill -9) during an async save leaves ``iter_N.tmp`` (removed at the next start) and
  the previous checkpoint named in ``latest``;
- the end of training, and a SIGTERM exit, wait for the pending save (``finalize_all``);
- each rank's writer hashes the files it wrote right after writing them, off the training
  path; the finalisation adds the few small files megatron-core writes itself (metadata).

One save is in flight at a time: scheduling a save first finalises the previous one (it has had
a whole save interval to finish).

A writer that fails (disk full, quota, I/O error) is found in the finalisation, where megatron-core
raises torch DCP's CheckpointException on every rank: it becomes the synchronous save's
CheckpointError (megaloop.checkpoint.save.fail_save_if_any: the partial ``iter_N.tmp`` removed,
one message saying the disk is full and which checkpoint ``latest`` still names), and the run
stops as after a failed synchronous save.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import multiprocessing.queues  # noqa: F401  (mp.queues.Queue below)
import os
import time
from typing import Callable, Optional

import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

from megaloop.checkpoint.errors import CheckpointError
from megaloop.checkpoint.format import READ_WRITE_ERRORS
from megaloop.checkpoint.manifest import sha256
from megaloop.checkpoint.save import fail_save_if_any

SIDECAR = ".megaloop_sha256_rank{rank}.json"  # a writer's hashes; folded into the manifest


def checkpoint_save_strategy(fully_parallel: bool, assume_constant_structure: bool):
    """megatron-core's torch_dist save strategy as Megatron-LM builds it from
    --ckpt-fully-parallel-save and --ckpt-assume-constant-structure (one object per run: the
    cached plan lives in it)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper)

    strategy = get_default_save_sharded_strategy()
    strategy.use_cached_ckpt_structure = assume_constant_structure
    if fully_parallel:
        strategy = FullyParallelSaveStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True),
            assume_constant_structure)
    return strategy


def _hashing_writer(write_fn: Callable, rank: int, tmp: str, checksums: bool) -> Callable:
    """``write_fn`` (megatron-core's writer, run in the forked process), then the SHA-256 of the
    files it wrote, into this rank's sidecar in ``tmp``."""

    def write(*args, **kwargs):
        write_fn(*args, **kwargs)
        if checksums:
            buckets = args[1]  # megatron-core's write buckets: (path, file name, data)
            try:
                hashes = {os.path.relpath(path, tmp): [os.path.getsize(path), sha256(path)]
                          for path, _, _ in buckets}
                with open(os.path.join(tmp, SIDECAR.format(rank=rank)), "w") as f:
                    json.dump(hashes, f)
            except OSError:
                # A shard the write did not finish (disk full): megatron-core hands that error
                # to the finalisation, which reports it and removes the folder. Had the write
                # succeeded, the finalisation hashes what no sidecar covers.
                pass

    return write


class AsyncSaver:
    """The trainer's pending asynchronous saves (at most one); every method is collective."""

    def __init__(self):
        self.queue = AsyncCallsQueue(persistent=False)
        # (iteration, final path, start time, the folder being written)
        self.pending: Optional[tuple[int, str, float, str]] = None
        # The writer's results travel from the forked writer back to this process: a fork-context
        # queue (megatron-core's default, a spawn-context Manager, starts a server process that
        # re-imports __main__; megaloop's synchronous path uses an in-process queue).
        if not isinstance(filesystem_async._results_queue, mp.queues.Queue):
            filesystem_async._results_queue = mp.get_context("fork").Queue()

    def schedule(self, request, iteration: int, tmp: str, final: str, checksums: bool,
                 publish: Callable[[], None]) -> None:
        """Start writing ``request`` (megatron-core's AsyncRequest for ``tmp``); ``publish`` (the
        manifest from the writers' hashes, the rename, the tracker) runs in the finalisation,
        after megatron-core's own finalisation (its metadata)."""
        self.finalize_all()
        rank = torch.distributed.get_rank()
        if request.async_fn is not None:
            request = request._replace(async_fn=_hashing_writer(request.async_fn, rank, tmp,
                                                                 checksums))

        request.add_finalize_fn(publish)
        self.queue.schedule_async_request(request)
        self.pending = (iteration, final, time.time(), tmp)

    def maybe_finalize(self, blocking: bool = False) -> Optional[tuple[int, str, float]]:
        """Finalise the pending save if every rank's writer is done (or wait for it with
        ``blocking``); returns (iteration, path, seconds since scheduled) when one was
        finalised. No collective when nothing is pending (the same on every rank)."""
        if self.pending is None:
            return None
        iteration, final, start, tmp = self.pending
        try:
            if not self.queue.maybe_finalize_async_calls(blocking=blocking):
                return None
        except CheckpointError:  # the publication's own (already agreed, .tmp removed)
            self.pending = None
            raise
        except READ_WRITE_ERRORS as exc:  # a writer failed: megatron-core raises on every rank
            self.pending = None
            fail_save_if_any(exc, os.path.dirname(final), iteration, tmp)
            raise  # (not reached: every rank has a failure, so the line above raised)
        self.pending = None
        return iteration, final, time.time() - start

    def finalize_all(self) -> Optional[tuple[int, str, float]]:
        return self.maybe_finalize(blocking=True)

    def close(self) -> None:
        self.queue.close()


def collect_sidecars(tmp: str) -> Optional[dict]:
    """Rank 0: the writers' hashes (relpath -> [size, sha256]), sidecars removed; None on
    other ranks."""
    if torch.distributed.get_rank() != 0:
        return None
    hashes = {}
    for name in sorted(os.listdir(tmp)):
        if name.startswith(".megaloop_sha256_rank"):
            with open(os.path.join(tmp, name)) as f:
                hashes.update(json.load(f))
            os.remove(os.path.join(tmp, name))
    return hashes
