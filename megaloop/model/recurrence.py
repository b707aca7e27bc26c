"""The recurrence, in one place: one loop step on a carry, and the fold of T of them.

    carry = begin(model, tokens)                  # embedding, prelude, variants' set-up
    for t in 1..T:
        carry, out = step(model, carry, t, ctx)   # one application of the shared core

A step is, on a model split over pipeline stages, cut where the core is cut:

    first stage:  z = before_core hooks (history injection, input injection, down-scaling)
    every stage:  out = core(z), wrapped by the around_core hooks (step-selected LoRA adapters
                  and timestep features, a coarse step's rope, per-step weight views)
    last stage:   h = after_core hooks (up-scaling + Anchor/MeSH, loop gating); y = step_norm(h);
                  readout (coda, head, gate) and this step's share of the exit objective

(With --pipeline-first-stage-readouts, the steps it names read out only their gate on the last
stage; their LM loss is computed on the first stage as the next step enters it, from the carried
state.)

``fold`` is the only loop over steps: the single-stage forward (``LoopedGPTModel.forward``),
evaluation at any depth, prefill, decoding and teacher-forced scoring under an early-exit rule
(megaloop/inference/early_exit.py) all call it; a pipeline virtual chunk
(megaloop/parallel/pipeline.py) runs one ``step`` on the carry it unpacks and packs the result for
the next stage. An exit rule (``Stop``) decides after each step from the carried log-survival and
the step's readout, per row (decoding: the rows that stop leave the batch) or per token
(teacher-forced: masked). The exit objective folds the same way everywhere: each step adds its
per-token share, computed from the carried log-survival (``ExitObjective.resume``), and the
shares of the T steps sum to the objective.

Variants plug in through ``LoopVariant``: a module that implements some of its hooks and
declares the carry slots it keeps (``carry_slots``; megaloop/model/carry.py), registered in
``megaloop.model.looped_gpt.VARIANTS``. Adding a variant is one module and one line there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megaloop.model import layer_forward
from megaloop.model.carry import Carry, Slot
from megaloop.model.loss import LoopOutput
from megaloop.model.objective import ExitObjective


@dataclass
class StepContext:
    """What every step of one forward shares (not carried: each stage knows it)."""

    num_loops: int
    """T of this forward (the trained count, or another at evaluation / random depth)."""
    mode: str
    """The exit loss of this forward (``expected`` whenever T = 1)."""
    length: int
    """Tokens L of the sequence."""
    attention_mask: Optional[torch.Tensor] = None
    rotary_pos_emb: Optional[torch.Tensor] = None
    labels: Optional[torch.Tensor] = None
    """[b, s] targets; None: an inference forward (logits of the last step only)."""
    read_every_step: bool = False
    """Read out (coda, head, gate) at every step also without labels: an early-exit rule needs
    every step's gate and logits (decoding: the coda's cache at every step too), a caller of
    ``fold`` every step's logits (``on_step``)."""
    first_stage_readouts: tuple = ()
    """Pipeline stages: the steps whose LM loss the first stage computes at the next step, from
    the state entering it (the last stage reads out only their gate and carries the loss weight
    along; ``LoopedGPTModel.first_stage_readouts_at``). Empty: every step reads out where it
    ends."""
    no_grad_steps: int = 0
    """Pipeline stages: truncated backpropagation's count, so that a step's loss read out one
    step later keeps the gradient mode of its own step."""
    route: Optional[tuple] = None
    """LoopFormer: the step sizes dt_1..dt_T of this forward's route (summing to 1); None: T
    equal steps (megaloop/model/conditioning.py)."""
    kv: Optional[object] = None
    """Cached decoding: a megaloop.inference.kv_cache.LoopKVCache, whose dict for each (block,
    step) is swapped into megatron-core's inference context around the block's call (a variant
    may put its own context there for a call: ``LoopKVCache.redirect``)."""

    @contextlib.contextmanager
    def cache(self, block: str, step: Optional[int] = None):
        """{"inference_context": ...} for a block call at ``step`` (empty without a cache)."""
        if self.kv is None:
            yield {}
            return
        with self.kv.use(block, step, new_tokens=self.length) as inference_context:
            yield {"inference_context": inference_context}

    def reads_out(self, t: int) -> bool:
        """Whether step t runs coda, head and gate."""
        return t == self.num_loops or self.read_every_step or (
            self.labels is not None and self.mode != "last")


