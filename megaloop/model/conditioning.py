"""Timestep conditioning ("What Makes Recurrence Effective in Looped Language Models?" (arXiv
2609.36636)): the core knows which loop step it runs.

Features of loop pass l (0-based) out of T: ``t = l / T``, ``dt = 1 / T`` and

    psi(t, dt) = (t, dt, t^2, dt^2, t dt, sin(pi t), cos(pi t) - 1, sin(2 pi t))

Three forms (``--timestep-conditioning``), every parameter initialised to 0 so that the model
starts equal to the unconditioned one:

- `loop-gating`: ``h_{l+1} = h_l + g_l (F(z_l) - h_l)``, ``g_l = 1 + q^T psi_l`` (one q for the
  whole core; h_l is the carried state before injection, z_l the core's input after it);
- `branch-gating`: per core layer k and branch b in {attn, mlp}, the branch's update to the
  residual stream is scaled by ``g = 1 + q_{k,b}^T psi_l``;
- `adaln`: per layer and branch ``[g - 1; s] = W_{k,b} psi_l`` with g and s vectors over the
  hidden size: the branch reads ``(1 + s) * N(u)`` and its update is scaled by g.

Where "the branch's update" is taken depends on the norm scheme: the sub-layer output (bias
included) for pre / magic / post / sandwich (post and sandwich then normalize ``u + g B``), and
the output norm's result for ouro (a scalar gate before ouro's output norm would cancel).

Inference at another loop count (``--timestep-inference``): `rescaled` uses the T being run
(t = l / T_run), `prefix` keeps the training T (t = l / T_train; more loops than trained go past
t = 1).

Branch and AdaLN parameters live inside the core layers (``core.layers.k.timestep_conditioning``)
and act through forward hooks, as stepwise LoRA does, so they follow the layers over pipeline
stages and checkpoints and no megatron-core class is forked. The pass currently running is set by
the recurrence's ``around_core`` hook, which also marks the core's output so that the backward pass
re-selects it before activation recomputation re-runs the core. All parameters are replicated over TP ranks (the hidden vectors
they scale are full on every rank; under sequence parallelism they carry the ``sequence_parallel``
tag so their gradients are summed over the TP group).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core.transformer.module import MegatronModule

from megaloop.model.loop_step import ReselectStep, StepHolder
from megaloop.model.recurrence import LoopVariant

NUM_FEATURES = 8
FORMS = ("loop-gating", "branch-gating", "adaln")


def timestep_features(l: int, T: int) -> list:
    """psi(t_l, dt) of What Makes Recurrence Effective for pass l (0-based) of T."""
    t, dt = l / T, 1.0 / T
    return [t, dt, t * t, dt * dt, t * dt, math.sin(math.pi * t), math.cos(math.pi * t) - 1.0,
            math.sin(2 * math.pi * t)]


def _zeros(shape, config) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(shape, dtype=config.params_dtype))
    p.sequence_parallel = config.sequence_parallel
    return p


class LayerConditioning(MegatronModule):
    """Branch gates (``gate`` [2, 8]) or AdaLN maps (``adaln`` [2, 2d, 8]) of one core layer."""

    def __init__(self, config, form: str, clock: StepHolder):
        super().__init__(config=config)
        self.form, self.clock, d = form, clock, config.hidden_size
        if form == "branch-gating":
            self.gate = _zeros((2, NUM_FEATURES), config)
        else:
            self.adaln = _zeros((2, 2 * d, NUM_FEATURES), config)

    def _psi(self, like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self.clock.value, dtype=like.dtype, device=like.device)

    def gate_of(self, branch: int, like: torch.Tensor) -> torch.Tensor:
        """g of a branch (0 attn, 1 mlp): a scalar, or a [d] vector for AdaLN."""
        psi = self._psi(like)
        if self.form == "branch-gating":
            return 1.0 + self.gate[branch].to(like.dtype) @ psi
        return 1.0 + self.adaln[branch, :self.config.hidden_size].to(like.dtype) @ psi

    def scale_of(self, branch: int, like: torch.Tensor) -> torch.Tensor:
        """AdaLN's s of a branch ([d])."""
        return self.adaln[branch, self.config.hidden_size:].to(like.dtype) @ self._psi(like)

    # forward hooks ------------------------------------------------------------------------
    def hook_gate_pair(self, branch: int):
        """On a sub-layer returning (output, bias): scale both by g."""
        def hook(module, args, output):
            out, bias = output
            g = self.gate_of(branch, out)
            return out * g, (None if bias is None else bias * g)
        return hook

    def hook_gate_tensor(self, branch: int):
        """On ouro's output norm: scale the normalized branch output by g."""
        def hook(module, args, output):
            return output * self.gate_of(branch, output)
        return hook

    def hook_scale(self, branch: int):
        """On an input norm: ``(1 + s) * N(u)``."""
        def hook(module, args, output):
            return output * (1.0 + self.scale_of(branch, output))
        return hook


