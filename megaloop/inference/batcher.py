"""The server's model thread: every row of every job decoded together by the batching engine.

A job (megaloop/inference/jobs.py) is one request's rows: each prompt ``n`` times. The model
thread loops: it takes the jobs submitted since the last step and the cancellations (a client
that left), turns them into engine commands (an add per row, with its own seed; a cancel per
unfinished row; a score per prompt whose log-probs are echoed), runs one engine step on every
tensor-parallel rank (megaloop/inference/lockstep.py), and hands the tokens back: each row's
per-token hook (``Row.on_token``) reads its text, stops it at a stop string and streams it; a job
whose rows have all finished gets its result. It waits for work only when there is none.

The engine's requests do not depend on what else is in the batch (each samples from its own
generator), so a request answers the same alone or among others. Row ``i`` of a job samples
from ``row_seed(seed, i)``: the job's seed for its first row, a seed derived from both for the
others (``n`` samples of one prompt differ; the same seed gives the same choices).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import itertools
import logging
import queue
import time
from typing import Callable, Optional

import torch

from megaloop.inference.lockstep import KEEPALIVE_S, Add, Cancel, Lockstep, Score, StepFailed

log = logging.getLogger("megaloop.serve")


class Cancelled(Exception):
    """The job's client has left: its rows were cancelled (freed at the next engine step)."""


