"""Random depth per step (Huginn, Geiping et al. 2025) with truncated backpropagation.

Each optimizer step draws its loop count from Huginn's Poisson-lognormal:
``tau ~ N(log(mean) - sigma^2/2, sigma)``, ``r ~ Poisson(e^tau) + 1``, so E[e^tau] = mean and
E[r] = mean + 1. The draw comes from a private ``torch.Generator`` seeded with (seed, iteration),
never from the global RNG: every rank (TP, DP, ...) computes the same r without communication,
the dropout / data streams are untouched, and a resumed run redraws exactly the depths the
interrupted run would have drawn.

Truncated backpropagation runs the first n of the r steps under ``torch.no_grad`` (the state they
hand on carries no graph), which bounds activation memory when r is large. At least the last step
always keeps its gradient: n is capped at r - 1.
"""

from __future__ import annotations

import hashlib
import math

import torch


def depth_generator(seed: int, iteration: int) -> torch.Generator:
    """A CPU generator that depends only on (seed, iteration): identical on every rank."""
    g = torch.Generator(device="cpu")
    # The CPU generator (mt19937) keeps only the low 32 bits of its seed, so seed * 2^32 +
    # iteration would drop the seed: hash the pair into 32 bits instead.
    digest = hashlib.sha256(f"megaloop-depth:{int(seed)}:{int(iteration)}".encode()).digest()
    g.manual_seed(int.from_bytes(digest[:4], "little"))
    return g


def draw_depth(mean: float, sigma: float, seed: int, iteration: int, max_depth: int = 0) -> int:
    """One Poisson-lognormal draw r >= 1 for ``iteration`` (capped at ``max_depth`` if > 0)."""
    g = depth_generator(seed, iteration)
    mu = math.log(mean) - 0.5 * sigma * sigma
    tau = mu + sigma * torch.randn((), generator=g, dtype=torch.float64)
    r = int(torch.poisson(torch.exp(tau), generator=g).item()) + 1
    return min(r, max_depth) if max_depth > 0 else r


def no_grad_steps(truncated: int, depth: int, last: int = 0) -> int:
    """How many leading steps run without gradient: ``truncated``, but never all of them; or,
    with ``last`` (--backprop-last-steps), all but the last ``last`` (none when depth <= last:
    Huginn's sampler then trains every step)."""
    if last:
        return max(0, depth - last)
    return max(0, min(truncated, depth - 1))
