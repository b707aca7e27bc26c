"""Every tensor-parallel rank steps the same batch: rank 0 decides, the others follow.

Under tensor parallelism each rank holds a slice of the model, and a forward's collectives need
every rank inside the same forward with the same rows. The batching engine
(megaloop/inference/engine.py) is deterministic given the history of what was added and
cancelled before each ``step()`` (each request samples from its own generator seeded by its
parameters; the logits are gathered before sampling), so ranks that apply the same commands in
the same order before every step stay in lockstep without any other exchange.

Rank 0, the only rank that serves HTTP, collects each step's commands (``Add``: a row with its
prompt, sampling parameters and seed, and what its per-token hook needs; ``Cancel``; ``Score``: a
prompt's teacher-forced log-probs, one full forward; ``Stop``: shut down) and broadcasts them to
the tensor-parallel group before the step; every rank applies them in that order, then steps
when the engine has work. A per-token hook (stop strings) must answer the same on every rank:
it is built on each rank from the command's payload by the same function.

Nothing hangs: after each step the ranks agree whether any of them failed (one small
all-reduce), so an exception on any rank fails the step on every rank, which then starts a
fresh engine (the failed one's state is unknown); rank 0 fails the requests that were in it.
That is for what cannot be pinned on one row (a forward, a score). What can fails that row only,
on every rank alike: a row the engine refuses to add, or whose sampling or per-token hook raised
on one rank (that rank's engine cancels it), is reported by its rank in the same agreement
exchange and cancelled on all; the other rows decode on.
While there is no work rank 0 broadcasts an empty command list every ``KEEPALIVE_S`` seconds,
so that the followers' wait stays inside the collectives' timeout. At TP=1 there is no
exchange at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

log = logging.getLogger("megaloop.serve")

KEEPALIVE_S = 5.0  # far inside the process group's timeout (--distributed-timeout-minutes)


@dataclass
class Add:
    """A row to decode: the engine's ``add`` arguments, and ``payload`` for the hook factory."""

    key: int
    prompt: list
    max_tokens: int
    params: Any  # SamplingParams (its seed: the same draws on every rank)
    record_logprobs: bool = False
    ignore_eos: bool = False
    payload: Any = None


@dataclass
class Cancel:
    key: int


@dataclass
class Score:
    """The teacher-forced log-probs of a prompt (a full forward: a collective under TP)."""

    key: int
    prompt: list


@dataclass
class Stop:
    pass


class StepFailed(RuntimeError):
    """A step failed on some rank; every rank has started a fresh engine."""