def row_seed(seed: int, i: int) -> int:
    """The sampling seed of row ``i`` of a request seeded with ``seed``."""
    if i == 0:
        return seed
    digest = hashlib.sha256(f"{seed}/{i}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # torch takes seeds below 2**63


class Row:
    """One row (a choice of one prompt) as the engine decodes it: its generated ids, its text
    (up to a stop string) and finish reason, and, streaming, what was sent. Built alike on every
    tensor-parallel rank, so that ``on_token``'s answer (stop here or not) is the same on all."""

    def __init__(self, tokenizer, prompt: list, max_tokens: int, stop: list, eod: Optional[int],
                 emit: Optional[Callable] = None):
        self.tokenizer, self.prompt, self.max_tokens, self.stop = tokenizer, prompt, max_tokens, stop
        self.eod = eod  # None with ignore_eos: the end-of-document token is a token as others
        self.emit = emit  # emit(text, finish or None): a streaming job's row, on rank 0
        self.out: list = []  # generated ids (EOD included)
        self.text = ""  # the answer (ending before a stop string), once finished
        self.finish: Optional[str] = None  # "stop" | "length" | "cancelled"
        self.cut: Optional[int] = None  # where a stop string cut the text (characters)
        self.sent = ""  # streamed so far
        self._prompt_text: Optional[str] = None  # the prompt detokenized, once

    def on_token(self, request, token: int) -> bool:
        """The engine's per-token hook: True ends the row (its text now holds a stop string)."""
        self.out.append(token)
        ended = token == self.eod or len(self.out) >= self.max_tokens
        if not (ended or self.stop or self.emit):
            return False  # nothing reads the text before the row ends
        text = self._text()
        cut = min((at for at in (text.find(s) for s in self.stop) if at >= 0), default=-1)
        if cut >= 0:
            text, ended, self.cut = text[:cut], True, cut
        if ended:
            self.text = text
            self.finish = "length" if cut < 0 and token != self.eod else "stop"
        self._stream(text, ended)
        return cut >= 0

    def close(self, finish: str) -> None:
        """The engine finished the row (``finish``: its reason) without the hook seeing its end
        (e.g. at the model's context)."""
        if self.finish is None:
            self.text, self.finish = self._text(), finish
            self._stream(self.text, True)

    def _text(self) -> str:
        from megaloop.inference.generate import continuation_text

        ids = self.out[:-1] if self.out and self.out[-1] == self.eod else self.out
        if not ids:
            return ""
        if self._prompt_text is None:  # (once per row, not once per token)
            self._prompt_text = self.tokenizer.detokenize(self.prompt)
        return continuation_text(self.tokenizer, self.prompt, ids, self._prompt_text)

    def _stream(self, text: str, ended: bool) -> None:
        if self.emit is None:
            return
        shown = text
        if not ended:
            # Held back: what may still turn out to be the start of a stop string, and an
            # incomplete character (a byte piece decodes to U+FFFD until its last byte).
            shown = text[:max(0, len(text) - max((len(s) for s in self.stop), default=1)
                              + 1)].rstrip("\ufffd")
        delta = shown[len(self.sent):] if shown.startswith(self.sent) else ""
        if delta or ended:
            self.sent += delta
            self.emit(delta, self.finish if ended else None)


class JobRunner:
    """Runs jobs on the thread that calls ``run_jobs`` (rank 0's model thread), or, on another
    tensor-parallel rank, follows rank 0 (``follow``). ``new_engine()`` builds the batching
    engine; ``score(prompt)`` gives a prompt's teacher-forced log-prob rows."""

    def __init__(self, tokenizer, new_engine: Callable, score: Callable):
        self.tokenizer, self.eod = tokenizer, tokenizer.eod
        self.lockstep = Lockstep(new_engine, self._hook, score)
        self._queue: queue.Queue = queue.Queue()
        self._keys = itertools.count()
        self._rows: dict = {}  # key -> (job, row index) of a row in the engine
        self._scores: dict = {}  # key -> (job, prompt index) of a Score command
        self._active: list = []  # jobs started and not finished
        self.serving = False  # the model thread takes jobs (GET /health)
        self.restarts = 0  # engines dropped after a failed step
        # The engine's counters after its last step (GET /stats).
        self.stats: dict = {**self.lockstep.engine.stats, "engine_restarts": 0}

    def submit(self, job) -> concurrent.futures.Future:
        """Queue ``job``; its future gets (the generated tokens' log-prob rows, the prompts'
        log-prob rows) per row, or Cancelled. Cancel it (not yet started) or set
        ``job.cancelled`` (running) when the client leaves."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, job))
        return future

    # --- rank 0's model thread ------------------------------------------------------------------
    def run_jobs(self, keep_going: Callable[[], bool]) -> None:
        """Decode every job's rows together while ``keep_going()``; then stop the followers and
        fail what is left."""
        self.serving, last = True, time.monotonic()
        try:
            while keep_going():
                engine = self.lockstep.engine
                commands = self._take(wait=not engine.has_work())
                commands += self._cancels()
                if not commands and not engine.has_work():
                    self._collect([], {}, {})  # jobs of max_tokens 0 without echo
                    if self.lockstep.size == 1 or time.monotonic() - last < KEEPALIVE_S:
                        continue
                last = time.monotonic()
                try:
                    finished, scores, errors = self.lockstep.step(commands)
                except StepFailed as exc:
                    log.error("%s", exc)
                    self._fail_all(exc)
                    self.restarts += 1
                    finished, scores, errors = [], {}, {}
                self._collect(finished, scores, errors)
                # The engine that stepped, or the fresh one that replaced a failed one: never
                # the dropped engine's counters.
                self.stats = {**self.lockstep.engine.stats, "engine_restarts": self.restarts}
        finally:
            self.serving = False
            self.lockstep.close()
            self._fail_all(RuntimeError("the server is shutting down"))

    def follow(self) -> None:
        """Another tensor-parallel rank: step as rank 0 says until it stops."""
        self.lockstep.follow()

    def _take(self, wait: bool) -> list:
        """Commands for the jobs submitted since the last call (waiting up to 0.1 s for one)."""
        items = []
        try:
            items.append(self._queue.get(timeout=0.1) if wait else self._queue.get_nowait())
            while True:
                items.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        commands = []
        for future, job in items:
            if not future.set_running_or_notify_cancel():  # its client left while it waited
                continue
            try:
                commands += self._start(future, job)
            except Exception as exc:  # that job fails alone (before any rank saw its rows)
                log.exception("could not start a job")
                self._drop(job)
                future.set_exception(exc)
        return commands

    def _drop(self, job) -> None:
        """Forget a job's rows and scores (none of them was sent to the engine)."""
        for key in job.keys:
            self._rows.pop(key, None)
        for key in [k for k, (j, _) in self._scores.items() if j is job]:
            del self._scores[key]
        if job in self._active:
            self._active.remove(job)

    def _start(self, future, job) -> list:
        job.future, job.state, commands = future, [], []
        for i, prompt in enumerate(job.rows):
            emit = None if job.emit is None else \
                (lambda text, finish, i=i: job.emit(i, text, finish))
            row = Row(self.tokenizer, prompt, job.max_tokens, job.stop,
                      None if job.ignore_eos else self.eod, emit)
            job.state.append(row)
            if job.max_tokens == 0:
                row.finish = "length"
                row._stream("", True)
                continue
            key = next(self._keys)
            self._rows[key] = (job, i)
            job.keys.append(key)
            commands.append(Add(key, prompt, job.max_tokens,
                                dataclasses.replace(job.params, seed=row_seed(job.params.seed, i)),
                                record_logprobs=job.logprobs is not None,
                                ignore_eos=job.ignore_eos, payload=job.stop))
        if job.echo and job.logprobs is not None:
            for p, prompt in enumerate(job.prompts):
                key = next(self._keys)
                self._scores[key] = (job, p)
                commands.append(Score(key, prompt))
        self._active.append(job)
        return commands

    def _hook(self, add: Add):
        """An added row's per-token hook: its job's Row on rank 0, the same Row rebuilt from the
        command elsewhere."""
        if add.key in self._rows:
            job, i = self._rows[add.key]
            return job.state[i].on_token
        return Row(self.tokenizer, add.prompt, add.max_tokens, add.payload,
                   None if add.ignore_eos else self.eod).on_token

    def _cancels(self) -> list:
        """Cancel commands for the rows of jobs whose client left or whose row failed; those
        jobs end now."""
        commands = []
        for job in [j for j in self._active if j.cancelled.is_set() or j.error is not None]:
            for key in job.keys:
                if self._rows.pop(key, None) is not None:
                    commands.append(Cancel(key))
            self._active.remove(job)
            if job.error is not None:
                log.error("%s", job.error)
                job.future.set_exception(job.error)
                continue
            log.info("job cancelled (its client left) after %d of at most %d tokens",
                     sum(len(r.out) for r in job.state), len(job.rows) * job.max_tokens)
            job.future.set_exception(Cancelled())
        return commands

    def _collect(self, finished: list, scores: dict, errors: dict) -> None:
        for key, message in errors.items():
            if key in self._rows:
                job, i = self._rows.pop(key)
                job.error = RuntimeError(f"generation failed in row {i}: {message}")
        for key, request in finished:
            if key not in self._rows:
                continue  # its job was cancelled
            job, i = self._rows.pop(key)
            job.state[i].close(request.finish)
            job.requests[i] = request
        for key, value in scores.items():
            job, p = self._scores.pop(key)
            job.prompt_scores[p] = value
        for job in [j for j in self._active if self._done(j)]:
            self._active.remove(job)
            try:
                self._finish(job)
            except Exception as exc:  # building one job's result failed: that job alone
                log.exception("could not finish a job")
                job.future.set_exception(exc)

    def _done(self, job) -> bool:
        return job.error is None and all(k not in self._rows for k in job.keys) and \
            not any(j is job for j, _ in self._scores.values())

    def _finish(self, job) -> None:
        rows = [None] * len(job.rows)
        for i, request in job.requests.items():
            job.depths += list(request.depths)
            if job.logprobs is not None and job.state[i].out:
                rows[i] = torch.stack(request.logprobs[:len(job.state[i].out)])
        prompt_rows = [job.prompt_scores.get(i // job.n) for i in range(len(job.rows))]
        job.future.set_result((rows, prompt_rows))

    def _fail_all(self, exc: Exception) -> None:
        """Fail every started and queued job with ``exc`` (a failed step, or shutting down)."""
        for job in self._active:
            if not job.future.done():
                job.future.set_exception(exc)
        self._active, self._rows, self._scores = [], {}, {}
        if isinstance(exc, StepFailed):
            return  # the queued jobs run on the fresh engine
        while True:
            try:
                future, _ = self._queue.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(exc)
