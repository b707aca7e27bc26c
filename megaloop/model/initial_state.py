"""Huginn's random initial state (``--state-init noise``): the loop starts from noise, not from
the prelude's output.

In "Scaling up Test-Time Compute with Latent Reasoning: A Recurrent Depth Approach" (Huginn) the
state entering the first core pass is drawn afresh for every token of every forward,

    s_0 ~ TruncatedNormal(0, sigma^2, [-3 sigma, 3 sigma]) * embedding_scale,

sigma = sqrt(2 / (5 d)) x init_scale (``--state-init-scale``; 0 gives the zero state), and the tokens reach the loop only through the injection
(Huginn's adapter, megaloop's ``concat-linear`` from the prelude). This variant replaces the
carry's state in ``begin``; it is listed right after the input injection
(megaloop.model.looped_gpt), whose ``begin`` has then already kept the prelude's output as its
source.

The draw comes from a private generator, so the global RNG stream (dropout, later inits) is the
same as without it. Its seed mixes a base seed fixed at construction (the process's initial
seed, the same on every rank), a per-module call counter (every rank of a stage calls ``begin``
equally often) and the ranks that hold *different* tokens: data-parallel and context-parallel
ranks, and tensor-parallel ranks under sequence parallelism (each holds a slice of the sequence
there). Tensor-parallel ranks without sequence parallelism hold the same replicated state and so
draw the same numbers. A resumed run restarts the counter: the noise of its first steps repeats
the first steps' of the run it resumes (the data differ).
"""

from __future__ import annotations

import hashlib
import math

import torch

from megaloop.model.recurrence import LoopVariant


def huginn_std(hidden_size: int) -> float:
    """Huginn's sigma of the initial state (its init std), sqrt(2 / (5 d))."""
    return math.sqrt(2.0 / (5.0 * hidden_size))


class RandomInitialState(torch.nn.Module, LoopVariant):
    """``begin``: carry.h <- truncated-normal noise of its shape, times the embedding scale."""

    def __init__(self, config, init_scale: float, scale: float):
        super().__init__()
        self.std = huginn_std(config.hidden_size) * init_scale
        self.scale = scale
        self.sequence_parallel = config.sequence_parallel
        self.base = torch.initial_seed()
        self.calls = 0

    def _seed(self) -> int:
        from megatron.core import parallel_state as ps

        ranks = (ps.get_data_parallel_rank(with_context_parallel=False),
                 ps.get_context_parallel_rank(),
                 ps.get_tensor_model_parallel_rank() if self.sequence_parallel else 0)
        text = f"{self.base}:{self.calls}:{ranks}".encode()
        return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1

    def noise(self, like: torch.Tensor) -> torch.Tensor:
        """Noise of ``like``'s shape, dtype and device (the next draw of this module)."""
        if self.std == 0:  # (Huginn's init_scale 0)
            return torch.zeros_like(like)
        generator = torch.Generator(device=like.device).manual_seed(self._seed())
        self.calls += 1
        noise = torch.empty(like.shape, dtype=torch.float32, device=like.device)
        torch.nn.init.trunc_normal_(noise, 0.0, self.std, -3 * self.std, 3 * self.std,
                                    generator=generator)
        return (noise * self.scale).to(like.dtype)

    def begin(self, carry, ctx, embedded):
        carry.h = self.noise(carry.h)


def build_initial_state(config, loop, scale: float, first: bool = True):
    """The variant of ``loop.state_init`` on the first pipeline stage (None elsewhere, and for
    ``prelude``: the prelude's output enters step 1 as it is)."""
    if loop.state_init == "prelude" or not first:
        return None
    return RandomInitialState(config, loop.state_init_scale, scale)
