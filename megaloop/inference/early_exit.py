"""Early exit: per token, stop the loop once a rule says the answer is ready.

Rules (``--exit``):

- ``q:<q>`` (Ouro's Q-exit): stop at the first step t whose cumulative exit probability
  CDF_t = 1 - prod_{s<=t} (1 - lambda_s) reaches q (lambda_s = sigmoid of the exit gate);
- ``kl:<eps>`` (Huginn): stop at the first step t >= 2 where KL(p_t || p_{t-1}) between the
  next-token distributions of successive steps is below eps;
- ``fixed:<n>``: always n steps (the same as running ``--num-loops n``).

Every rule stops at T at the latest. In decoding (``decode_step``) a token's steps run through
the recurrence's own ``step`` (megaloop/model/recurrence.py) on the rows still going: a row that
exits leaves the batch (the carry and the KV caches are compacted to the remaining rows, not
masked), so its later steps cost nothing. A token that exits at step t has no K/V at later
steps; they are filled with its step-t K/V, so the tokens after it attend to it at every step
(the choice Ouro-style "exit = stop updating the state" implies: its state stays h_t).

``score`` applies the same rule in teacher-forced scoring: the loss of each token at its exit
step and the mean executed depth, so a rule's quality cost is measurable on held-out text.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from megaloop.model import recurrence


@dataclass
class ExitRule:
    kind: str
    """``q``, ``kl`` or ``fixed``."""
    value: float


def parse_exit(text: Optional[str]) -> Optional[ExitRule]:
    """``q:0.5`` | ``kl:1e-3`` | ``fixed:2`` | None."""
    if not text or text == "none":
        return None
    kind, _, value = text.partition(":")
    try:
        rule = ExitRule(kind, float(value))
    except ValueError:
        rule = None
    if rule is None or kind not in ("q", "kl", "fixed") or rule.value < 0 or (
            kind == "q" and not 0 < rule.value <= 1) or (kind == "fixed" and rule.value < 1):
        raise ValueError(f"--exit {text!r}: write q:<q in (0, 1]>, kl:<eps >= 0> or "
                         f"fixed:<steps >= 1>")
    return rule


def successive_kl(logp: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """KL(p_t || p_{t-1}) over the last dimension, from log-probs. Clamped at 0: where two steps
    agree to rounding (a recurrence at its fixed point) the sum can come out at -1e-9, and
    ``kl:0`` ("never exit early") must not then exit."""
    return (logp.exp() * (logp - previous)).sum(-1).clamp_min(0)


def full_vocab_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel logits [..., v/tp] -> full log-probabilities [..., V] (fp32)."""
    from megatron.core import tensor_parallel

    return F.log_softmax(
        tensor_parallel.gather_from_tensor_model_parallel_region(logits).float(), dim=-1)


class _Decision:
    """Per-row exit bookkeeping of one token (rows indexed in the full batch)."""

    def __init__(self, rule: ExitRule, batch: int, num_loops: int, device):
        self.rule, self.T = rule, num_loops
        self.log_survival = torch.zeros(batch, device=device)
        self.previous = None  # [b, V] log-probs of the previous step (kl)

    def exits(self, t: int, rows, out) -> torch.Tensor:
        """Bool [len(rows)]: which of the running ``rows`` stop after step t."""
        if t >= self.T:
            return torch.ones(len(rows), dtype=torch.bool, device=rows.device)
        kind, value = self.rule.kind, self.rule.value
        if kind == "fixed":
            return torch.full((len(rows),), t >= value, dtype=torch.bool, device=rows.device)
        if kind == "q":
            self.log_survival[rows] += F.logsigmoid(-out.gate_logit[:, -1].float())
            return 1 - self.log_survival[rows].exp() >= value
        logp = full_vocab_log_probs(out.logits[-1])  # [rows, V]
        if self.previous is None:
            self.previous = torch.zeros(len(self.log_survival), logp.size(-1),
                                        device=logp.device)
            stop = torch.zeros(len(rows), dtype=torch.bool, device=rows.device)
        else:
            stop = successive_kl(logp, self.previous[rows]) < value
        self.previous[rows] = logp
        return stop


@torch.no_grad()
def decode_step(model, ids, position_ids, kv, num_loops: int, rule: ExitRule):
    """One new token per row (ids [b, 1]) with early exit: (vocab-parallel logits [b, 1, v/tp]
    of each row's exit step, exit step per row [b]). The caller advances ``kv``."""
    b = ids.size(0)
    ctx = recurrence.context(model, ids, None, None, num_loops, kv)
    ctx.read_every_step = True
    carry = recurrence.begin(model, ids, position_ids, ctx)
    running = torch.arange(b, device=ids.device)
    decision = _Decision(rule, b, num_loops, ids.device)
    logits, depth = None, torch.zeros(b, dtype=torch.long, device=ids.device)
    position = kv.offset
    for t in range(1, num_loops + 1):
        compact = len(running) < b
        with kv.rows(running) if compact else contextlib.nullcontext():
            carry, out = recurrence.step(model, carry, t, ctx)
        if logits is None:
            logits = out.logits.new_zeros((b,) + tuple(out.logits.shape[2:]))
        stop = decision.exits(t, running, out)
        done = running[stop]
        if len(done):
            logits[done] = out.logits[-1][stop]
            depth[done] = t
            kv.fill_exited(done, position, t, num_loops)
        keep = ~stop
        if not keep.any():
            break
        local = keep.nonzero().squeeze(-1)
        carry, running = carry.index_rows(local), running[keep]
    return logits.unsqueeze(1), depth