@dataclass
class StepOutput:
    """What the last stage learns from step t (None everywhere else)."""

    share: Optional[torch.Tensor] = None
    """[b, s] this step's part of the per-token objective (with gradient)."""
    loss: Optional[torch.Tensor] = None
    """[b, s] this step's LM loss, detached."""
    exit_prob: Optional[torch.Tensor] = None
    """[b, s] p_t, detached."""
    logits: Optional[torch.Tensor] = None
    """[s, b, v/tp] vocab-parallel logits of this step."""
    gate_logit: Optional[torch.Tensor] = None
    """[b, s] the exit gate's logit at this step (steps before the last), detached."""
    exits: Optional[torch.Tensor] = None
    """Under a ``Stop``: bool, which tokens this step ran stop after it ([b, s] per token;
    [rows] per row, in the order of ``rows``)."""
    rows: Optional[torch.Tensor] = None
    """A per-row ``Stop``: the batch rows this step ran on (indices into the fold's batch)."""
    earlier: Optional["StepOutput"] = None
    """On the first stage, with ``ctx.first_stage_readouts``: step t - 1's LM loss read out here
    (``share`` = w_{t-1} L_{t-1}, ``loss`` = L_{t-1})."""


class LoopVariant:
    """The interface of a loop variant. Each hook receives the step t (1-based) and the step
    context (``ctx.num_loops`` is T); the defaults change nothing. A variant is built on every
    pipeline stage (its parameters only where its hooks run), so that every stage reads the same
    declarations."""

    def carry_slots(self, num_loops: int) -> list[Slot]:
        """The state this variant keeps in the carry when ``num_loops`` loops run (what a later
        step, maybe on another pipeline stage, reads); the same on every stage."""
        return []

    def begin(self, carry: Carry, ctx: StepContext, embedded: torch.Tensor) -> None:
        """Before step 1, on the first stage, after embedding and prelude (``carry.h`` is h_0;
        ``embedded`` the token embedding e)."""

    def before_core(self, z: torch.Tensor, carry: Carry, t: int, ctx: StepContext):
        """First stage: the core's input z from the state (``carry.h``, the state entering the
        step, before any injection)."""
        return z

    def around_core(self, run: Callable, z: torch.Tensor, attention_mask, rotary_pos_emb,
                    t: int, ctx: StepContext):
        """Every stage: run this stage's core layers, ``run(z, attention_mask, rotary_pos_emb)``
        (set per-step state before, mark the output after, or change what the core sees)."""
        return run(z, attention_mask, rotary_pos_emb)

    def after_core(self, out: torch.Tensor, carry: Carry, t: int, ctx: StepContext):
        """Last stage: the step's new state from the core's output."""
        return out


