"""The carry: everything loop step t hands to loop step t + 1, in one shape.

A looped model's step needs more than the state h: the injection source, the window of past
states (history injection), the state that entered the step (loop gating, the MeSH routers),
Anchor's h_0 or MeSH's memory slots, and the per-token accumulators of the exit objective (the
running log-survival, and the previous step's loss for adaptive-gate training). ``Carry`` holds
them all. On one pipeline stage it is simply passed from one step to the next; between pipeline
stages it travels as *one* tensor of a fixed shape, laid out by ``CarryLayout``:

    [h; source; history_1..w; entering; anchor; memory_1..B; side]   along the sequence axis

every hidden block [s_local, b, d] (sharded over the sequence under sequence parallelism, like
the activation), and ``side`` a few rows that hold the fp32 per-token accumulators [b, s] bit
for bit, reinterpreted in the pipeline dtype (log-survival near 0 must not be rounded to bf16).
A coarse SpiralFormer step's h is L_t < L latents: it travels zero-padded at the end to L and is
cut back by the receiver. History slots not yet filled travel as zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch


@dataclass
class Carry:
    """What passes from loop step t to step t + 1 (fields a model does not use stay None)."""

    h: torch.Tensor
    """[s, b, d] the recurrent state entering the next step (mid-core on a pipeline stage: the
    partial activation; a coarse SpiralFormer step's latents there)."""
    source: Optional[torch.Tensor] = None
    """[s, b, d] the injection source: the token embedding or the prelude output."""
    history: List[torch.Tensor] = field(default_factory=list)
    """Completed states for history injection, oldest first (at most the window)."""
    entering: Optional[torch.Tensor] = None
    """[s, b, d] the state that entered the current step, before injection (loop gating and the
    MeSH routers read it where the step ends)."""
    anchor: Optional[torch.Tensor] = None
    """[s, b, d] Anchor's h_0, added to every step's update."""
    memory: Optional[List[torch.Tensor]] = None
    """MeSH's B memory slots, each [s, b, d]."""
    log_survival: Optional[torch.Tensor] = None
    """[b, s] fp32 running log prod_{s<t} (1 - lambda_s) of the exit distribution."""
    previous_loss: Optional[torch.Tensor] = None
    """[b, s] fp32 the previous step's LM loss (adaptive-gate training's loss improvement)."""


def history_count(step: int, window: int, first_stage: bool) -> int:
    """Filled history slots in the carry a stage receives during loop step ``step``: the first
    stage receives what step - 1 sent (h_1 .. h_{step-2}), later stages what this step's first
    stage sent (h_1 .. h_{step-1})."""
    done = step - 2 if first_stage else step - 1
    return max(0, min(window, done))


@dataclass
class CarryLayout:
    """The p2p layout of a carry for one model and loop count (the schedule's fixed shape)."""

    seq_local: int
    """Tokens per hidden block on this rank (the sequence divided by TP under SP)."""
    seq_full: int
    """Tokens of the whole sequence (the side accumulators are never sharded)."""
    hidden_size: int
    dtype: torch.dtype
    """The pipeline dtype: every block is sent in it."""
    source: bool = False
    history: int = 0
    """History slots sent (the window; 0 when no step reads history)."""
    entering: bool = False
    anchor: bool = False
    memory: int = 0
    survival: bool = False
    previous_loss: bool = False
    sp_size: int = 1

    @property
    def num_hidden(self) -> int:
        return 1 + self.source + self.history + self.entering + self.anchor + self.memory

    @property
    def num_side(self) -> int:
        """fp32 per-token accumulators: values per token."""
        return int(self.survival) + int(self.previous_loss)

    @property
    def side_rows(self) -> int:
        if not self.num_side:
            return 0
        per_value = 32 // torch.finfo(self.dtype).bits  # pipeline-dtype elements per fp32
        return math.ceil(self.num_side * self.seq_full * per_value / self.hidden_size)

    @property
    def seq_length(self) -> int:
        """What the schedule is told as the sequence length (it allocates [seq_length / sp, b,
        d] receive buffers)."""
        return (self.num_hidden * self.seq_local + self.side_rows) * self.sp_size

    # --- packing ----------------------------------------------------------------------------
    def pack(self, carry: Carry) -> torch.Tensor:
        h = carry.h
        if h.size(0) < self.seq_local:  # coarse latents: zero-padded at the end to L
            h = torch.nn.functional.pad(h, (0, 0, 0, 0, 0, self.seq_local - h.size(0)))
        hiddens = [h]
        if self.source:
            hiddens.append(carry.source)
        if self.history:
            zeros = torch.zeros_like(h)  # slots not yet filled
            hiddens += list(carry.history[-self.history:])
            hiddens += [zeros] * (self.history - min(len(carry.history), self.history))
        if self.entering:
            hiddens.append(carry.entering)
        if self.anchor:
            hiddens.append(carry.anchor)
        if self.memory:
            hiddens += list(carry.memory)
        hiddens = [x.to(self.dtype) for x in hiddens]
        if not self.num_side:
            return torch.cat(hiddens, 0) if len(hiddens) > 1 else hiddens[0]
        side = [carry.log_survival] if self.survival else []
        if self.previous_loss:
            side.append(carry.previous_loss)
        # Before the first readout an accumulator is still None: log 1 = 0 (and no loss yet).
        empty = torch.zeros(h.size(1), self.seq_full, dtype=torch.float32, device=h.device)
        side = torch.cat([empty if x is None else x.float() for x in side], 1)  # [b, n * s]
        return _PackSide.apply(side, self.side_rows, *hiddens)

    def unpack(self, payload: torch.Tensor, history: int = 0,
               h_rows: Optional[int] = None) -> Carry:
        """The carry in ``payload``; ``history``: how many history slots are filled; ``h_rows``:
        the rows of h that are real (a coarse step's latent count), None for all."""
        rows = [self.seq_local] * self.num_hidden
        if self.num_side:
            side, *hiddens = _UnpackSide.apply(payload, rows, self.num_side * self.seq_full)
        else:
            side, hiddens = None, list(payload.split(rows, 0))
        it = iter(hiddens)
        h = next(it)
        carry = Carry(h=h if h_rows is None else h[:h_rows])
        if self.source:
            carry.source = next(it)
        if self.history:
            slots = [next(it) for _ in range(self.history)]
            carry.history = slots[:history]
        if self.entering:
            carry.entering = next(it)
        if self.anchor:
            carry.anchor = next(it)
        if self.memory:
            carry.memory = [next(it) for _ in range(self.memory)]
        if side is not None:
            parts = side.split(self.seq_full, 1)
            if self.survival:
                carry.log_survival = parts[0]
            if self.previous_loss:
                carry.previous_loss = parts[-1]
        return carry


class _PackSide(torch.autograd.Function):
    """[hidden blocks; side bits] along the sequence axis, in the pipeline dtype.

    The side tensor is fp32 and travels as its raw bits reinterpreted in the pipeline dtype, so
    it arrives exact whatever that dtype is. Its gradient takes the same way back; one function
    owns both directions, so those bits are only ever copied, never added to (a sum of bit
    patterns would be garbage)."""

    @staticmethod
    def forward(ctx, side, rows, *hiddens):
        b, n = side.shape
        ctx.n, ctx.hidden_rows = n, [h.shape[0] for h in hiddens]
        bits = side.contiguous().view(hiddens[0].dtype)  # [b, n * 4 / itemsize]
        width = rows * hiddens[0].shape[-1]
        block = torch.nn.functional.pad(bits, (0, width - bits.shape[1]))
        block = block.view(b, rows, -1).transpose(0, 1)
        return torch.cat([*hiddens, block], 0)

    @staticmethod
    def backward(ctx, grad):
        pieces = grad.split(ctx.hidden_rows + [grad.shape[0] - sum(ctx.hidden_rows)], 0)
        block = pieces[-1]
        b = block.shape[1]
        ratio = 4 // grad.element_size()
        bits = block.transpose(0, 1).reshape(b, -1)[:, :ctx.n * ratio].contiguous()
        return (bits.view(torch.float32), None, *pieces[:-1])


class _UnpackSide(torch.autograd.Function):
    """The inverse of ``_PackSide`` on the receiving stage (and of its gradient)."""

    @staticmethod
    def forward(ctx, payload, hidden_rows, n):
        ctx.hidden_rows, ctx.n, ctx.shape, ctx.dtype = hidden_rows, n, payload.shape, payload.dtype
        ctx.device = payload.device
        pieces = payload.split(hidden_rows + [payload.shape[0] - sum(hidden_rows)], 0)
        block = pieces[-1]
        b = block.shape[1]
        ratio = 4 // payload.element_size()
        side = block.transpose(0, 1).reshape(b, -1)[:, :n * ratio].contiguous()
        return (side.view(torch.float32), *[p.clone() for p in pieces[:-1]])

    @staticmethod
    def backward(ctx, grad_side, *grad_hiddens):
        rows_total, b, width = ctx.shape
        dtype = ctx.dtype
        grad_hiddens = [torch.zeros(r, b, width, dtype=dtype, device=ctx.device) if g is None
                        else g
                        for g, r in zip(grad_hiddens, ctx.hidden_rows)]
        if grad_side is None:
            grad_side = torch.zeros(b, ctx.n, dtype=torch.float32, device=ctx.device)
        bits = grad_side.contiguous().view(dtype)
        rows = rows_total - sum(ctx.hidden_rows)
        block = torch.nn.functional.pad(bits, (0, rows * width - bits.shape[1]))
        block = block.view(b, rows, width).transpose(0, 1)
        return torch.cat([*grad_hiddens, block], 0), None, None
