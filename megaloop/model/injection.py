"""Input injection: what enters the core at loop steps after the first.

The recurrence (``LoopedGPTModel.forward``) computes the injected *source* once -- the token
embedding e or the prelude output h_0 (``--injection-source``) -- and before every core pass
after the first hands the injection module the previous state and that source:

    z_t = inject(h_{t-1}, src)          t = 2..T;  the first step reads h_0 unchanged

The first step is left alone because 000 Eq. 1 mixes "for t > 0" (0-based), and because with
no prelude h_0 *is* the source, so mixing there would be the identity anyway.

Every form is a module with ``forward(h, source) -> z``, registered in ``INJECTIONS`` under its
``--input-injection`` name; the initial-state forms of 003 (channel-wise, residual channel-wise,
dense) plug in the same way. History-state injection (003) needs the window of past states too;
it will take them as an extra argument from the recurrence rather than storing them here, so
that the module stays stateless and pipeline chunks can carry the window with the activations.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core.transformer.module import MegatronModule


class ScalarMix(MegatronModule):
    """000 Eq. 1: ``z = w * src + (1 - w) * h`` with ``w = sigmoid(a)``, a single learned scalar.

    The scalar is replicated on every tensor-parallel rank (each rank holds the full hidden
    vector, or under sequence parallelism a slice of the tokens). In the latter case each rank's
    gradient of ``a`` covers only its tokens, so the parameter carries megatron-core's
    ``sequence_parallel`` tag and the gradient is summed over the TP group like a norm's.
    """

    def __init__(self, config, init_weight: float):
        super().__init__(config=config)
        if not 0.0 < init_weight < 1.0:
            raise ValueError(f"--injection-init-weight {init_weight} must be in (0, 1); "
                             "w = sigmoid(a) never reaches 0 or 1 exactly")
        # a = logit(w), so that sigmoid(a) starts at exactly the requested mixing weight.
        a = math.log(init_weight / (1.0 - init_weight))
        self.logit = torch.nn.Parameter(torch.full((1,), a, dtype=config.params_dtype))
        self.logit.sequence_parallel = config.sequence_parallel

    @property
    def weight(self) -> float:
        """The current mixing weight w (for logging)."""
        return torch.sigmoid(self.logit.detach().float()).item()

    def forward(self, h: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        w = torch.sigmoid(self.logit.float()).to(h.dtype)
        return w * source + (1.0 - w) * h


INJECTIONS = {"scalar-mix": ScalarMix}


def build_injection(config, loop) -> Optional[MegatronModule]:
    """The injection module of ``loop.input_injection`` (None for ``none``)."""
    if loop.input_injection == "none":
        return None
    if loop.input_injection not in INJECTIONS:
        raise ValueError(f"unknown --input-injection {loop.input_injection!r}; choose one of "
                         f"none, {', '.join(INJECTIONS)}")
    return INJECTIONS[loop.input_injection](config, loop.injection_init_weight)