@torch.no_grad()
def prefill(model, ids, position_ids, kv, num_loops: int):
    """The prompt through all T steps, reading out at every step so that the coda's cache of
    every step holds the prompt (a later token may exit at any step): last-step logits
    [b, s, v/tp]. The caller advances ``kv``."""
    ctx = recurrence.context(model, ids, None, None, num_loops, kv)
    ctx.read_every_step = True
    carry = recurrence.begin(model, ids, position_ids, ctx)
    for t in range(1, num_loops + 1):
        carry, out = recurrence.step(model, carry, t, ctx)
    return out.logits.transpose(0, 1)


class _TeacherForced:
    """The exit decision of every position of a teacher-forced sequence, step by step."""

    def __init__(self, rule: Optional[ExitRule], num_loops: int, shape, device):
        self.rule, self.T = rule, num_loops
        self.log_survival = torch.zeros(shape, device=device)
        self.previous = None  # [b, s, V] log-probs of the previous step (kl)

    def stops(self, t: int, out, logp=None) -> torch.Tensor:
        """Bool [b, s]: which positions stop after step t (``logp``: full-vocab log-probs
        [b, s, V] of the step when the caller already has them)."""
        shape = self.log_survival.shape
        rule = self.rule
        if t == self.T or rule is None:
            return torch.full(shape, t == self.T, dtype=torch.bool,
                              device=self.log_survival.device)
        if rule.kind == "fixed":
            return torch.full(shape, t >= rule.value, dtype=torch.bool,
                              device=self.log_survival.device)
        if rule.kind == "q":
            self.log_survival = self.log_survival + F.logsigmoid(-out.gate_logit.float())
            return 1 - self.log_survival.exp() >= rule.value
        if logp is None:
            logp = full_vocab_log_probs(out.logits).transpose(0, 1)
        stop = torch.zeros(shape, dtype=torch.bool, device=logp.device) \
            if self.previous is None else successive_kl(logp, self.previous) < rule.value
        self.previous = logp
        return stop


@torch.no_grad()
def score(model, ids, position_ids, labels, num_loops: int, rule: Optional[ExitRule],
          attention_mask=None):
    """Teacher-forced scoring under an exit rule: (per-token LM loss at each token's exit step
    [b, s], exit step [b, s]). Without a rule: the last step's loss, depth T."""
    ctx = recurrence.context(model, ids, attention_mask, None, num_loops)
    ctx.read_every_step = True
    carry = recurrence.begin(model, ids, position_ids, ctx)
    loss = torch.zeros(labels.shape, device=labels.device)
    depth = torch.zeros(labels.shape, dtype=torch.long, device=labels.device)
    running = torch.ones(labels.shape, dtype=torch.bool, device=labels.device)
    decision = _TeacherForced(rule, num_loops, labels.shape, labels.device)
    for t in range(1, num_loops + 1):
        carry, out = recurrence.step(model, carry, t, ctx)
        # (megatron-core's vocab-parallel cross-entropy overwrites its input: give it a copy)
        step_loss = model.compute_language_model_loss(labels, out.logits.clone()).float()
        now = running & decision.stops(t, out)
        loss[now], depth[now] = step_loss[now], t
        running &= ~now
    return loss, depth


@torch.no_grad()
def exit_log_probs(model, ids, position_ids, num_loops: int, rule: Optional[ExitRule],
                   vocab_size: int, attention_mask=None):
    """Teacher-forced next-token log-probabilities [b, s, vocab_size] (fp32, full vocabulary,
    the padded rows dropped) of every position at its exit step under ``rule`` (None: step T),
    and the exit step [b, s]."""
    from megatron.core import tensor_parallel

    ctx = recurrence.context(model, ids, attention_mask, None, num_loops)
    ctx.read_every_step = rule is not None
    carry = recurrence.begin(model, ids, position_ids, ctx)
    shape = ids.shape
    result, depth = None, torch.zeros(shape, dtype=torch.long, device=ids.device)
    running = torch.ones(shape, dtype=torch.bool, device=ids.device)
    decision = _TeacherForced(rule, num_loops, shape, ids.device)
    for t in range(1, num_loops + 1):
        carry, out = recurrence.step(model, carry, t, ctx)
        if rule is None and t < num_loops:
            continue
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(out.logits)
        logp = F.log_softmax(logits[..., :vocab_size].float(), dim=-1).transpose(0, 1)
        now = running & decision.stops(t, out, None if rule is None or rule.kind != "kl"
                                       else full_vocab_log_probs(out.logits).transpose(0, 1))
        if result is None:
            result = torch.zeros_like(logp)
        result[now], depth[now] = logp[now], t
        running &= ~now
    return result, depth