class Lockstep:
    """The engine of this rank, driven by rank 0's commands (``step`` on rank 0, ``follow`` on
    the others).

    ``new_engine()`` builds an engine (again after a failed step); ``make_hook(add)`` returns the
    ``on_token`` of an added row (or None), built alike on every rank; ``score(prompt)`` runs the
    forward of a ``Score`` command."""

    def __init__(self, new_engine: Callable, make_hook: Callable[[Add], Optional[Callable]],
                 score: Callable[[list], Any]):
        from megatron.core import parallel_state

        self.new_engine, self.make_hook, self.score = new_engine, make_hook, score
        self.engine = new_engine()
        self.requests: dict = {}  # key -> the engine's Request, on every rank
        self.size = parallel_state.get_tensor_model_parallel_world_size()
        self.rank = parallel_state.get_tensor_model_parallel_rank()
        if self.size > 1:
            self.group = parallel_state.get_tensor_model_parallel_group()
            self.src = parallel_state.get_tensor_model_parallel_src_rank()
        self.stopped = False

    # --- rank 0 -------------------------------------------------------------------------------
    def step(self, commands: list) -> tuple[list, dict, dict]:
        """Broadcast ``commands``, apply them, step: (the (key, Request) pairs that finished in
        this step, {key: score} of its Score commands, {key: message} of the rows whose hook
        raised on some rank: cancelled on every rank). StepFailed when any rank failed."""
        assert self.rank == 0, "only rank 0 decides the commands"
        if self.size > 1:
            commands = self._broadcast(commands)
        return self._run(commands)

    def close(self) -> None:
        """Rank 0: tell the followers to stop (once; a follower already gone is only logged)."""
        if self.stopped or self.size == 1:
            self.stopped = True
            return
        self.stopped = True
        try:
            self._broadcast([Stop()])
        except Exception as exc:  # a follower died: torchrun ends the others
            log.error("could not tell the other tensor-parallel ranks to stop: %s", exc)

    # --- the other ranks ----------------------------------------------------------------------
    def follow(self) -> None:
        """Apply rank 0's commands and step, until its Stop. A failed step is survived (every
        rank failed it and starts afresh); a failed broadcast (rank 0 gone) raises."""
        assert self.rank != 0
        while True:
            commands = self._broadcast(None)
            if any(isinstance(c, Stop) for c in commands):
                self.stopped = True
                return
            try:
                self._run(commands)
            except StepFailed as exc:
                log.error("tensor-parallel rank %d: %s", self.rank, exc)

    # --- every rank ---------------------------------------------------------------------------
    def _broadcast(self, commands: Optional[list]) -> list:
        from megaloop.device import current_device

        box = [commands]
        torch.distributed.broadcast_object_list(box, src=self.src, group=self.group,
                                                device=current_device())
        return box[0]

    def _run(self, commands: list) -> tuple[list, dict, dict]:
        finished, scores, error, refused = [], {}, None, {}
        try:
            for c in commands:
                if isinstance(c, Add):
                    # A row the engine refuses (a value no check before it caught) fails alone;
                    # the refusal depends only on the command, which every rank applies.
                    try:
                        self.requests[c.key] = self.engine.add(
                            c.prompt, c.max_tokens, c.params, on_token=self.make_hook(c),
                            record_logprobs=c.record_logprobs, ignore_eos=c.ignore_eos)
                    except Exception as exc:
                        refused[c.key] = f"{type(exc).__name__}: {exc}"
                elif isinstance(c, Cancel):  # (its rows are freed at this step)
                    if c.key in self.requests:
                        self.engine.cancel(self.requests.pop(c.key))
                elif isinstance(c, Score):
                    scores[c.key] = self.score(c.prompt)
            if self.engine.has_work():
                done = {id(r) for r in self.engine.step()}
                finished = [(k, r) for k, r in self.requests.items() if id(r) in done]
                for k, _ in finished:
                    del self.requests[k]
        except Exception as exc:
            error = exc
        # A row whose hook or sampling raised was cancelled by this rank's engine; the others
        # must cancel it too (it is freed at their next step, before anything else happens in
        # it). A refused row is in no engine: the others cancel theirs, should one have taken it.
        errors = {k: f"{type(r.error).__name__}: {r.error}" for k, r in finished
                  if getattr(r, "error", None) is not None}
        errors.update(refused)
        errors = self._agree(error, errors)
        for k in errors:
            if k in self.requests:
                self.engine.cancel(self.requests.pop(k))
        return [(k, r) for k, r in finished if k not in errors], scores, errors

    def _agree(self, error: Optional[Exception], errors: dict) -> dict:
        """Every rank learns whether any failed, and which rows' hooks raised (the same
        collectives on every rank): the rows' {key: message} of all ranks. On a failed step
        each rank starts a fresh engine and raises StepFailed with the ranks' messages."""
        failed = error is not None
        messages = [f"{type(error).__name__}: {error}"] if failed else []
        if self.size > 1:
            from megaloop.device import current_device

            flag = torch.tensor([int(failed or bool(errors))], device=current_device())
            torch.distributed.all_reduce(flag, group=self.group)
            if flag.item():
                everyone = [None] * self.size
                torch.distributed.all_gather_object(everyone, (messages, errors),
                                                    group=self.group)
                messages = [f"rank {r}: {m}" for r, (ms, _) in enumerate(everyone) for m in ms]
                errors = {}
                for r, (_, rows) in enumerate(everyone):
                    for k, m in rows.items():
                        errors.setdefault(k, f"rank {r}: {m}")
                failed = bool(messages)
        if not failed:
            return errors
        self.engine, self.requests = self.new_engine(), {}
        raise StepFailed("a step failed (" + "; ".join(messages) + "); its requests are "
                         "dropped and a fresh engine serves the next ones") from error