def context(model, input_ids: torch.Tensor, attention_mask=None, labels=None,
            num_loops: Optional[int] = None, kv=None, read_every_step: bool = False,
            route: Optional[tuple] = None) -> StepContext:
    """The step context of one forward; refuses a loop count the model cannot run
    (``LoopConfig.supports``). ``kv``: a KV cache holding the positions before ``input_ids``.
    ``route``: LoopFormer's step sizes (``StepContext.route``)."""
    T = num_loops or model.loop.num_loops
    reason = model.loop.supports(depth=T)
    if reason:
        raise ValueError(reason)
    if model.value_tokens is not None:  # --value-embeddings: this forward's ids, every stage
        model.value_tokens.value = input_ids
    mode = model.loop.exit_loss if T > 1 else "expected"
    rope = None
    if model.position_embedding_type == "rope":
        # With a cache the table covers the cached positions too (attention slices the new ones).
        # Under context parallelism input_ids hold this rank's two chunks of the sequence: the
        # table is asked for the whole sequence and megatron-core's RotaryEmbedding keeps this
        # rank's chunks of it (get_pos_emb_on_this_cp_rank), as GPTModel does.
        length = input_ids.size(1) * model.config.context_parallel_size
        if kv is not None and kv.layer_forward:
            # (the cache's whole length, not this forward's: megatron-core memoises the table
            # by length, and the layer forward indexes it by position)
            rope = model.rotary_pos_emb(kv.max_sequence_length)
        else:
            rope = model.rotary_pos_emb(length + (kv.offset if kv is not None else 0))
    return StepContext(T, mode, input_ids.size(1), attention_mask, rope, labels,
                       read_every_step=read_every_step, kv=kv, route=route)


def begin(model, input_ids, position_ids, ctx: StepContext) -> Carry:
    """Embedding, prelude and the variants' set-up: the carry entering step 1 (first stage)."""
    if ctx.rotary_pos_emb is not None and ctx.kv is not None and ctx.kv.layer_forward:
        # megaloop's layer forward rotates each token by its position (layer_forward.py)
        from megatron.core.transformer.attention import \
            _yarn_get_concentration_factor_from_config as mscale

        ctx.rotary_pos_emb = layer_forward.PositionRope(ctx.rotary_pos_emb, position_ids,
                                                        mscale(model.config))
    embedded = h = model.embedding(input_ids=input_ids, position_ids=position_ids)
    if model.model_cfg.embedding_scale != 1.0:  # (Huginn: sqrt(d))
        embedded = h = h * model.model_cfg.embedding_scale
    if model.prelude is not None:
        with ctx.cache("prelude") as cache:
            h = layer_forward.call(model.prelude, h, ctx.attention_mask, ctx.rotary_pos_emb,
                                   **cache)
    carry = Carry(h, model.carry_slots(ctx.num_loops))
    for variant in model.variants:
        variant.begin(carry, ctx, embedded)
    return carry


def _core(core, ctx, t, z, attention_mask, rotary_pos_emb):
    with ctx.cache("core", t) as cache:
        return layer_forward.call(core, z, attention_mask, rotary_pos_emb, **cache)


def step(model, carry: Carry, t: int, ctx: StepContext) -> tuple[Carry, StepOutput]:
    """Loop step t (1-based) of ``ctx.num_loops`` on this stage's part of the model."""
    earlier = None
    if model.pre_process and t - 1 in ctx.first_stage_readouts:
        earlier = _first_stage_readout(model, carry, t - 1, ctx)
    carry, out = _step(model, carry, t, ctx)
    out.earlier = earlier
    return carry, out


def _first_stage_readout(model, carry: Carry, t: int, ctx: StepContext) -> StepOutput:
    """Step t's LM loss, read out on the first stage as step t + 1 enters it: the carry's state
    is y_t (the step norm's output, the readout's input: no coda, recurrent step norm) and its
    ``readout_weight`` the objective's weight of L_t, which the last stage computed from the
    gate; the share w_t L_t joins the objective here and its gradient reaches the gate through
    the carry."""
    with torch.set_grad_enabled(torch.is_grad_enabled() and t > ctx.no_grad_steps):
        loss = model.lm_head(carry.h, ctx.labels)
        return StepOutput(share=carry.readout_weight * loss, loss=loss.detach())


