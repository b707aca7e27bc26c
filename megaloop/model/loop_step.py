"""Which loop step the core is running, for modules that live inside the shared core.

Stepwise LoRA and timestep conditioning sit in the core's layers and must know the step of the
pass in flight. The recurrence writes it into a ``StepHolder`` before each core
pass. Activation recomputation re-runs the core during the backward pass, long after the forward
has moved on to later steps, so ``ReselectStep`` puts an identity on the core's output whose
backward writes that pass's value back before autograd reaches (and recomputes) the core.
"""

from __future__ import annotations

import torch


class StepHolder:
    """The value the core's modules read for the pass in flight (a step index, or features)."""

    def __init__(self, value=1):
        self.value = value


class ReselectStep(torch.autograd.Function):
    """Identity whose backward sets ``holder.value`` back to this pass's value."""

    @staticmethod
    def forward(ctx, h, holder: StepHolder, value):
        ctx.holder, ctx.value = holder, value
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        ctx.holder.value = ctx.value
        return grad, None, None
