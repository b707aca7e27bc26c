"""The carry: everything loop step t hands to loop step t + 1, in one shape.

A looped model's step needs more than the state h: an injection needs its source, another
variant a window of past states or a bank of slots, the exit objective its running log-survival.
Each of these belongs to the module that reads it, which *declares* it as a ``Slot`` for the loop
count being run (``LoopVariant.carry_slots`` in megaloop/model/recurrence.py). ``Carry`` holds h
and the declared slots, read and written as attributes (``carry.<name>``); a slot nobody declared
can be neither written nor read, so a variant that forgets a declaration fails on one stage
instead of losing its state between pipeline stages.

On one pipeline stage the carry is simply passed from one step to the next; between stages it
travels as *one* tensor of a fixed shape, laid out by ``CarryLayout`` from the declarations:

    [h; hidden slots, in declaration order (a list slot as its n blocks); side]   (sequence axis)

every hidden block [s_local, b, d] (sharded over the sequence under sequence parallelism, like
the activation), and ``side`` a few rows that hold the fp32 per-token slots [b, s] bit for bit,
reinterpreted in the pipeline dtype (log-survival near 0 must not be rounded to bf16). A block
shorter than the sequence (a coarse SpiralFormer step's L_t latents) travels zero-padded at the
end; its owner cuts it back. A value not yet set, and the unfilled entries of a list slot, travel
as zeros; a list slot arrives with all its n entries (its owner knows how many are real).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence

import torch

HIDDEN, SIDE = "hidden", "side"


@dataclass(frozen=True)
class Slot:
    """One piece of state a module keeps in the carry."""

    name: str
    """The attribute on the carry (``carry.<name>``); one name per piece of state in a model."""
    kind: str = HIDDEN
    """``hidden``: [s, b, d] blocks in the model's dtype, sent in the pipeline dtype; ``side``: a
    [b, s] per-token fp32 value, sent bit for bit."""
    count: int = 0
    """0: one tensor (None until set). n >= 1: a list of at most n tensors, oldest first (a
    window of past states, a bank of memories)."""

    def __post_init__(self):
        if self.kind not in (HIDDEN, SIDE):
            raise ValueError(f"carry slot {self.name!r}: kind {self.kind!r} is not "
                             f"{HIDDEN!r} or {SIDE!r}")
        if self.kind == SIDE and self.count:
            raise ValueError(f"carry slot {self.name!r}: a side slot holds one [b, s] tensor")
        if self.count < 0:
            raise ValueError(f"carry slot {self.name!r}: count {self.count} < 0")

    @property
    def blocks(self) -> int:
        """Tensors this slot sends."""
        return max(self.count, 1)


def merge_slots(declared: Iterable[Slot]) -> tuple:
    """The declarations of a model's modules as one tuple: a name declared twice the same way
    is one slot (two variants reading the state that entered the step); differently, an error."""
    out: Dict[str, Slot] = {}
    for slot in declared:
        if slot.name in out and out[slot.name] != slot:
            raise ValueError(f"carry slot {slot.name!r} declared twice differently: "
                             f"{out[slot.name]} and {slot}")
        out.setdefault(slot.name, slot)
    return tuple(out.values())


class Carry:
    """What passes from loop step t to step t + 1: ``h`` and the declared slots."""

    def __init__(self, h: torch.Tensor, slots: Sequence[Slot] = (), **values):
        object.__setattr__(self, "_slots", {s.name: s for s in slots})
        object.__setattr__(self, "_values", {})
        self.h = h
        """[s, b, d] the recurrent state entering the next step (mid-core on a pipeline stage:
        the partial activation; a coarse SpiralFormer step's latents there)."""
        for name, value in values.items():
            setattr(self, name, value)

    @property
    def slots(self) -> tuple:
        return tuple(self._slots.values())

    def __getattr__(self, name):
        slots = object.__getattribute__(self, "_slots")
        if name not in slots:
            raise AttributeError(f"the carry has no slot {name!r} (declared: "
                                 f"{', '.join(slots) or 'none'}); declare it in the module's "
                                 f"carry_slots")
        default = [] if slots[name].count else None
        return object.__getattribute__(self, "_values").get(name, default)

    def __setattr__(self, name, value):
        if name == "h":
            object.__setattr__(self, name, value)
        elif name in self._slots:
            self._values[name] = value
        else:
            raise AttributeError(f"the carry has no slot {name!r} (declared: "
                                 f"{', '.join(self._slots) or 'none'}); declare it in the "
                                 f"module's carry_slots")

    def index_rows(self, rows: torch.Tensor) -> "Carry":
        """The carry of a subset of batch rows (early exit's compaction): hidden blocks [s, b, d]
        on dim 1, side values [b, s] on dim 0."""
        def pick(x, dim):
            return None if x is None else x.index_select(dim, rows)

        out = Carry(pick(self.h, 1), self.slots)
        for name, value in self._values.items():
            dim = 0 if self._slots[name].kind == SIDE else 1
            setattr(out, name, [pick(x, dim) for x in value] if self._slots[name].count
                    else pick(value, dim))
        return out


@dataclass
class CarryLayout:
    """The p2p layout of a carry for one model and loop count (the schedule's fixed shape)."""

    slots: tuple
    """The model's declared slots for this loop count (``LoopedGPTModel.carry_slots``)."""
    seq_local: int
    """Tokens per hidden block on this rank (the sequence divided by TP under SP)."""
    seq_full: int
    """Tokens of the whole sequence (the side values are never sharded)."""
    hidden_size: int
    dtype: torch.dtype
    """The pipeline dtype: every block is sent in it."""
    sp_size: int = 1

    @property
    def hidden(self) -> List[Slot]:
        return [s for s in self.slots if s.kind == HIDDEN]

    @property
    def side(self) -> List[Slot]:
        return [s for s in self.slots if s.kind == SIDE]

    @property
    def num_hidden(self) -> int:
        return 1 + sum(s.blocks for s in self.hidden)

    @property
    def side_rows(self) -> int:
        if not self.side:
            return 0
        per_value = 32 // torch.finfo(self.dtype).bits  # pipeline-dtype elements per fp32
        return math.ceil(len(self.side) * self.seq_full * per_value / self.hidden_size)

    @property
    def seq_length(self) -> int:
        """What the schedule is told as the sequence length (it allocates [seq_length / sp, b,
        d] receive buffers)."""
        return (self.num_hidden * self.seq_local + self.side_rows) * self.sp_size

    # --- packing ----------------------------------------------------------------------------
    def pack(self, carry: Carry) -> torch.Tensor:
        h = carry.h
        zeros = None

        def full(x):  # a block shorter than the sequence: zero-padded at the end
            if x.size(0) < self.seq_local:
                x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, self.seq_local - x.size(0)))
            return x.to(self.dtype)

        hiddens = [full(h)]
        for slot in self.hidden:
            values = getattr(carry, slot.name)
            values = list(values[-slot.count:]) if slot.count else [values]
            values += [None] * (slot.blocks - len(values))
            for x in values:
                if x is None:
                    zeros = hiddens[0].new_zeros(hiddens[0].shape) if zeros is None else zeros
                    x = zeros
                hiddens.append(full(x))
        if not self.side:
            return torch.cat(hiddens, 0) if len(hiddens) > 1 else hiddens[0]
        # Before it is first set (step 1), a side value travels as 0 (log 1, and no loss yet).
        empty = torch.zeros(h.size(1), self.seq_full, dtype=torch.float32, device=h.device)
        side = [getattr(carry, slot.name) for slot in self.side]
        side = torch.cat([empty if x is None else x.float() for x in side], 1)  # [b, n * s]
        return _PackSide.apply(side, self.side_rows, *hiddens)

    def unpack(self, payload: torch.Tensor) -> Carry:
        """The carry in ``payload`` (h at full length; a list slot with all its entries)."""
        rows = [self.seq_local] * self.num_hidden
        if self.side:
            side, *hiddens = _UnpackSide.apply(payload, rows, len(self.side) * self.seq_full)
        else:
            side, hiddens = None, list(payload.split(rows, 0))
        it = iter(hiddens)
        carry = Carry(next(it), self.slots)
        for slot in self.hidden:
            values = [next(it) for _ in range(slot.blocks)]
            setattr(carry, slot.name, values if slot.count else values[0])
        if side is not None:
            for slot, part in zip(self.side, side.split(self.seq_full, 1), strict=True):
                setattr(carry, slot.name, part)
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
