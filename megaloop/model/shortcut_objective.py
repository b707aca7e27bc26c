"""``--loopformer-objective``: LoopFormer's training objective (a full route and a shorter one).

"LoopFormer: Elastic-Depth Looped Transformers for Latent Reasoning via Shortcut Modulation"
trains every micro-batch on two routes from time 0 to 1 through the same weights: the full route,
T steps of 1/T, and a shorter route of unequal steps drawn afresh, with

    loss = CE(full) + 0.1 CE(short) + 0.1 MSE(sg(y_full), y_short)

where y is the readout's normed state after a route's last step (the head's input) and sg stops
the gradient: the short route learns to land where the full one does. A short route has L steps,
L uniform in 1..T-1; each step but the last is a multiple of 1/T drawn uniformly among those that
leave at least 1/T for every step still to come, and the last fills the route to 1 (LoopFormer's
sampler). megaloop draws it from a private generator seeded with (seed, iteration, micro-batch):
every rank draws the same route without communication, and a resumed run redraws the routes the
interrupted one would have drawn.

The mean squared error is taken per token over the hidden size, so the masked token mean the
trainer takes equals LoopFormer's mean over every element when no token is masked. Evaluation
runs the full route only (its cross-entropy).
"""

from __future__ import annotations

import hashlib

import torch

from megaloop.model import recurrence
from megaloop.model.loss import LoopOutput

SHORT_WEIGHT = 0.1
"""The short route's cross-entropy weight (LoopFormer's 0.1)."""
CONSISTENCY_WEIGHT = 0.1
"""The weight of the mean squared error between the two routes' final normed states."""


def route_generator(seed: int, iteration: int, microbatch: int) -> torch.Generator:
    """A CPU generator that depends only on (seed, iteration, micro-batch)."""
    digest = hashlib.sha256(f"megaloop-route:{int(seed)}:{int(iteration)}:{int(microbatch)}"
                            .encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:4], "little"))


def draw_route(num_loops: int, generator: torch.Generator) -> tuple:
    """A shorter route of ``num_loops`` >= 2: its step sizes, summing to 1 (module docstring).
    Worked in whole units of 1 / T, so the sizes are exact multiples."""
    T = num_loops

    def uniform(low: int, high: int) -> int:  # an integer in low..high
        return low + int(torch.randint(high - low + 1, (1,), generator=generator))

    steps = uniform(1, T - 1)
    units, left = [], T
    for k in range(steps - 1):
        still_to_come = steps - 1 - k
        units.append(uniform(1, left - still_to_come))
        left -= units[-1]
    units.append(left)
    return tuple(u / T for u in units)


def forward(model, input_ids, position_ids, attention_mask, labels, num_loops: int,
            no_grad_steps: int, route: tuple) -> LoopOutput:
    """The full route's LoopOutput with the objective the two routes give together."""
    final = {}

    def keep(name):
        def on_step(t, carry, out):
            final[name] = carry.h  # (the fold's last call leaves the route's final state)
        return on_step

    ctx = recurrence.context(model, input_ids, attention_mask, labels, num_loops)
    carry = recurrence.begin(model, input_ids, position_ids, ctx)
    full = recurrence.fold(model, carry, ctx, on_step=keep("full"), no_grad_steps=no_grad_steps)
    ctx = recurrence.context(model, input_ids, attention_mask, labels, len(route), route=route)
    carry = recurrence.begin(model, input_ids, position_ids, ctx)
    short = recurrence.fold(model, carry, ctx, on_step=keep("short"))
    # y = the readout's input: the step norm of the final state (no coda: LoopConfig.validate)
    target = model.step_norm(final["full"]).detach().float()
    consistency = (model.step_norm(final["short"]).float() - target).pow(2).mean(-1)
    objective = (full.objective + SHORT_WEIGHT * short.objective
                 + CONSISTENCY_WEIGHT * consistency.transpose(0, 1))
    return LoopOutput(objective, full.step_losses, full.exit_probs)
