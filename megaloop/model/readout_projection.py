"""A learned linear between a loop step's state and its readout (``--readout-projection``).

In "Parcae" (arXiv 2604.12946) the coda reads ``C h_T``: a [d, d] matrix C after the recurrent
block, while the state h itself is what the next core pass starts from. In megaloop the module
between a step's output and its readout is the step norm (megaloop/model/recurrence.py:
``y = step_norm(out)``; with ``--step-norm-placement readout`` the un-normed ``out`` continues
the loop). ``ReadoutProjection`` wraps that step norm, ``y = C step_norm(out)``, so the readout
(coda, gate, head) reads the projected state and the loop goes on from the unprojected one; the
coda's final norm is untouched (Parcae's ``ln_f``).

C is replicated over tensor-parallel ranks (each rank holds the full hidden vector; under
sequence parallelism it carries megatron-core's ``sequence_parallel`` tag, its gradient summed
over the TP group like a norm's) and drawn orthogonal with gain --init-method-std x sqrt(d) from a
private generator seeded identically on every rank: with --init-method-std sqrt(2 / (5 d)) that
is Parcae's (truncated) orthogonal draw of std sqrt(2 / (5 d)); the global RNG stream (every other
weight) is the same as without it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


class ReadoutProjection(MegatronModule):
    """``C norm(x)``: the step norm ``norm`` (kept as a submodule), then the [d, d] matrix C
    (``weight``)."""

    def __init__(self, config, norm: torch.nn.Module, seed: int):
        super().__init__(config=config)
        self.norm = norm
        d = config.hidden_size
        generator = torch.Generator().manual_seed(seed)
        weight = torch.empty(d, d)
        torch.nn.init.orthogonal_(weight, gain=config.init_method_std * math.sqrt(d),
                                  generator=generator)
        self.weight = torch.nn.Parameter(weight.to(config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.weight.to(x.dtype))


def with_readout_projection(norm, config, loop):
    """The step norm, wrapped in a ReadoutProjection under --readout-projection (the last
    pipeline stage's; None stays None)."""
    if norm is None or not loop.readout_projection:
        return norm
    return ReadoutProjection(config, norm, seed=torch.initial_seed() + 2)