def _step(model, carry: Carry, t: int, ctx: StepContext) -> tuple[Carry, StepOutput]:
    """``step`` without the first stage's readout of the step before."""
    z = carry.h
    if model.pre_process:
        for variant in model.variants:
            z = variant.before_core(z, carry, t, ctx)
    run = partial(_core, model.core, ctx, t)
    for variant in reversed(model.variants):  # the first listed is the outermost
        run = partial(variant.around_core, run, t=t, ctx=ctx)
    out = run(z, ctx.attention_mask, ctx.rotary_pos_emb)
    if not model.post_process:  # the step goes on on the next stage
        carry.h = out
        return carry, StepOutput()
    for variant in model.variants:
        out = variant.after_core(out, carry, t, ctx)
    y = model.step_norm(out)
    carry.h = y if model.loop.step_norm_placement == "recurrent" else out
    if not ctx.reads_out(t):
        return carry, StepOutput()
    T = ctx.num_loops
    kept = [slot.name for slot in ExitObjective.carry_slots(T, ctx.mode)]
    if t in ctx.first_stage_readouts:  # the LM loss is read out on the first stage, next step
        objective = _resume(model, carry, t, ctx, kept)
        carry.readout_weight = objective.add_gate(model.exit_gate(y))
        for name in kept:
            setattr(carry, name, getattr(objective, name))
        return carry, StepOutput(objective.share(), None, objective.exit_probs[-1])
    gate = model.exit_gate is not None and (t < T or ctx.mode == "adaptive-gate")
    with ctx.cache("coda", t) as cache:
        # With labels the readout returns the step's LM loss, not its logits.
        out, gate_logit = model.readout(y, ctx.attention_mask, ctx.rotary_pos_emb, gate,
                                        labels=ctx.labels, **cache)
    if ctx.labels is None:
        if gate_logit is None:
            return carry, StepOutput(logits=out)
        gate_logit = gate_logit.detach()
        # The survival the objective would carry (exit rules read it: Q-exit's CDF).
        survival = F.logsigmoid(-gate_logit.float())
        carry.log_survival = survival if carry.log_survival is None else \
            carry.log_survival + survival
        return carry, StepOutput(logits=out, gate_logit=gate_logit)
    loss = out
    objective = _resume(model, carry, t, ctx, kept)
    objective.add_step(loss, gate_logit)
    for name in kept:
        setattr(carry, name, getattr(objective, name))
    prob = objective.exit_probs[-1] if objective.exit_probs else None
    # No logits: the chunked readout never keeps them, and megatron-core's vocab-parallel
    # cross-entropy overwrites them in place.
    return carry, StepOutput(objective.share(), loss.detach(), prob)


def _resume(model, carry: Carry, t: int, ctx: StepContext, kept: list) -> ExitObjective:
    """The exit objective going on at step t from the accumulators the carry holds (its own
    carry slots, named as its fields)."""
    loop = model.loop
    return ExitObjective.resume(
        ctx.num_loops, ctx.mode, loop.exit_kl_beta, loop.exit_loss_smoothing, steps_done=t - 1,
        gate_k=loop.gate_bce_k, gate_gamma=loop.gate_bce_gamma,
        **{name: getattr(carry, name) for name in kept})


@dataclass
class Stop:
    """An early-exit rule applied by ``fold`` (megaloop/model/exit_rules.py decides)."""

    rule: Optional[object]
    """A megaloop.model.exit_rules.ExitRule; None: every token stops at step T."""
    per_row: bool = False
    """True: decoding, one token per row; a row that stops leaves the batch (the carry and the
    KV cache are compacted to the rows still going, so its later steps cost nothing). False:
    teacher-forced, every position runs on (later positions attend to it) and a stopped one is
    masked out of the ``exits`` of later steps."""