class TimestepConditioning(MegatronModule, LoopVariant):
    """The model-level part: the clock, loop gating's q, and the per-layer modules it installed."""

    def __init__(self, config, form: str, core, norm_scheme: str, train_loops: int,
                 inference: str, last: bool = True):
        super().__init__(config=config)
        if form not in FORMS:
            raise ValueError(f"unknown --timestep-conditioning {form!r}; choose one of none, "
                             f"{', '.join(FORMS)}")
        self.form, self.train_loops, self.inference = form, train_loops, inference
        self.clock = StepHolder()
        self.clock.value = timestep_features(0, train_loops)
        if form == "loop-gating":
            # Used where a step ends: only the last pipeline stage owns it.
            self.loop_gate = _zeros((NUM_FEATURES,), config) if last else None
            return
        for layer in core.layers:
            cond = LayerConditioning(config, form, self.clock)
            layer.add_module("timestep_conditioning", cond)
            for branch, (sub, bda, norm) in enumerate((
                    ("self_attention", "self_attn_bda", "input_layernorm"),
                    ("mlp", "mlp_bda", "pre_mlp_layernorm"))):
                if norm_scheme == "ouro":
                    getattr(layer, bda).norm.register_forward_hook(cond.hook_gate_tensor(branch))
                else:
                    getattr(layer, sub).register_forward_hook(cond.hook_gate_pair(branch))
                if form == "adaln":
                    getattr(layer, norm).register_forward_hook(cond.hook_scale(branch))

    def features(self, step: int, num_loops: int) -> list:
        """psi of loop step ``step`` (1-based) when ``num_loops`` loops are run."""
        T = num_loops if self.inference == "rescaled" else self.train_loops
        return timestep_features(step - 1, T)

    def around_core(self, run, z, attention_mask, rotary_pos_emb, t, ctx):
        """Condition this core pass on step t of T; mark its output so that activation
        recomputation re-selects step t before it re-runs the core."""
        psi = self.features(t, ctx.num_loops)
        self.clock.value = psi
        out = run(z, attention_mask, rotary_pos_emb)
        if self.form == "loop-gating" or not torch.is_grad_enabled() or not out.requires_grad:
            return out
        return ReselectStep.apply(out, self.clock, psi)

    def after_core(self, out, carry, t, ctx):
        """Loop gating on (F(z), h), h the state that entered the step (before injection)."""
        if self.form != "loop-gating":
            return out
        psi = self.features(t, ctx.num_loops)
        g1 = self.loop_gate.to(out.dtype) @ torch.tensor(psi, dtype=out.dtype, device=out.device)
        # h + g (F - h) written as F + (g - 1)(F - h): exactly F while q = 0.
        return out + g1 * (out - carry.entering)


def build_timestep_conditioning(config, loop, core, norm_scheme: str, last: bool = True
                                ) -> Optional[TimestepConditioning]:
    """``last``: whether this pipeline stage ends each loop step (owns loop gating's q)."""
    if loop.timestep_conditioning == "none":
        return None
    return TimestepConditioning(config, loop.timestep_conditioning, core, norm_scheme,
                                loop.num_loops, loop.timestep_inference, last)
