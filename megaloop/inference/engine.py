"""The batching inference engine: requests come and go between decoding steps.

``InferenceEngine.step()`` is one iteration of the scheduler:

1. retire cancelled requests (their blocks return to the pool at once);
2. admit queued requests, in arrival order, while ``max_batch`` rows and the pool's blocks allow
   (a request takes the blocks of its prompt plus ``max_tokens`` at admission, so a running row
   never runs out mid-way; one that does not fit waits for another to finish);
3. prefill at most ``prefill_chunk`` prompt tokens: one request's chunk or the whole chunks of
   several, so that a long prompt is read over several steps while the running rows keep
   decoding; chunks of the same length share one forward (left-padded as in decode); a prompt
   is cut at multiples of ``prefill_chunk`` whatever the batch; its last chunk samples the
   request's first token;
4. decode one token for every running row in one forward. With an exit rule each row leaves the
   loop at its own step (``early_exit.decode_step``: a row that exits at step t takes no part in
   steps t+1..T), across requests;
5. retire the rows that reached EOD, ``max_tokens`` or whose ``on_token`` said stop.

The KV cache is paged (megaloop/inference/paged_kv.py, which says why not megatron-core's
dynamic context): a forward gathers its rows into one left-padded static cache with an
attention mask for the padding (decode forwards over the same rows reuse it while it has spare
columns), and writes the new tokens' K/V back into their blocks. Every KV
policy works (the gathered view is a ``LoopKVCache``). Models whose attention drops that mask in
decode (Transformer Engine, flash decoding) and those the pool cannot hold (``kv_policy`` none,
SpiralFormer's chunk latents) run under the ``grouped`` and ``private`` layouts (``layout``).
``Generator`` (megaloop/inference/generate.py) is the engine's synchronous face: every caller
decodes through this loop.

All rows of a forward sample in one call (megaloop/inference/sampling.py), each from the
counter-based stream of its ``SamplingParams.seed`` and its ``stream``, with one transfer of the
chosen ids to the host; so a request's tokens are those it gets decoded alone
(tests/test_engine.py), whatever else is in the batch, and every tensor-parallel rank draws the
same ones (sampled under ``--speculate``, the exception megaloop/inference/speculation.py
states).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megaloop.device import current_device, device_of
from megaloop.inference import early_exit
from megaloop.inference.flags import check_num_loops, check_sampling, check_seed
from megaloop.inference.cuda_graphs import DecodeGraphs, check_cuda_graphs
from megaloop.inference.engine_config import LAYER_FORWARDS, EngineConfig  # noqa: F401
from megaloop.inference.kv_cache import LoopKVCache
from megaloop.inference.paged_kv import BlockAllocator, PagedKV
from megaloop.inference.sampling import SamplingParams, probabilities, sample_rows
from megaloop.inference.transfer import to_device
from megaloop.model.layer_forward import STATIC, unsupported as unsupported_layers
from megaloop.inference.speculation import (DraftController, agreed_k, check_speculate,
                                             full_depth_forward, speculate_round)


# Columns a decode forward's gathered cache keeps free, so that the next SPARE_COLUMNS decode
# forwards over the same rows reuse it instead of gathering every cached token again.
SPARE_COLUMNS = 32


class _Clock:
    """Where a step's time goes (``stats``' ``*_s``): host time on a CPU; on a GPU the device's
    time between two points (CUDA events: the host only queues the work, so its own clock would
    put a forward's time in the first copy that waits for it). Events are read at the end of
    the step, after its transfer to the host has waited for all of them."""

    def __init__(self, stats: dict):
        self.stats, self.cuda = stats, torch.cuda.is_available()
        self._spans: list = []

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, keys: tuple, start, end) -> None:
        """Add the time from ``start`` to ``end`` (``now()``s) to each of ``keys``."""
        if self.cuda:
            self._spans.append((keys, start, end))
            return
        for key in keys:
            self.stats[key] += end - start

    def settle(self) -> None:
        for keys, start, end in self._spans:
            for key in keys:
                self.stats[key] += start.elapsed_time(end) / 1e3
        self._spans = []


@dataclass(eq=False)
class Request:
    """One request; made by ``InferenceEngine.add``, read by the caller."""

    id: int
    prompt: list
    max_tokens: int
    params: SamplingParams
    on_token: Optional[Callable] = None
    record_logprobs: bool = False
    ignore_eos: bool = False
    out: list = field(default_factory=list)
    """Generated ids so far (EOD included when reached)."""
    finish: Optional[str] = None
    """None while running; ``stop`` (EOD, or on_token said stop), ``length``, ``cancelled``."""
    logprobs: list = field(default_factory=list)
    """With record_logprobs: per generated token the [V] fp32 log-softmax (CPU) of the logits
    it was drawn from, before temperature / top-k / top-p."""
    token_logprobs: list = field(default_factory=list)
    """Per generated token, its log-probability under the distribution it was drawn from
    (temperature, top-k, top-p applied; 0 when greedy): the behaviour policy's, for RL."""
    depths: list = field(default_factory=list)
    """With an exit rule: the loop step each generated token was read out at, its exit step (the
    first at the rule's step of the prompt's last position, though the prefill ran all T steps
    for the prompt's K/V)."""
    error: Optional[BaseException] = None
    """What ``on_token`` or sampling its token raised (the request was then cancelled)."""
    cancelled: bool = False
    blocks: list = field(default_factory=list)
    cached: int = 0
    """Tokens in the KV cache (prompt prefilled so far, then generated tokens fed back)."""
    stream: int = 0
    """Its random stream under ``params.seed`` (``Generator`` row i draws from stream i)."""
    cache: object = None
    """Under the ``private`` layout: its own ``LoopKVCache`` (None: ``kv_policy`` none)."""


# Why a model or KV policy needs a layout other than ``paged`` (the ``layout`` docstring).
LAYOUT_REASONS = {
    "grouped": "Transformer Engine's attention (or flash decoding), which drops the attention "
               "mask in decode,",
    "private": "kv_policy none or SpiralFormer's per-batch chunk latents",
}


def layout(model, kv_policy: str) -> str:
    """How the engine holds a request's cache and batches its forwards:

    - ``paged``: the paged pool; every forward's rows gathered left-padded, with a mask;
    - ``grouped``: the paged pool, but a forward takes only rows of one cached length (no
      padding, so no mask: Transformer Engine's attention and flash decoding drop it in
      decode); a prompt is prefilled in one forward (a later chunk would need the mask too);
    - ``private``: each request its own ``LoopKVCache`` (SpiralFormer keeps chunk latents in it,
      which cannot be paged or regrouped) or none (``kv_policy`` none recomputes the whole
      sequence), one forward per request, a prompt prefilled in one forward."""
    from megaloop.model.config import use_transformer_engine
    from megaloop.model.spiral_schedule import is_active

    if kv_policy == "none" or is_active(model.loop):
        return "private"
    if use_transformer_engine(model.model_cfg) or model.config.flash_decode:
        return "grouped"
    return "paged"


class InferenceEngine:
    """Iteration-level scheduling of many requests over one LoopedGPTModel (TP >= 1, PP = 1)."""

    def __init__(self, model, vocab_size: int, num_loops: Optional[int] = None,
                 kv_policy: str = "full", eod: Optional[int] = None, exit_rule=None,
                 config: EngineConfig = EngineConfig()):
        check_num_loops(num_loops, spell=str)
        config.validate()
        self.model, self.vocab_size, self.eod = model, vocab_size, eod
        self.num_loops = num_loops or model.loop.num_loops
        self.exit_rule, self.config, self.kv_policy = exit_rule, config, kv_policy
        reason = model.loop.supports(depth=self.num_loops, exit=exit_rule, kv_policy=kv_policy)
        if reason:
            raise ValueError(reason)
        self.layout = layout(model, kv_policy)
        self.speculate = check_speculate(config.speculate, exit_rule, kv_policy, self.num_loops)
        # each round's drafts, 0 (a plain step) to k, from the measured acceptance and costs
        self.drafts = DraftController() if self.speculate and not config.speculate_fixed \
            else None
        if self.speculate and self.layout != "paged":
            raise ValueError(f"--speculate {config.speculate}: its multi-token verify reads a "
                             f"masked, paged cache, which {LAYOUT_REASONS[self.layout]} rules "
                             f"out; leave --speculate out")
        if model.position_embedding_type == "learned_absolute" and \
                config.max_sequence_length > model.model_cfg.max_position_embeddings:
            raise ValueError(f"--max-sequence-length {config.max_sequence_length} exceeds the "
                             f"model's learned positions (--max-position-embeddings "
                             f"{model.model_cfg.max_position_embeddings})")
        num_blocks = config.num_blocks or config.max_batch * -(
            -config.max_sequence_length // config.block_size)
        self.allocator = BlockAllocator(num_blocks, config.block_size)
        # Which forward computes the layers: megaloop's inference forward, or megatron-core's
        # (with the reason); a Transformer Engine model stays on megatron-core's.
        why = "--layer-forward megatron-core" if config.layer_forward == "megatron-core" \
            else unsupported_layers(model)
        self.layer_forward = why is None
        self.forward_impl = "megaloop" if why is None else f"megatron-core ({why})"
        self.kv = PagedKV(self.allocator, kv_policy, current_device(), self.layer_forward)
        check_cuda_graphs(config.cuda_graphs, exit_rule, self.speculate, kv_policy,
                          model.config.tensor_model_parallel_size, self.layer_forward,
                          random_state=model.loop.state_init == "noise")
        self.graphs = DecodeGraphs() if config.cuda_graphs else None
        self._lock = threading.Lock()  # add / cancel may come from other threads than step()
        self._queue: list[Request] = []
        self._running: list[Request] = []
        self._next_id = 0
        self.stats: dict = {"steps": 0, "decode_forwards": 0, "prefill_forwards": 0,
                            "prefill_tokens": 0, "gathers": 0, "decode_rows_max": 0, "decode_rows_mean": 0.0,
                            "forward_s": 0.0, "gather_s": 0.0, "free_blocks": num_blocks,
                            "used_blocks": 0, "queued": 0, "running": 0, "drafted": 0,
                            "accepted": 0, "prefill_s": 0.0, "kv_bytes": 0}
        self._decode_rows = 0
        self.stats["layer_forward"] = self.forward_impl
        self.clock = _Clock(self.stats)
        # The last decode forward's gathered cache of each set of rows (request ids), and the
        # sets this step used (``grouped`` decodes several sets per step; the others are freed).
        self._decode_views: dict = {}
        self._views_used: set = set()

    # --- the caller's side ----------------------------------------------------------------
    def add(self, prompt: list, max_tokens: int, params: SamplingParams = SamplingParams(),
            on_token: Optional[Callable] = None, record_logprobs: bool = False,
            ignore_eos: bool = False, stream: int = 0) -> Request:
        """Queue a request (admitted at a later ``step()``). ``on_token(request, token)`` is
        called on the thread running ``step()`` right after each token is sampled; True
        finishes the request (``stop``). An exception it raises, or one raised sampling the
        request's token (e.g. from NaN logits), cancels that request (its blocks are freed, the
        other rows go on): ``step()`` returns it with ``finish`` ``cancelled`` and the exception
        in ``error``."""
        if not prompt:
            raise ValueError("every prompt needs at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens {max_tokens}: must be >= 1")
        check_sampling(params.temperature, params.top_k, params.top_p, spell=str)
        check_seed(params.seed, spell=str)
        total = len(prompt) + max_tokens
        if total > self.config.max_sequence_length:
            raise ValueError(f"a prompt of {len(prompt)} tokens plus max_tokens {max_tokens} is "
                             f"{total} tokens, over the engine's --max-sequence-length "
                             f"{self.config.max_sequence_length}; shorten the prompt or "
                             f"max_tokens")
        if self.layout != "paged" and len(prompt) > self.config.prefill_chunk:
            raise ValueError(f"a prompt of {len(prompt)} tokens: with "
                             f"{LAYOUT_REASONS[self.layout]} the engine prefills a prompt in "
                             f"one forward, and --prefill-chunk is "
                             f"{self.config.prefill_chunk}; raise it or shorten the prompt")
        if self.allocator.blocks_for(total) > self.allocator.num_blocks:
            raise ValueError(f"a request of {total} tokens needs "
                             f"{self.allocator.blocks_for(total)} KV blocks, more than the "
                             f"pool's --num-blocks {self.allocator.num_blocks}")
        with self._lock:
            request = Request(self._next_id, list(prompt), max_tokens, params, on_token,
                              record_logprobs, ignore_eos, stream=stream)
            self._next_id += 1
            self._queue.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """Its rows and blocks are freed at the next ``step()`` (a finished one: nothing)."""
        with self._lock:
            request.cancelled = True

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._queue or self._running)

    # --- one iteration --------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list:
        """One iteration (module docstring); the requests that finished in it."""
        if self.model.training:  # (eval() walks every module: not on every step)
            self.model.eval()
        finished: list[Request] = []
        with self._lock:
            for request in [r for r in self._queue if r.cancelled]:
                self._queue.remove(request)
                request.finish = "cancelled"
                finished.append(request)
            for request in [r for r in self._running if r.cancelled and r.finish is None]:
                request.finish = "cancelled"
                self._retire(request)
                finished.append(request)
            self._admit()
        # Whole chunks only, each request's cut at multiples of prefill_chunk: under the
        # one-slot and mod-k KV policies a chunk reads the earlier chunks' cached (last-step /
        # first-step) K/V, so where a prompt is cut is part of its result, and must not depend
        # on what else is in the batch.
        budget, chunks = self.config.prefill_budget or self.config.prefill_chunk, {}
        for request in list(self._running):
            n = min(self.config.prefill_chunk, len(request.prompt) - request.cached)
            if n <= 0:
                continue
            if n > budget:
                break
            budget -= n
            chunks.setdefault(n, []).append(request)
        for n, requests in chunks.items():
            self._prefill(requests, n, finished)
        decoding = [r for r in self._running if r.cached >= len(r.prompt) and r.finish is None]
        if decoding:
            self._decode(decoding, finished)
        # A set of rows that did not decode in this step will not again as it was: free its
        # copy of the cache.
        self._decode_views = {k: v for k, v in self._decode_views.items()
                              if k in self._views_used}
        self._views_used = set()
        if self.layout == "private":
            self.stats["kv_bytes"] = max(self.stats["kv_bytes"], sum(
                r.cache.nbytes() for r in self._running if r.cache is not None))
        else:
            self.stats["kv_bytes"] = self.kv.nbytes()
        self.clock.settle()
        self.stats["steps"] += 1
        self.stats.update(free_blocks=self.allocator.free, used_blocks=self.allocator.used,
                          queued=len(self._queue), running=len(self._running))
        return finished

    def _admit(self) -> None:
        while self._queue and len(self._running) < self.config.max_batch:
            request = self._queue[0]
            blocks = self.allocator.allocate(
                self.allocator.blocks_for(len(request.prompt) + request.max_tokens))
            if blocks is None:
                return  # in arrival order: the head waits for blocks, the rest behind it
            self._queue.pop(0)
            request.blocks = blocks
            if self.layout == "private" and self.kv_policy != "none":
                request.cache = LoopKVCache(1, len(request.prompt) + request.max_tokens,
                                            self.kv_policy, self.layer_forward)
            self._running.append(request)

    def _retire(self, request: Request) -> None:
        self.allocator.release(request.blocks)
        request.blocks, request.cache = [], None
        self._running.remove(request)

    def _forward(self, requests: list, ids: torch.Tensor, positions: torch.Tensor, decode: bool):
        """Full-vocabulary fp32 logits [b, s, V] of ``ids`` after each request's cache, and the
        exit step of each row (decode with an exit rule) or None. The ``grouped`` and
        ``private`` layouts split the rows into forwards of one cached length or one request."""
        if self.layout == "paged":
            return self._forward_rows(requests, ids, positions, decode)
        if self.layout == "grouped":
            key = lambda i: requests[i].cached  # noqa: E731
        else:
            key = lambda i: requests[i].id  # noqa: E731
        groups: dict = {}
        for i in range(len(requests)):
            groups.setdefault(key(i), []).append(i)
        logits = depth = None
        for rows in groups.values():
            index = torch.tensor(rows)
            part = [requests[i] for i in rows]
            if self.layout == "grouped":
                out, d = self._forward_rows(part, ids[index], positions[index], decode,
                                            masked=False)
            else:
                out, d = self._forward_private(part[0], ids[index], positions[index], decode)
            if logits is None:
                logits = out.new_zeros((len(requests),) + tuple(out.shape[1:]))
                depth = None if d is None else d.new_zeros(len(requests))
            index = index.to(device_of(out))
            logits[index] = out
            if d is not None:
                depth[index] = d
        return logits, depth

    def _run(self, ids, positions, mask, kv, decode: bool):
        """The model's logits (gathered over tensor-parallel ranks, fp32, the real vocabulary)
        and exit steps, as the exit rule decodes (None: all T steps)."""
        from megaloop.model.readout import gather_logits

        depth = None
        if self.exit_rule is not None and decode:
            logits, depth = early_exit.decode_step(self.model, ids, positions, kv,
                                                   self.num_loops, self.exit_rule, mask)
        elif self.exit_rule is not None:
            # (the last position's logits at the rule's step: the first token follows the rule)
            logits, depth = early_exit.prefill(self.model, ids, positions, kv, self.num_loops,
                                               mask, rule=self.exit_rule)
        elif self.speculate and not decode:
            # the drafts read out at step d: the coda's cache of step d must hold the prompt
            logits = full_depth_forward(self.model, ids, positions, mask, self.num_loops, kv,
                                        self.speculate[0])
        else:
            logits = self.model(ids, positions, mask, num_loops=self.num_loops, kv_cache=kv)
        logits = gather_logits(logits)
        return logits[..., :self.vocab_size].float(), depth

    def _run_static(self, kv, ids, positions, mask, column):
        """A decode forward of static shapes (``EngineConfig.cuda_graphs``): ``_run``'s logits."""
        from megaloop.model.readout import gather_logits

        setattr(kv.context, STATIC, column)
        logits = self.model(ids, positions, mask, num_loops=self.num_loops, kv_cache=kv)
        logits = gather_logits(logits)
        return logits[..., :self.vocab_size].float()

    def _forward_rows(self, requests: list, ids, positions, decode: bool, masked: bool = True):
        """``_forward`` over the paged cache, the rows gathered into one view (``masked``
        False: the rows have one cached length, so the view has no padding)."""
        rows = [(r.blocks, r.cached) for r in requests]
        new = ids.size(1)
        clock = self.clock.now()
        key = tuple(r.id for r in requests)
        old = self._decode_views.get(key) if decode else None
        reuse = old is not None and self.kv.reusable(old, rows)
        width = max(r.cached for r in requests) + new + (SPARE_COLUMNS if decode else 0)
        # The step's integers (ids, positions, cached lengths, the slots to write back and,
        # for a fresh view, to gather) reach the device in one non-blocking copy.
        host = [ids, positions, torch.tensor([r.cached for r in requests]),
                self.kv.write_index(rows, new)]
        if not reuse:
            host.append(self.kv.gather_index(rows, width))
        static = decode and self.graphs is not None
        if static:  # (the column the new K/V go to, for a static forward: cuda_graphs.py)
            L = max(r.cached for r in requests)
            host.append(torch.tensor([L]))
        ids, positions, lengths, dest, *rest = to_device(host, current_device())
        if reuse:
            kv, mask = self.kv.next_decode(old, rows, lengths)
        else:
            kv, mask = self.kv.view(rows, new, width - max(r.cached for r in requests) - new,
                                    rest[0], lengths)
            self.stats["gathers"] += 1
        if decode:
            self._decode_views[key] = kv
            self._views_used.add(key)
        gathered = self.clock.now()
        if static:
            # The view's whole width under a mask, the column in a device tensor: the same
            # shapes at every step of the view, so a GPU replays one captured graph.
            mask = self.kv.static_mask(lengths, L, kv.max_sequence_length)
            inputs = {"ids": ids, "positions": positions, "mask": mask, "column": rest[-1]}
            logits = self.graphs.run(kv, inputs, lambda **a: self._run_static(kv, **a))
            depth = None
        else:
            logits, depth = self._run(ids, positions, mask if masked else None, kv, decode)
        if kv.entries:
            raise ValueError(f"the batching engine cannot page loop-variant cache entries "
                             f"({', '.join(map(str, kv.entries))})")
        computed = self.clock.now()
        self.kv.write_back(kv, rows, new, dest)
        for r in requests:
            r.cached += new
        self.clock.add(("gather_s",), clock, gathered)
        self.clock.add(("gather_s",), computed, self.clock.now())
        self.clock.add(("forward_s",) if decode else ("forward_s", "prefill_s"), gathered,
                       computed)
        return logits, depth

    def _forward_private(self, request: Request, ids, positions, decode: bool):
        """``_forward`` of one request over its own cache; without one (``kv_policy`` none)
        over its whole sequence, of which the new positions' logits are kept."""
        new = ids.size(1)
        clock = self.clock.now()
        device = current_device()
        if request.cache is None:
            whole = (request.prompt + request.out)[:request.cached] + ids[0].tolist()
            ids, positions = to_device([torch.tensor([whole]),
                                        torch.arange(len(whole)).view(1, -1)], device)
            logits, depth = self._run(ids, positions, None, None, False)
            logits = logits[:, -new:]
        else:
            ids, positions = to_device([ids, positions], device)
            logits, depth = self._run(ids, positions, None, request.cache, decode)
            request.cache.advance(new)
        request.cached += new
        self.clock.add(("forward_s",) if decode else ("forward_s", "prefill_s"), clock,
                       self.clock.now())
        return logits, depth

    def _prefill(self, requests: list, n: int, finished: list) -> None:
        """The next ``n`` prompt tokens of each of ``requests`` in one forward; the requests
        whose prompt this completes sample their first token."""
        ids = torch.tensor([r.prompt[r.cached:r.cached + n] for r in requests])
        positions = torch.tensor([list(range(r.cached, r.cached + n)) for r in requests])
        logits, depth = self._forward(requests, ids, positions, decode=False)
        self.stats["prefill_forwards"] += 1
        self.stats["prefill_tokens"] += n * len(requests)
        read = [i for i, r in enumerate(requests) if r.cached == len(r.prompt)]
        if read:
            index = torch.tensor(read).to(device_of(logits)) \
                if len(read) < len(requests) else None
            pick = (lambda t: t if index is None else t.index_select(0, index))  # noqa: E731
            self._emit([requests[i] for i in read], pick(logits[:, -1]),
                       None if depth is None else pick(depth), finished)

    def _decode(self, requests: list, finished: list) -> None:
        chosen = False  # a plain step the controller chose (k = 0): timed for it
        if self.speculate:
            # Rows with room for a draft speculate, k as large as all of them can take (a
            # row's blocks end at max_tokens) or less, as the controller says (0: all rows
            # decode plainly); a row one token short of max_tokens decodes plainly.
            room = {r.id: r.max_tokens - len(r.out) - 1 for r in requests}
            drafting = [r for r in requests if room[r.id] >= 1]
            if drafting:
                k = min([self.speculate[1]] + [room[r.id] for r in drafting])
                if self.drafts is not None:
                    k = agreed_k(self.drafts.k_for(k))
                chosen = k == 0
                if k:
                    self._speculate(drafting, k, finished)
                    requests = [r for r in requests if room[r.id] < 1]
            if not requests:
                return
        start = time.perf_counter()
        ids = torch.tensor([[r.out[-1]] for r in requests])
        positions = torch.tensor([[r.cached] for r in requests])
        logits, depth = self._forward(requests, ids, positions, decode=True)
        self.stats["decode_forwards"] += 1
        self._decode_rows += len(requests)
        self.stats["decode_rows_max"] = max(self.stats["decode_rows_max"], len(requests))
        self.stats["decode_rows_mean"] = self._decode_rows / self.stats["decode_forwards"]
        self._emit(requests, logits[:, -1], depth, finished)
        if chosen:  # (_emit's transfer to the host waited for the forward)
            self.drafts.record_plain(time.perf_counter() - start)

    def _speculate(self, requests: list, k: int, finished: list) -> None:
        """One self-speculative round (megaloop/inference/speculation.py) for the decoding rows:
        each emits the tokens it kept and the verified one after them."""
        clock = self.clock.now()
        times: dict = {}
        logits, emitted, ok, drafted, accepted = speculate_round(self, requests, k, times)
        if self.drafts is not None:
            self.drafts.record([len(row) - 1 for row in emitted], k, times["draft_s"],
                               times["verify_s"])
        self._decode_views = {}  # the rows grew unevenly: the next decode gathers afresh
        self.clock.add(("forward_s",), clock, self.clock.now())
        self.stats["decode_forwards"] += k + 1
        self.stats["drafted"] += drafted
        self.stats["accepted"] += accepted
        self._decode_rows += len(requests) * (k + 1)
        self.stats["decode_rows_max"] = max(self.stats["decode_rows_max"], len(requests))
        self.stats["decode_rows_mean"] = self._decode_rows / self.stats["decode_forwards"]
        for i, request in enumerate(requests):
            for j, token in enumerate(emitted[i]):
                if request.finish is not None:
                    break
                self._take(request, logits[i, j], token, ok[i], self.num_loops, finished)

    def _emit(self, requests: list, logits: torch.Tensor, depth: Optional[torch.Tensor],
              finished: list) -> None:
        """Sample every request's next token from its row of the [n, V] logits in one call,
        and retire the requests that are done. ``depth``: each row's exit step (None: T)."""
        params = [r.params for r in requests]
        tokens, ok, logp = sample_rows(logits, [p.temperature for p in params],
                                       [p.top_k for p in params], [p.top_p for p in params],
                                       [p.seed for p in params], [r.stream for r in requests],
                                       [len(r.out) for r in requests], logprobs=True)
        # the step's one transfer to the host (ids and steps are exact in float64)
        rows = [tokens.double(), ok.double(), logp]
        if depth is not None:
            rows.append(depth.to(logp.device).double())
        host = torch.stack(rows).tolist()
        tokens, ok, logp = host[:3]
        depths = host[3] if depth is not None else [self.num_loops] * len(requests)
        for i, request in enumerate(requests):
            self._take(request, logits[i], int(tokens[i]), bool(ok[i]), int(depths[i]),
                       finished, logp[i])

    def _take(self, request: Request, logits: torch.Tensor, token: int, ok: bool, depth: int,
              finished: list, logprob: Optional[float] = None) -> None:
        """Append the request's sampled token (or end it alone if its row could not be
        sampled) and retire it if it is done. ``logprob``: the token's under its sampling
        distribution (None: computed here from ``logits``)."""
        if not ok:  # this row's fault: it alone ends, the other rows go on
            request.finish, request.error = "cancelled", ValueError(
                f"cannot sample this row's next token: its logits hold NaN or +inf, or none "
                f"is finite at temperature {request.params.temperature:g}")
            with self._lock:
                self._retire(request)
            finished.append(request)
            return
        request.out.append(token)
        if logprob is None:
            p = request.params
            logprob = 0.0 if p.temperature <= 0 else float(probabilities(
                logits[None], [p.temperature], [p.top_k], [p.top_p])[0][0, token].log())
        request.token_logprobs.append(logprob)
        if request.record_logprobs:
            request.logprobs.append(F.log_softmax(logits, dim=-1).cpu())
        if self.exit_rule is not None:
            request.depths.append(depth)
        stop = False
        if request.on_token is not None:
            try:
                stop = request.on_token(request, token)
            except Exception as error:  # the other rows go on; the caller reads the error
                request.finish, request.error = "cancelled", error
        if request.finish is None and (stop or token == self.eod and not request.ignore_eos):
            request.finish = "stop"
        elif request.finish is None and len(request.out) >= request.max_tokens:
            request.finish = "length"
        if request.finish is not None:
            with self._lock:
                self._retire(request)
            finished.append(request)
