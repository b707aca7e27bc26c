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

A fourth form, `loopformer` ("LoopFormer: Elastic-Depth Looped Transformers for Latent Reasoning
via Shortcut Modulation", arXiv 2602.11451), conditions on the step size as well as the time: the
pass reads ``c = E_t(t) + E_dt(dt)``, each E a 256-d (``--timestep-frequency-dim``) sinusoidal
embedding (cosines, then sines, of the value times ``10000^(-i / 128)``) through Linear-SiLU-Linear
to the hidden size; both embedders are model-level, shared by every core layer. Per core layer
and branch, ``g = W_g silu(c) + b_g`` and ``s = W_s silu(c) + b_s`` (vectors over the hidden
size): the branch reads ``(1 + s) * N(u)`` and its update is scaled by g (adaLN without a shift;
the published model's norms have no learnable scale: ``--norm-scheme magic``). W and b start at 0
(the published initialisation: every branch starts switched off, not the unconditioned model).
A route of T equal steps has ``t = l / T``, ``dt = 1 / T``: a shorter route with a larger step is
run by asking for fewer loops (`rescaled`).

Inference at another loop count (``--timestep-inference``): `rescaled` uses the T being run
(t = l / T_run), `prefix` keeps the training T (t = l / T_train; more loops than trained go past
t = 1).

Branch and AdaLN conditioning is a change of the core's layer spec (``conditioned_spec``): the
bias-dropout-add slots become gated ones (``self_attn_bda.timestep_gate``,
``mlp_bda.timestep_gate``) and, for AdaLN, the input norm slots scaled norms
(``input_layernorm.timestep_scale``, ``pre_mlp_layernorm.timestep_scale``). They live in the core
layers, so they follow the layers over pipeline stages and checkpoints, and no megatron-core class
is forked. They read the pass in flight from a shared clock, set by the recurrence's
``around_core`` hook, which also marks the core's output so that the backward pass re-selects it
before activation recomputation re-runs the core. All parameters are replicated over TP ranks
(the hidden vectors they scale are full on every rank; under sequence parallelism they carry the
``sequence_parallel`` tag so their gradients are summed over the TP group).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megaloop.compat import with_submodules
from megaloop.model.carry import Slot
from megaloop.model.loop_step import ReselectStep, StepHolder
from megaloop.model.recurrence import LoopVariant
from megaloop.model.specs import NormedBiasDropoutAdd

NUM_FEATURES = 8
FORMS = ("loop-gating", "branch-gating", "adaln", "loopformer")
SPEC_FORMS = ("branch-gating", "adaln", "loopformer")
"""The forms built into the core's layer spec (``conditioned_spec``)."""
NORM_FORMS = ("adaln", "loopformer")
"""The forms that scale the input norms' output (the norms must be separate modules:
``layer_spec``'s ``unfuse_input_norms``)."""


def timestep_features(l: int, T: int) -> list:
    """psi(t_l, dt) of What Makes Recurrence Effective for pass l (0-based) of T."""
    t, dt = l / T, 1.0 / T
    return [t, dt, t * t, dt * dt, t * dt, math.sin(math.pi * t), math.cos(math.pi * t) - 1.0,
            math.sin(2 * math.pi * t)]


def _zeros(shape, config) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(shape, dtype=config.params_dtype))
    p.sequence_parallel = config.sequence_parallel
    return p


def _features(clock: StepHolder, like: torch.Tensor) -> torch.Tensor:
    """psi of the pass in flight, as a tensor like ``like``."""
    return torch.tensor(clock.value, dtype=like.dtype, device=like.device)


def _add_modulation(module, name: str, form: str, config) -> None:
    """Register one gate or scale on ``module`` as ``name``: W [8] (branch gating), W [d, 8]
    (AdaLN), or W [d, d] and ``name``_bias [d] (LoopFormer), all zeros."""
    d = config.hidden_size
    if form == "loopformer":
        setattr(module, name, _zeros((d, d), config))
        setattr(module, name + "_bias", _zeros((d,), config))
    else:
        setattr(module, name, _zeros((NUM_FEATURES,) if form == "branch-gating"
                                     else (d, NUM_FEATURES), config))


def _modulation(module, name: str, clock: StepHolder, like: torch.Tensor) -> torch.Tensor:
    """The value of ``module``'s gate or scale ``name`` for the pass in flight: W psi, or for
    LoopFormer W silu(c) + b with c the step's embedding (computed here, inside the layer, so
    that activation recomputation recomputes it from the parameters)."""
    weight = getattr(module, name).to(like.dtype)
    if getattr(clock, "embedder", None) is None:
        return weight @ _features(clock, like)
    c = clock.embedder(*clock.value, like)
    return F.linear(F.silu(c), weight, getattr(module, name + "_bias").to(like.dtype))


class GatedBiasDropoutAdd(MegatronModule):
    """The bias-dropout-add slot of a `pre` / `magic` layer with a branch gate: the sub-layer's
    (output, bias) are scaled by g = 1 + W psi before megatron-core's own bias-dropout-add.
    W is ``timestep_gate``: [8] (branch gating, g a scalar) or [d, 8] (AdaLN, g a vector)."""

    def __init__(self, config, inner, form: str, clock: StepHolder):
        super().__init__(config=config)
        self.inner, self.clock = build_module(inner), clock  # megatron-core's bda function
        _add_modulation(self, "timestep_gate", form, config)
        # Recurrence Effective's gates are 1 + W psi; LoopFormer's is W silu(c) + b itself.
        self.offset = 0.0 if form == "loopformer" else 1.0

    def gate(self, like: torch.Tensor) -> torch.Tensor:
        return self.offset + _modulation(self, "timestep_gate", self.clock, like)

    def forward(self, training: bool, fused: bool):
        bda = self.inner(training, fused)

        def gated_bias_dropout_add(x_with_bias, residual, prob):
            x, bias = x_with_bias
            g = self.gate(x)
            return bda((x * g, None if bias is None else bias * g), residual, prob)

        return gated_bias_dropout_add


class GatedNormedBiasDropoutAdd(NormedBiasDropoutAdd):
    """The normalized bias-dropout-add of `ouro` / `post` / `sandwich` with a branch gate. For
    ouro the gate scales the *normalized* branch output (a gate before ouro's output norm would
    be normalized away): ``residual + drop(g N(x + b))``; for post / sandwich it scales the
    branch before the sum is normalized: ``N(residual + drop(g (x + b)))``."""

    def __init__(self, config, norm, where: str, form: str, clock: StepHolder):
        super().__init__(config, norm, where)
        self.clock = clock
        _add_modulation(self, "timestep_gate", form, config)
        self.offset = 0.0 if form == "loopformer" else 1.0

    def forward(self, training: bool, fused: bool):  # noqa: ARG002 - fused has no meaning here
        def gated(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            g = self.offset + _modulation(self, "timestep_gate", self.clock, x)
            if self.where == "branch":
                return residual + F.dropout(g * self.norm(x), p=prob, training=training)
            return self.norm(residual + F.dropout(g * x, p=prob, training=training))

        return gated


class ScaledNorm(MegatronModule):
    """AdaLN's input norm slot: ``(1 + s) N(u)`` with s = ``timestep_scale`` psi ([d, 8]), or
    for LoopFormer s = ``timestep_scale`` silu(c) + ``timestep_scale_bias`` ([d, d], [d])."""

    def __init__(self, config, hidden_size: int, eps: float, inner, clock: StepHolder,
                 form: str = "adaln"):
        super().__init__(config=config)
        norm = build_module(inner, config=config, hidden_size=hidden_size, eps=eps)
        # The norm's parameters are registered here, under the names they have in a plain layer
        # (``input_layernorm.weight``), so checkpoints with and without AdaLN share every base
        # key; the norm itself is held outside the module tree (the same Parameter objects,
        # which ``.cuda()`` / ``.bfloat16()`` convert in place).
        for name, param in norm.named_parameters(recurse=False):
            self.register_parameter(name, param)
        self._norm = (norm,)
        self.clock = clock
        _add_modulation(self, "timestep_scale", form, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._norm[0](x)
        return out * (1.0 + _modulation(self, "timestep_scale", self.clock, out))


def conditioned_spec(spec: ModuleSpec, form: str, clock: StepHolder, config) -> ModuleSpec:
    """The core layer's spec with branch gates in its bias-dropout-add slots and, for AdaLN,
    scaled input norms (the layer's norms must be separate modules: ``layer_spec``'s
    ``unfuse_input_norms`` on TE)."""
    sub = spec.submodules

    def gated_bda(bda):
        if isinstance(bda, ModuleSpec) and bda.module is NormedBiasDropoutAdd:
            return ModuleSpec(module=GatedNormedBiasDropoutAdd,
                              params={**bda.params, "form": form, "clock": clock})
        return ModuleSpec(module=GatedBiasDropoutAdd,
                          params={"config": config, "inner": bda, "form": form, "clock": clock})

    changes = {"self_attn_bda": gated_bda(sub.self_attn_bda), "mlp_bda": gated_bda(sub.mlp_bda)}
    if form in NORM_FORMS:
        for slot in ("input_layernorm", "pre_mlp_layernorm"):
            changes[slot] = ModuleSpec(module=ScaledNorm, params={
                "inner": getattr(sub, slot), "clock": clock, "form": form})
    return with_submodules(spec, **changes)


def sinusoidal_embedding(value: float, dim: int, device=None) -> torch.Tensor:
    """[dim] float32: ``cos(value w_i)`` for i < dim / 2, then ``sin(value w_i)``, with
    ``w_i = 10000^(-i / (dim / 2))`` (LoopFormer's frequency embedding of t and of dt)."""
    half = dim // 2
    rates = torch.exp(torch.arange(half, dtype=torch.float32, device=device)
                      * (-math.log(10000.0) / half))
    angles = torch.tensor(value, dtype=torch.float32, device=device) * rates
    return torch.cat([torch.cos(angles), torch.sin(angles)])


class StepEmbedder(MegatronModule):
    """LoopFormer's c = E_t(t) + E_dt(dt): per input a sinusoidal embedding of ``frequency_dim``
    through Linear-SiLU-Linear (with biases) to the hidden size. Replicated over TP ranks
    (weights drawn from the CPU generator, seeded alike on every rank; biases 0)."""

    def __init__(self, config, frequency_dim: int):
        super().__init__(config=config)
        self.frequency_dim = frequency_dim
        d = config.hidden_size
        for name, fan_in in (("time_in", frequency_dim), ("time_out", d), ("size_in", frequency_dim),
                             ("size_out", d)):
            linear = torch.nn.Linear(fan_in, d, dtype=config.params_dtype)
            with torch.no_grad():
                weight = torch.empty(d, fan_in, dtype=torch.float32)
                config.init_method(weight)
                linear.weight.copy_(weight)
                linear.bias.zero_()
            for p in linear.parameters():
                p.sequence_parallel = config.sequence_parallel
            setattr(self, name, linear)

    def forward(self, t: float, dt: float, like: torch.Tensor) -> torch.Tensor:
        """c [d] for time t and step size dt, in ``like``'s dtype and device."""
        def embed(value, first, second):
            x = sinusoidal_embedding(value, self.frequency_dim, like.device).to(like.dtype)
            return F.linear(F.silu(F.linear(x, first.weight.to(like.dtype),
                                            first.bias.to(like.dtype))),
                            second.weight.to(like.dtype), second.bias.to(like.dtype))

        return embed(t, self.time_in, self.time_out) + embed(dt, self.size_in, self.size_out)


class TimestepConditioning(MegatronModule, LoopVariant):
    """The model-level part: the clock the core's conditioned modules read (built into the
    core's layer spec by ``conditioned_spec``), loop gating's q, and the loop-variant hooks."""

    def __init__(self, config, form: str, clock: StepHolder, train_loops: int, inference: str,
                 last: bool = True, frequency_dim: int = 256):
        super().__init__(config=config)
        if form not in FORMS:
            raise ValueError(f"unknown --timestep-conditioning {form!r}; choose one of none, "
                             f"{', '.join(FORMS)}")
        self.form, self.train_loops, self.inference = form, train_loops, inference
        self.clock = clock
        # LoopFormer: the step's embedder, shared by every core layer; the layers' modules reach
        # it through the clock (it is registered here, once, as ``timestep.embedder``).
        self.embedder = StepEmbedder(config, frequency_dim) if form == "loopformer" else None
        self.clock.embedder = self.embedder
        self.clock.value = self.features(1, train_loops)
        # Loop gating is used where a step ends: only the last pipeline stage owns it.
        self.loop_gate = _zeros((NUM_FEATURES,), config) \
            if form == "loop-gating" and last else None

    def features(self, step: int, num_loops: int, route: Optional[tuple] = None):
        """psi of loop step ``step`` (1-based) when ``num_loops`` loops are run; LoopFormer:
        (t, dt) = ((step - 1) / T, 1 / T), or on a route of step sizes dt_1..dt_T (LoopFormer's
        shorter routes), t = dt_1 + ... + dt_{step-1} and dt = dt_step."""
        if route is not None:
            if self.form != "loopformer" or len(route) != num_loops:
                raise ValueError(f"a route of {len(route)} step sizes is LoopFormer's, for as "
                                 f"many loops (here --timestep-conditioning {self.form}, "
                                 f"{num_loops} loops)")
            return (float(sum(route[:step - 1])), float(route[step - 1]))
        T = num_loops if self.inference == "rescaled" else self.train_loops
        if self.form == "loopformer":
            return ((step - 1) / T, 1.0 / T)
        return timestep_features(step - 1, T)

    def carry_slots(self, num_loops):
        """Loop gating reads the state that entered the step where the step ends."""
        return [Slot("entering")] if self.form == "loop-gating" else []

    def before_core(self, z, carry, t, ctx):
        if self.form == "loop-gating":
            carry.entering = carry.h  # before injection
        return z

    def around_core(self, run, z, attention_mask, rotary_pos_emb, t, ctx):
        """Condition this core pass on step t of T; mark its output so that activation
        recomputation re-selects step t before it re-runs the core."""
        psi = self.features(t, ctx.num_loops, ctx.route)
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


def build_timestep_conditioning(config, loop, clock: StepHolder, last: bool = True
                                ) -> Optional[TimestepConditioning]:
    """``clock``: the one the core's layer spec was conditioned with (``conditioned_spec``);
    ``last``: whether this pipeline stage ends each loop step (owns loop gating's q)."""
    if loop.timestep_conditioning == "none":
        return None
    return TimestepConditioning(config, loop.timestep_conditioning, clock, loop.num_loops,
                                loop.timestep_inference, last,
                                loop.timestep_frequency_dim)
