"""The sampled tokens' log-probabilities at every loop step, from one forward.

RLTT weighs the log-probability each loop step t assigns to a sampled token; all T of them come
from the recurrence's one fold (megaloop/model/recurrence.py), read out at every step
(``read_every_step``) and collected by its ``on_step`` hook, so they cost one forward and keep
their gradient. The log-softmax runs over the tokenizer's vocabulary only (the padded rows of the
output layer are masked), as the Generator samples, and at the sampling temperature, so the
policy the objective scores is the one that wrote the rollouts. Under tensor parallelism the
logits stay vocab-parallel: megatron-core's vocab-parallel cross-entropy gives -log p of the
target, and the padded rows are masked on the rank that holds them.

The exit distribution comes along (the gate's per-step logits, through the survival construction
p_t = lambda_t prod_{s<t} (1 - lambda_s), p_T = prod_{s<T} (1 - lambda_s)), detached: RLTT's
``exit_pdf`` weights.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def step_log_probs(model, tokens: torch.Tensor, vocab_size: int, num_loops: Optional[int] = None,
                   temperature: float = 1.0) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(per-step log-probs [T, B, L - 1] of ``tokens[:, j + 1]`` read at position j, with
    gradient; the exit distribution [T, B, L - 1], detached, or None for a model without a
    gate). ``model``: a LoopedGPTModel (unwrapped, one pipeline stage)."""
    from megatron.core import parallel_state, tensor_parallel

    from megaloop.model import recurrence

    if temperature <= 0:
        raise ValueError(f"temperature {temperature}: log-probs need a temperature > 0")
    ids, target = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(ids.size(1), device=ids.device).expand_as(ids)
    ctx = recurrence.context(model, ids, None, None, num_loops, read_every_step=True)
    steps, gates = [], []

    def on_step(t, carry, out):
        logits = out.logits.float() / temperature  # [s, b, v/tp]; a new tensor: CE may write it
        rows = logits.size(-1)
        first = parallel_state.get_tensor_model_parallel_rank() * rows
        padded = torch.arange(first, first + rows, device=logits.device) >= vocab_size
        if padded.any():
            logits = logits.masked_fill(padded, float("-inf"))
        nll = tensor_parallel.vocab_parallel_cross_entropy(logits, target.t().contiguous())
        steps.append(-nll.t())
        if out.gate_logit is not None:
            gates.append(out.gate_logit.float())

    recurrence.fold(model, recurrence.begin(model, ids, position_ids, ctx), ctx, on_step=on_step)
    step_logp = torch.stack(steps)
    if not gates:
        return step_logp, None
    log_exit = [F.logsigmoid(g) for g in gates]       # log lambda_t, t < T
    log_stay = [F.logsigmoid(-g) for g in gates]      # log (1 - lambda_t)
    survival = torch.zeros_like(gates[0])
    probs = []
    for t in range(len(gates)):
        probs.append(torch.exp(survival + log_exit[t]))
        survival = survival + log_stay[t]
    probs.append(torch.exp(survival))
    return step_logp, torch.stack(probs).detach()
