"""Early-exit rules (``--exit``): after loop step t, may a token stop?

- ``q:<q>`` (Ouro's Q-exit): stop at the first step t whose cumulative exit probability
  CDF_t = 1 - prod_{s<=t} (1 - lambda_s) reaches q (lambda_s = sigmoid of the exit gate). The
  product is the survival the exit objective carries from step to step (``Carry.log_survival``,
  megaloop/model/objective.py), so CDF_t = 1 - exp(log-survival after step t);
- ``kl:<eps>`` (Huginn): stop at the first step t >= 2 where KL(p_t || p_{t-1}) between the
  next-token distributions of successive steps is below eps;
- ``huginn-kl:<eps>``: Huginn's own KL criterion, the other direction, KL(p_{t-1} || p_t), from
  step 1 on, p_0 being the uniform distribution over the vocabulary table;
- ``fixed:<n>``: always n steps (the same as running ``--num-loops n``).

A rule decides elementwise on the tokens it is shown: the rows of one decoded token, or every
position of a teacher-forced sequence. The recurrence's fold (megaloop/model/recurrence.py)
applies it either way (``Stop``) and stops every token at T at the latest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass
class ExitRule:
    kind: str
    """``q``, ``kl``, ``huginn-kl`` or ``fixed``."""
    value: float

    @property
    def text(self) -> str:
        """The rule as ``--exit`` writes it."""
        return f"{self.kind}:{self.value:g}"

    @property
    def reads_survival(self) -> bool:
        """Whether ``stops`` needs the carried log-survival (the exit gate's)."""
        return self.kind == "q"

    @property
    def reads_log_probs(self) -> bool:
        """Whether ``stops`` needs the step's next-token log-probabilities (and the last
        step's)."""
        return self.kind in ("kl", "huginn-kl")

    def stops(self, t: int, shape, device, log_survival: Optional[torch.Tensor],
              log_probs: Optional[torch.Tensor], previous: Optional[torch.Tensor]):
        """Bool ``shape`` on ``device``: which tokens stop after step t (< T).
        ``log_survival``: the carried log prod_{s<=t} (1 - lambda_s) (``q``);
        ``log_probs`` / ``previous``: full-vocabulary log-probabilities [*shape, V] of steps t and
        t - 1 (``kl``; ``previous`` None at the first step)."""
        if self.kind == "fixed":
            return torch.full(shape, t >= self.value, dtype=torch.bool, device=device)
        if self.kind == "q":
            # CDF_t >= q, as log-survival <= log(1 - q): 1 - exp(s) rounds to 1 once s < -17
            # in fp32, so ``q:1`` would fire on a confident gate, while no sigmoid product
            # reaches 0 (q:1 is "never before T").
            bound = math.log1p(-self.value) if self.value < 1 else -math.inf
            return log_survival.float() <= bound
        if self.kind == "huginn-kl":
            if previous is None:  # p_0: uniform over the table's rows
                previous = torch.full_like(log_probs, -math.log(log_probs.size(-1)))
            return successive_kl(previous, log_probs) < self.value
        if previous is None:
            return torch.zeros(shape, dtype=torch.bool, device=device)
        return successive_kl(log_probs, previous) < self.value


def parse_exit(text: Optional[str]) -> Optional[ExitRule]:
    """``q:0.5`` | ``kl:1e-3`` | ``huginn-kl:1e-3`` | ``fixed:2`` | None."""
    if not text or text == "none":
        return None
    kind, _, value = text.partition(":")
    try:
        rule = ExitRule(kind, float(value))
    except ValueError:
        rule = None
    if rule is None or kind not in ("q", "kl", "huginn-kl", "fixed") or rule.value < 0 or (
            kind == "q" and not 0 < rule.value <= 1) or (kind == "fixed" and rule.value < 1):
        raise ValueError(f"--exit {text!r}: write q:<q in (0, 1]>, kl:<eps >= 0>, "
                         f"huginn-kl:<eps >= 0> or fixed:<steps >= 1>")
    return rule


def successive_kl(logp: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """KL(p_t || p_{t-1}) over the last dimension, from log-probs. Clamped at 0: where two steps
    agree to rounding (a recurrence at its fixed point) the sum can come out at -1e-9, and
    ``kl:0`` ("never exit early") must not then exit."""
    return (logp.exp() * (logp - previous)).sum(-1).clamp_min(0)


def full_vocab_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel logits [..., v/tp] -> full log-probabilities [..., V] (fp32)."""
    from megaloop.model.readout import gather_logits

    return F.log_softmax(
        gather_logits(logits).float(), dim=-1)
