"""Early exit: per token, stop the loop once a rule says the answer is ready.

The rules (``--exit``: ``q:<q>``, ``kl:<eps>``, ``fixed:<n>``) are megaloop/model/exit_rules.py;
the recurrence's fold (megaloop/model/recurrence.py) applies them after every step. This module's
functions are its callers:

- ``decode_step``: one new token per row, per row: a row that exits leaves the batch (the carry
  and the KV caches are compacted to the remaining rows, not masked), so its later steps cost
  nothing. A token that exits at step t has no K/V at later steps; they are filled with its
  step-t K/V, so the tokens after it attend to it at every step (the choice Ouro-style "exit =
  stop updating the state" implies: its state stays h_t);
- ``prefill``: the prompt through every step, read out at each (a later token may exit at any
  step, and the coda's cache of each step must hold the prompt); under a rule the last
  position's logits are read at the step the rule picks for it, so the first generated token
  follows the rule too;
- ``score`` and ``exit_log_probs``: the same rule teacher-forced, per token (masked): the loss or
  the log-probabilities of each token at its exit step, so a rule's quality cost is measurable
  on held-out text and lm-eval scores what decoding would run.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megaloop.model import layer_forward, recurrence
from megaloop.model.exit_rules import ExitRule, parse_exit  # noqa: F401  (the --exit parser)


@torch.no_grad()
def decode_step(model, ids, position_ids, kv, num_loops: int, rule: ExitRule,
                attention_mask=None):
    """One new token per row (ids [b, 1]) with early exit: (vocab-parallel logits [b, 1, v/tp]
    of each row's exit step, exit step per row [b]). The caller advances ``kv``.
    ``attention_mask`` [b, 1, 1, sk] (the batching engine's per-row padding) follows the rows
    that go on to the next step."""
    b = ids.size(0)
    ctx = recurrence.context(model, ids, attention_mask, None, num_loops, kv,
                             read_every_step=True)
    logits, depth = None, torch.zeros(b, dtype=torch.long, device=ids.device)
    position = kv.offset

    def on_step(t, carry, out):
        nonlocal logits
        if logits is None:
            logits = out.logits.new_zeros((b,) + tuple(out.logits.shape[2:]))
        done = out.rows[out.exits]
        if len(done):
            logits[done] = out.logits[-1][out.exits]
            depth[done] = t
            kv.fill_exited(done, position, t, num_loops)
        going = out.rows[~out.exits]
        if attention_mask is not None and attention_mask.size(0) > 1:
            # The fold compacts the carry and the caches to these rows; the mask must match.
            ctx.attention_mask = attention_mask.index_select(0, going)
        if isinstance(rope, layer_forward.PositionRope):  # so must each row's rotary angles
            ctx.rotary_pos_emb = rope.index_rows(going)

    carry = recurrence.begin(model, ids, position_ids, ctx)
    rope = ctx.rotary_pos_emb
    recurrence.fold(model, carry, ctx, stop=recurrence.Stop(rule, per_row=True),
                    on_step=on_step)
    return logits.unsqueeze(1), depth


@torch.no_grad()
def prefill(model, ids, position_ids, kv, num_loops: int, attention_mask=None,
            rule: Optional[ExitRule] = None):
    """The prompt through all T steps, reading out at every step so that the coda's cache of
    every step holds the prompt (a later token may exit at any step). Without ``rule``: the
    last step's logits [b, s, v/tp]. With ``rule``: (the logits [b, 1, v/tp] of the last
    position at the step the rule picks for it, that step per row [b]): the first generated
    token follows the exit rule as every later one does, while the prompt's K/V are those of
    every step. The rule sees what teacher-forced scoring (``score``) shows it for that
    position, so a row's first token does not depend on its batch-mates. The caller advances
    ``kv``."""
    ctx = recurrence.context(model, ids, attention_mask, None, num_loops, kv,
                             read_every_step=True)
    if rule is None:
        return recurrence.fold(model, recurrence.begin(model, ids, position_ids, ctx), ctx)
    from megaloop.model.exit_rules import full_vocab_log_probs

    b = ids.size(0)
    chosen, depth = None, torch.zeros(b, dtype=torch.long, device=ids.device)
    decided = torch.zeros(b, dtype=torch.bool, device=ids.device)
    previous = None

    def on_step(t, carry, out):
        nonlocal chosen, previous
        last = out.logits[-1]  # [b, v/tp]: the position that predicts the first new token
        if t < num_loops:
            logp = full_vocab_log_probs(out.logits[-1:]).transpose(0, 1) \
                if rule.reads_log_probs else None
            survival = carry.log_survival[:, -1:].detach() if rule.reads_survival else None
            stop = rule.stops(t, (b, 1), ids.device, survival, logp, previous)[:, -1]
            previous = logp
        else:
            stop = torch.ones(b, dtype=torch.bool, device=ids.device)
        new = stop & ~decided
        if chosen is None:
            chosen = last.new_zeros(last.shape)
        chosen[new], depth[new] = last[new], t
        decided.logical_or_(new)

    recurrence.fold(model, recurrence.begin(model, ids, position_ids, ctx), ctx,
                    on_step=on_step)
    return chosen.unsqueeze(1), depth


@torch.no_grad()
def score(model, ids, position_ids, labels, num_loops: int, rule: Optional[ExitRule],
          attention_mask=None):
    """Teacher-forced scoring under an exit rule: (per-token LM loss at each token's exit step
    [b, s], exit step [b, s]). Without a rule: the last step's loss, depth T."""
    ctx = recurrence.context(model, ids, attention_mask, None, num_loops,
                             read_every_step=rule is not None)
    loss = torch.zeros(labels.shape, device=labels.device)
    depth = torch.zeros(labels.shape, dtype=torch.long, device=labels.device)

    def on_step(t, carry, out):
        if out.exits.any():
            # (megatron-core's vocab-parallel cross-entropy overwrites its input: give it a copy)
            step_loss = model.compute_language_model_loss(labels, out.logits.clone()).float()
            loss[out.exits], depth[out.exits] = step_loss[out.exits], t

    recurrence.fold(model, recurrence.begin(model, ids, position_ids, ctx), ctx,
                    stop=recurrence.Stop(rule), on_step=on_step)
    return loss, depth


@torch.no_grad()
def exit_log_probs(model, ids, position_ids, num_loops: int, rule: Optional[ExitRule],
                   vocab_size: int, attention_mask=None):
    """Teacher-forced next-token log-probabilities [b, s, vocab_size] (fp32, full vocabulary,
    the padded rows dropped) of every position at its exit step under ``rule`` (None: step T),
    and the exit step [b, s]."""
    from megaloop.model.readout import gather_logits

    ctx = recurrence.context(model, ids, attention_mask, None, num_loops,
                             read_every_step=rule is not None)
    result, depth = None, torch.zeros(ids.shape, dtype=torch.long, device=ids.device)

    def on_step(t, carry, out):
        nonlocal result
        if not out.exits.any():
            return
        logits = gather_logits(out.logits)
        logp = F.log_softmax(logits[..., :vocab_size].float(), dim=-1).transpose(0, 1)
        if result is None:
            result = torch.zeros_like(logp)
        result[out.exits], depth[out.exits] = logp[out.exits], t

    recurrence.fold(model, recurrence.begin(model, ids, position_ids, ctx), ctx,
                    stop=recurrence.Stop(rule), on_step=on_step)
    return result, depth
