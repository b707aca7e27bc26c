"""Input injection: what enters the core before each loop step, and the history of past states.

Before step 1 the injection keeps its *source* -- the token embedding e or the prelude output
h_0 (``--injection-source``) -- in the loop's carry, and before a core pass mixes the current
state with it (the recurrence's hooks, megaloop/model/recurrence.py):

    z_t = inject(h_{t-1}, src)

Every form is a module with ``forward(h, source) -> z``, registered in ``INJECTIONS`` under its
``--input-injection`` name. Its ``every_step`` attribute says whether it also runs before the
first pass: the scalar mix of "Closing the Loop" (arXiv 2610.00673) (Eq. 1) mixes "for t > 0" only
(and with no prelude h_0 *is* the source), while the initial-state forms of "What Makes Recurrence
Effective in Looped Language Models?" (arXiv 2609.36636) and Huginn's adapter run before *every*
core pass.

- `scalar-mix` (Closing the Loop Eq. 1): ``w src + (1 - w) h``, ``w = sigmoid(a)``, w starts at
  0.99;
- `scalar` (What Makes Recurrence Effective): ``h + alpha src``, alpha = 0;
- `channel-wise` (What Makes Recurrence Effective): ``a * h + b * src``, a = 1, b = 0 (vectors over
  the hidden size);
- `residual-channel-wise` (What Makes Recurrence Effective): ``(1 + da) * h + b * src``, da = b = 0;
- `dense` (What Makes Recurrence Effective): ``W_h h + W_0 src``, one [d, 2d] matrix initialised to
  [I 0];
- `concat-linear` (Huginn, Geiping et al. 2025): ``W [h; src]``, the same [d, 2d] matrix with a
  random normal initialisation (std --init-method-std), so *not* the identity at start;
- `parcae` ("Parcae", arXiv 2604.12946; its code calls it the diagonal injection, named here after
  the paper since `channel-wise` is already a diagonal form): ``exp(-dt A) * h + dt * (B src)``
  with ``dt = softplus(dt_bias)`` and ``A = exp(A_log)`` vectors over the hidden size and B a
  dense [d, d] matrix: a discretised linear system whose decay exp(-dt A) is in (0, 1) for any
  parameters. Starts at A_log = 0, decay sqrt(1/5) on every channel, B = I.

``--injection-source-norm`` normalizes the source once in ``begin`` (a learnable norm of
--normalization owned by the injection module): Parcae injects the prelude output after one
RMSNorm.

The What Makes Recurrence Effective forms are initialised to the identity on h, so a model with them
starts equal to the plain model. The source and history-state injection's window of completed
states (What Makes Recurrence Effective, ``HistoryInjection``) are carry slots these modules
declare (megaloop/model/carry.py), so the modules stay stateless and their state travels between
pipeline stages with the activation. The modules are built on every pipeline stage (every stage
lays the carry out alike); their parameters live on the first, where they run.

Tensor parallelism: every injection parameter (including the [d, 2d] matrices) is *replicated*
on all TP ranks, not sharded: the hidden state entering the core is full on every rank, the
core's first column-parallel linear all-reduces its input gradient, so every rank computes the
same, complete gradient. Under sequence parallelism each rank sees a slice of the tokens; the
parameters then carry megatron-core's ``sequence_parallel`` tag and their gradients are summed
over the TP group like a norm's. The replicated dense matrix costs 2 d^2 parameters per rank.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from megaloop.model.carry import Slot
from megaloop.model.recurrence import LoopVariant


def _replicated(param: torch.nn.Parameter, config) -> torch.nn.Parameter:
    """Tag a TP-replicated parameter: summed over the TP group under sequence parallelism."""
    param.sequence_parallel = config.sequence_parallel
    return param


class _Injection(MegatronModule, LoopVariant):
    """The loop-variant side of every input injection: ``z = inject(z, source)`` before the core
    (before every pass, or from the second on when ``every_step`` is False). ``source_of``: the
    ``--injection-source`` (``embedding`` or ``prelude``)."""

    every_step = True
    source_of = "embedding"

    def carry_slots(self, num_loops):
        return [Slot("source")] if num_loops > 1 or self.every_step else []

    def begin(self, carry, ctx, embedded):
        if self.carry_slots(ctx.num_loops):
            source = carry.h if self.source_of == "prelude" else embedded
            # --injection-source-norm: a submodule ``source_norm`` (build_injection) applied once
            norm = getattr(self, "source_norm", None)
            carry.source = source if norm is None else norm(source)

    def before_core(self, z, carry, t, ctx):
        if t > 1 or self.every_step:
            return self(z, carry.source)
        return z


class ScalarMix(_Injection):
    """Closing the Loop Eq. 1: ``z = w * src + (1 - w) * h`` with ``w = sigmoid(a)``, a single
    learned scalar.

    The scalar is replicated on every tensor-parallel rank (each rank holds the full hidden
    vector, or under sequence parallelism a slice of the tokens). In the latter case each rank's
    gradient of ``a`` covers only its tokens, so the parameter carries megatron-core's
    ``sequence_parallel`` tag and the gradient is summed over the TP group like a norm's.
    """

    def __init__(self, config, init_weight: float, first: bool = True):
        super().__init__(config=config)
        if not 0.0 < init_weight < 1.0:
            raise ValueError(f"--injection-init-weight {init_weight} must be in (0, 1); "
                             "w = sigmoid(a) never reaches 0 or 1 exactly")
        # a = logit(w), so that sigmoid(a) starts at exactly the requested mixing weight.
        a = math.log(init_weight / (1.0 - init_weight))
        if first:
            self.logit = torch.nn.Parameter(torch.full((1,), a, dtype=config.params_dtype))
            self.logit.sequence_parallel = config.sequence_parallel

    every_step = False  # Closing the Loop mixes for t > 0 only

    @property
    def weight(self) -> float:
        """The current mixing weight w (for logging)."""
        return torch.sigmoid(self.logit.detach().float()).item()

    def forward(self, h: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        w = torch.sigmoid(self.logit.float()).to(h.dtype)
        return w * source + (1.0 - w) * h


class InitialStateInjection(_Injection):
    """What Makes Recurrence Effective's element-wise initial-state forms: ``a * h + b * src`` with
    a and b scalars or vectors over the hidden size; ``residual`` stores a as ``1 + da``. Starts as
    the identity."""

    every_step = True

    def __init__(self, config, channels: int, residual: bool, with_a: bool = True,
                 first: bool = True):
        super().__init__(config=config)
        dtype, self.residual = config.params_dtype, residual
        if not first:
            return
        # a = 1 (or da = 0) and b = 0: z = h exactly at initialisation.
        self.a = _replicated(torch.nn.Parameter(torch.full(
            (channels,), 0.0 if residual else 1.0, dtype=dtype)), config) if with_a else None
        self.b = _replicated(torch.nn.Parameter(torch.zeros(channels, dtype=dtype)), config)

    def forward(self, h: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        if self.a is None:
            z = h
        elif self.residual:
            z = h + self.a * h
        else:
            z = self.a * h
        return z + self.b * source


class ConcatLinear(_Injection):
    """``W [h; src]`` with W [d, 2d] replicated over TP ranks: What Makes Recurrence Effective's
    dense form (W = [I 0] at init, i.e. ``W_h h + W_0 src`` with W_h = I, W_0 = 0) or Huginn's
    adapter (random W)."""

    every_step = True

    def __init__(self, config, identity_init: bool, seed: int, first: bool = True):
        super().__init__(config=config)
        d = config.hidden_size
        if not first:
            return
        if identity_init:
            weight = torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1)
        else:
            # A private generator seeded identically on every rank: the replicated matrix starts
            # equal on all ranks, and the global RNG stream (later inits, dropout) is untouched.
            generator = torch.Generator().manual_seed(seed)
            weight = torch.randn(d, 2 * d, generator=generator) * config.init_method_std
        self.weight = _replicated(torch.nn.Parameter(weight.to(config.params_dtype)), config)

    def forward(self, h: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.cat([h, source], dim=-1), self.weight.to(h.dtype))


class ParcaeInjection(_Injection):
    """Parcae's state injection: ``exp(-dt A) * h + dt * (B src)``, ``dt = softplus(dt_bias)``,
    ``A = exp(A_log)`` per channel, B [d, d]; all three replicated over TP ranks. The decay and dt
    are computed in fp32 from the parameters. Initialised as Parcae's code does: A_log = 0
    (A = 1), dt_bias = softplus^-1(-log(sqrt(1/5))) (decay sqrt(1/5) ~ 0.447, dt ~ 0.805), B = I."""

    every_step = True  # Parcae injects before every core pass, the first included
    INITIAL_DECAY = math.sqrt(1.0 / 5.0)

    def __init__(self, config, first: bool = True):
        super().__init__(config=config)
        if not first:
            return
        d, dtype = config.hidden_size, config.params_dtype
        dt = -math.log(self.INITIAL_DECAY)
        dt_bias = dt + math.log(-math.expm1(-dt))  # softplus(dt_bias) = dt
        self.A_log = _replicated(torch.nn.Parameter(torch.zeros(d, dtype=dtype)), config)
        self.dt_bias = _replicated(torch.nn.Parameter(torch.full((d,), dt_bias, dtype=dtype)),
                                   config)
        self.B = _replicated(torch.nn.Parameter(torch.eye(d, dtype=dtype)), config)

    def rates(self):
        """(decay, dt): exp(-softplus(dt_bias) exp(A_log)) and softplus(dt_bias), fp32 [d]."""
        dt = F.softplus(self.dt_bias.float())
        return torch.exp(-dt * torch.exp(self.A_log.float())), dt

    def forward(self, h: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        decay, dt = self.rates()
        return decay.to(h.dtype) * h + dt.to(h.dtype) * F.linear(source, self.B.to(h.dtype))


INJECTIONS = {
    "scalar-mix": lambda config, loop, seed, first: ScalarMix(
        config, loop.injection_init_weight, first),
    "scalar": lambda config, loop, seed, first: InitialStateInjection(
        config, 1, False, with_a=False, first=first),
    "channel-wise": lambda config, loop, seed, first: InitialStateInjection(
        config, config.hidden_size, residual=False, first=first),
    "residual-channel-wise": lambda config, loop, seed, first: InitialStateInjection(
        config, config.hidden_size, residual=True, first=first),
    "dense": lambda config, loop, seed, first: ConcatLinear(
        config, identity_init=True, seed=seed, first=first),
    "concat-linear": lambda config, loop, seed, first: ConcatLinear(
        config, identity_init=False, seed=seed, first=first),
    "parcae": lambda config, loop, seed, first: ParcaeInjection(config, first),
}


def build_injection(config, loop, seed: int = 0, first: bool = True
                    ) -> Optional[MegatronModule]:
    """The injection module of ``loop.input_injection`` (None for ``none``); ``first``: whether
    this pipeline stage starts each loop step (owns the parameters)."""
    if loop.input_injection == "none":
        return None
    if loop.input_injection not in INJECTIONS:
        raise ValueError(f"unknown --input-injection {loop.input_injection!r}; choose one of "
                         f"none, {', '.join(INJECTIONS)}")
    module = INJECTIONS[loop.input_injection](config, loop, seed, first)
    module.source_of = loop.injection_source
    if loop.injection_source_norm and first:
        from megaloop.model.specs import build_norm

        # (megatron-core's local norm of --normalization on either backend: one small norm)
        module.source_norm = build_norm(config, False, "rms")
    return module


class HistoryInjection(MegatronModule, LoopVariant):
    """What Makes Recurrence Effective history-state injection: ``z_l = h_l + sum_{j=1..m_l} B_j
    (h_{l-j} - h_l)``.

    ``m_l = min(w, max(l - 1, 0))``: the window holds the completed states h_1 .. h_{l-1} (h_0,
    the prelude output, is excluded), so the first two core passes see no history. One B_j per
    lag j, shared over iterations: a scalar, a channel vector or a dense [d, d] matrix; all start
    at 0 (the plain model). The states are not detached: gradients flow through the window.
    Replicated over TP ranks like the initial-state forms (see the module docstring).
    """

    def __init__(self, config, kind: str, window: int, first: bool = True):
        super().__init__(config=config)
        d = config.hidden_size
        shapes = {"scalar": (window, 1), "channel-wise": (window, d), "dense": (window, d, d)}
        if kind not in shapes:
            raise ValueError(f"unknown --history-injection {kind!r}; choose one of none, "
                             f"{', '.join(shapes)}")
        self.kind, self.window = kind, window
        if first:
            self.weight = _replicated(torch.nn.Parameter(
                torch.zeros(shapes[kind], dtype=config.params_dtype)), config)

    def carry_slots(self, num_loops):
        # Step t reads h_1 .. h_{t-2}: the window is first read at step 3.
        return [Slot("history", count=self.window)] if num_loops > 2 else []

    def before_core(self, z, carry, t, ctx):
        """Mix the window into z, then add h_{t-1} (the state entering step t) to the window
        that later steps read."""
        if t < 3:  # no completed state yet (and no window at T <= 2)
            past = []
        else:  # h_1 .. h_{t-2}, the last w of them (a window from another stage has all w)
            past = carry.history[:min(self.window, t - 2)]
            z = self(z, past)
        if 1 < t < ctx.num_loops:
            carry.history = (past + [carry.h])[-self.window:]
        return z

    def forward(self, h: torch.Tensor, past: list) -> torch.Tensor:
        """``past``: completed states before h, oldest first (h_1 .. h_{l-1})."""
        z = h
        for j in range(1, min(self.window, len(past)) + 1):
            diff = past[-j] - h
            b = self.weight[j - 1].to(h.dtype)
            z = z + (F.linear(diff, b) if self.kind == "dense" else b * diff)
        return z


def build_history_injection(config, loop, first: bool = True) -> Optional[HistoryInjection]:
    """The history-state injection of ``loop.history_injection`` (None for ``none``)."""
    if loop.history_injection == "none":
        return None
    return HistoryInjection(config, loop.history_injection, loop.history_window, first)
