"""The exit objective, accumulated one loop step at a time.

Per token, with halting probabilities lambda_t = sigmoid(g_t) from the exit gate:

    p_t = lambda_t * prod_{s<t} (1 - lambda_s)      (t < T)
    p_T = prod_{s<T} (1 - lambda_s)                   (the last step takes the rest)
    expected:  sum_t p_t L_t + beta * KL(p || U_T)
    smoothed:  (1 - eps) sum_t p_t L_t + eps/T sum_t L_t + beta * KL(p || U_T)
    last:      L_T

The objective is written as a fold over steps (running log-survival, weighted loss, sum of
p log p) because a pipeline-parallel run sees one step per virtual chunk: these per-token
accumulators are exactly what must travel with the activations. Everything stays in log space
so p log p is finite when the gate saturates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from megaloop.model.carry import SIDE, Slot


@dataclass
class ExitObjective:
    """Streaming exit objective over T steps; tensors are per token, shape [b, s]."""

    num_loops: int
    mode: str = "expected"
    beta: float = 0.0
    smoothing: float = 0.0
    log_survival: Optional[torch.Tensor] = None
    weighted: Optional[torch.Tensor] = None
    uniform: Optional[torch.Tensor] = None
    p_log_p: Optional[torch.Tensor] = None
    last: Optional[torch.Tensor] = None
    step: int = 0
    gate_k: float = 50.0
    """`adaptive-gate`: steepness of the continue target."""
    gate_gamma: float = 0.005
    """`adaptive-gate`: loss improvement at which the continue target is 0.5."""
    bce: Optional[torch.Tensor] = None
    previous_loss: Optional[torch.Tensor] = None
    step_losses: list = field(default_factory=list)
    """Per-step per-token losses (detached), for logging; None where a step was not read out."""
    exit_probs: list = field(default_factory=list)
    """Per-step per-token p_t (detached), for logging."""

    def add_step(self, loss: Optional[torch.Tensor], gate_logit: Optional[torch.Tensor]) -> None:
        """Fold in step t = self.step + 1: its per-token LM loss and (for t < T) its gate logit."""
        self.step += 1
        t, T = self.step, self.num_loops
        if t > T:
            raise RuntimeError(f"step {t} added to an objective over {T} steps")
        self.step_losses.append(None if loss is None else loss.detach())
        if self.mode == "last":
            if t == T:
                self.last = loss
            return
        if loss is None:
            raise ValueError(f"exit loss {self.mode!r} needs the loss of every step")
        if self.mode == "adaptive-gate":
            self._adaptive_gate_step(t, loss, gate_logit)
            return
        p = self._gate_terms(gate_logit, loss)
        self.weighted = self.weighted + p * loss
        self.uniform = self.uniform + loss

    def add_gate(self, gate_logit: torch.Tensor) -> torch.Tensor:
        """Fold in step t = self.step + 1 < T without its LM loss, which is read out elsewhere
        (a pipeline's first stage, one step later): the gate's terms only. Returns the step's
        loss weight w_t (``loss_weight``, with gradient): the objective owes ``w_t * L_t`` more,
        added where L_t is computed."""
        if self.mode not in ("expected", "smoothed"):
            raise ValueError(f"exit loss {self.mode!r} cannot read a step's loss elsewhere")
        self.step += 1
        if self.step >= self.num_loops:
            raise RuntimeError(f"step {self.step} of {self.num_loops}: only a step before the "
                               f"last can leave its loss to be read out elsewhere")
        self.step_losses.append(None)
        return self.loss_weight(self._gate_terms(gate_logit, gate_logit))

    def loss_weight(self, p: torch.Tensor) -> torch.Tensor:
        """The weight of step t's per-token loss L_t in the objective, from its exit
        probability p_t: p_t (expected) or (1 - eps) p_t + eps / T (smoothed)."""
        if self.mode == "smoothed":
            return (1 - self.smoothing) * p + self.smoothing / self.num_loops
        return p

    def _gate_terms(self, gate_logit, like: torch.Tensor) -> torch.Tensor:
        """Step t's exit probability p_t (returned) and its survival and KL terms."""
        t, T = self.step, self.num_loops
        if self.log_survival is None:
            self.log_survival = torch.zeros_like(like)
            self.weighted = torch.zeros_like(like)
            self.uniform = torch.zeros_like(like)
            self.p_log_p = torch.zeros_like(like)
        if t < T:
            log_p = self.log_survival + F.logsigmoid(gate_logit)
            self.log_survival = self.log_survival + F.logsigmoid(-gate_logit)
        else:
            log_p = self.log_survival
        p = log_p.exp()
        self.exit_probs.append(p.detach())
        self.p_log_p = self.p_log_p + p * log_p
        return p

    def _adaptive_gate_step(self, t: int, loss: torch.Tensor, gate_logit: torch.Tensor) -> None:
        """Ouro stage II: I_t = max(0, L_{t-1} - L_t) (detached), continue target
        w_t = sigmoid(k (I_t - gamma)), BCE -(w_t log(1 - lambda_t) + (1 - w_t) log lambda_t)
        for t = 2..T, averaged over those steps. lambda_t is the exit probability of the gate
        read at step t (every step, T included, has a gate in this mode)."""
        loss = loss.detach()
        if self.log_survival is None:
            self.log_survival = torch.zeros_like(loss)
            self.bce = torch.zeros_like(loss)
        if t > 1:
            improvement = (self.previous_loss - loss).clamp_min(0.0)
            target = torch.sigmoid(self.gate_k * (improvement - self.gate_gamma))
            self.bce = self.bce - (target * F.logsigmoid(-gate_logit)
                                   + (1 - target) * F.logsigmoid(gate_logit))
        self.previous_loss = loss
        # The exit distribution the gate implies (for logging), as in the other modes.
        log_p = self.log_survival + F.logsigmoid(gate_logit) if t < self.num_loops \
            else self.log_survival
        self.log_survival = self.log_survival + F.logsigmoid(-gate_logit)
        self.exit_probs.append(log_p.exp().detach())

    @staticmethod
    def carry_slots(num_loops: int, mode: str) -> list:
        """The accumulators a later step reads, as carry slots (megaloop/model/carry.py) named
        as the fields ``resume`` takes: the log-survival, and adaptive-gate's previous loss."""
        if num_loops == 1 or mode == "last":
            return []
        slots = [Slot("log_survival", SIDE)]
        return slots + [Slot("previous_loss", SIDE)] if mode == "adaptive-gate" else slots

    @classmethod
    def resume(cls, num_loops: int, mode: str, beta: float, smoothing: float, *,
               steps_done: int, log_survival: Optional[torch.Tensor] = None,
               previous_loss: Optional[torch.Tensor] = None, gate_k: float = 50.0,
               gate_gamma: float = 0.005) -> "ExitObjective":
        """Continue a fold whose first ``steps_done`` steps ran before (an earlier loop step,
        maybe on another pipeline stage). Going on needs only the running log-survival (and, for
        adaptive-gate training, the previous step's loss); the summed terms restart at zero, so
        ``share()`` of the result is the part of the objective owed to the steps folded here,
        and the shares of all steps add up to ``per_token()`` of one uninterrupted fold."""
        obj = cls(num_loops, mode, beta, smoothing, step=steps_done, gate_k=gate_k,
                  gate_gamma=gate_gamma, previous_loss=previous_loss)
        if log_survival is not None:
            zero = torch.zeros_like(log_survival)
            obj.log_survival, obj.weighted, obj.uniform, obj.p_log_p = log_survival, zero, zero, zero
            obj.bce = zero
        return obj

    def per_token(self) -> torch.Tensor:
        """The per-token objective after all T steps."""
        if self.step != self.num_loops:
            raise RuntimeError(f"objective read after {self.step} of {self.num_loops} steps")
        return self.share()

    def share(self) -> Optional[torch.Tensor]:
        """The per-token terms of the steps folded so far; the constant beta * log T of the KL
        joins with the last step (``last`` mode: the final loss, None before step T)."""
        if self.mode == "last":
            return self.last
        if self.mode == "adaptive-gate":
            return self.bce / max(self.num_loops - 1, 1)
        kl = self.p_log_p  # sum_t p_t log(p_t / (1/T)) = sum_t p_t log p_t + log T
        if self.step == self.num_loops:
            kl = kl + math.log(self.num_loops)
        if self.mode == "expected":
            lm = self.weighted
        elif self.mode == "smoothed":
            lm = (1 - self.smoothing) * self.weighted + self.smoothing / self.num_loops * self.uniform
        else:
            raise ValueError(f"unknown --exit-loss {self.mode!r}")
        return lm + self.beta * kl

    def kl(self) -> Optional[torch.Tensor]:
        """Per-token KL(p || uniform), detached (None in `last` mode)."""
        if self.mode == "last":
            return None
        return (self.p_log_p + math.log(self.num_loops)).detach()