class _Exits:
    """Which tokens of one fold still run under a ``Stop``, and the rule's memory of them."""

    def __init__(self, stop: Stop, carry: Carry, ctx: StepContext):
        self.rule, self.per_row, self.T = stop.rule, stop.per_row, ctx.num_loops
        b, device = carry.h.size(1), carry.h.device
        if self.per_row and (ctx.length != 1 or ctx.labels is not None):
            raise ValueError("a per-row exit decodes one token per row, without labels")
        self.batch, self.labelled = b, ctx.labels is not None
        self.running = torch.arange(b, device=device) if self.per_row else \
            torch.ones(b, ctx.length, dtype=torch.bool, device=device)
        self.previous = None  # the last step's log-probs of the running tokens (kl)
        self.kv = ctx.kv

    def compacted(self):
        """Around a step: the KV cache narrowed to the running rows (per row, once some left)."""
        if self.per_row and self.kv is not None and len(self.running) < self.batch:
            return self.kv.rows(self.running)
        return contextlib.nullcontext()

    def decide(self, t: int, carry: Carry, out: StepOutput) -> None:
        """Set ``out.exits`` (and ``out.rows``): the tokens that stop after step t."""
        shape = (len(self.running), 1) if self.per_row else tuple(self.running.shape)
        device = self.running.device
        if t == self.T or self.rule is None:
            stop = torch.full(shape, t == self.T, dtype=torch.bool, device=device)
        else:
            from megaloop.model.exit_rules import full_vocab_log_probs

            logp = full_vocab_log_probs(out.logits).transpose(0, 1) \
                if self.rule.reads_log_probs else None  # [b, s, V]
            survival = carry.log_survival.detach() if self.rule.reads_survival else None
            stop = self.rule.stops(t, shape, device, survival, logp, self.previous)
            self.previous = logp
        if self.per_row:
            out.exits, out.rows = stop[:, -1], self.running
        else:
            out.exits = self.running & stop
            self.running = self.running & ~stop

    def leave(self, carry: Carry, out: StepOutput) -> Optional[Carry]:
        """The carry of the tokens going on after ``out``'s step; None when none is."""
        if not self.per_row:  # (a labelled fold reads every step's loss: it runs to T)
            return carry if self.labelled or self.running.any() else None
        keep = ~out.exits
        if not keep.any():
            return None
        if keep.all():
            return carry
        local = keep.nonzero().squeeze(-1)
        self.running = self.running[keep]
        if self.previous is not None:
            self.previous = self.previous[local]
        return carry.index_rows(local)


def fold(model, carry: Carry, ctx: StepContext, stop: Optional[Stop] = None,
         on_step: Optional[Callable] = None, no_grad_steps: int = 0):
    """Steps 1..T on one stage: the package's one loop over steps (a pipeline chunk runs one).

    With labels: a LoopOutput; without: the last step's logits [b, s, v/tp] (of the rows that
    ran it). ``stop``: an early-exit rule; each step's StepOutput then says which tokens stop
    after it (``exits``), and the fold ends once none goes on. ``on_step(t, carry, out)``: called
    after every step with the carry leaving it and its StepOutput (``out.logits``, read out at
    every step with ``ctx.read_every_step``, keep their gradient when grad is enabled).
    ``no_grad_steps``: truncated backpropagation, the first n steps run without gradient (the
    state leaving them is a constant; their losses enter the objective's value)."""
    T = ctx.num_loops
    exits = None if stop is None else _Exits(stop, carry, ctx)
    objective, losses, probs, out = None, [], [], StepOutput()
    for t in range(1, T + 1):
        with torch.set_grad_enabled(torch.is_grad_enabled() and t > no_grad_steps), \
                (exits.compacted() if exits is not None else contextlib.nullcontext()):
            carry, out = step(model, carry, t, ctx)
        if exits is not None:
            exits.decide(t, carry, out)
        if on_step is not None:
            on_step(t, carry, out)
        if ctx.labels is not None:
            if out.share is not None:
                objective = out.share if objective is None else objective + out.share
            losses.append(out.loss)
            if out.exit_prob is not None:
                probs.append(out.exit_prob)
        if exits is not None:
            carry = exits.leave(carry, out)
            if carry is None:
                break
    if ctx.labels is None:
        return None if out.logits is None else out.logits.transpose(0, 1).contiguous()
    nan = torch.full_like(ctx.labels, float("nan"), dtype=torch.float32)
    step_losses = torch.stack([nan if l is None else l for l in losses])
    return LoopOutput(objective, step_losses, torch.stack(probs) if probs else None)
