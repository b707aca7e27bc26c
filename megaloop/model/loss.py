"""From a forward's per-token output to the schedule's loss and the logged statistics.

megatron-core's schedules call ``loss_func`` on each micro-batch's output (with
``calculate_per_token_loss``: the *sum* of the masked per-token objective and the token count;
``finalize_model_grads`` divides by the tokens of the global batch, summed over data- and
context-parallel ranks). The statistics of a micro-batch are named sums over its kept tokens
(``LoopStats``); ``reduce_stats`` adds them over micro-batches, pipeline stages and data- and
context-parallel ranks and turns them into means. Under context parallelism a rank holds a part
of each sequence; every statistic is a per-token sum, so the sums over CP ranks are those of the
whole sequences. Both the
single-stage trainer and the pipeline's chunks use these, so they live below both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class LoopOutput:
    """What a training forward returns: the per-token objective and detached per-step stats."""

    objective: torch.Tensor
    """[b, s] per-token objective (not yet masked)."""
    step_losses: torch.Tensor
    """[T, b, s] per-step LM loss, NaN where a step was not read out (`last` mode)."""
    exit_probs: Optional[torch.Tensor]
    """[T, b, s] exit distribution p_t, None without a gate."""


# The statistics of a micro-batch, summed over its kept tokens: name -> length (T: per step).
STAT_FIELDS = ("objective", "tokens", "step_losses", "exit_probs")


def loss_func(loss_mask: torch.Tensor, num_loops: int, out: LoopOutput, count_tokens: bool = True):
    """(sum of the masked per-token objective, token count, {"stats": named sums}).
    ``count_tokens`` False: a report that adds to another one of the same micro-batch (a pipeline
    chunk's share of the objective), whose tokens are counted there."""
    mask = loss_mask.float()
    tokens = mask.sum()
    objective = (out.objective * mask).sum()
    step_losses = (out.step_losses * mask).sum((1, 2))  # NaN stays NaN: step not read out
    if out.exit_probs is not None:
        probs = (out.exit_probs * mask).sum((1, 2))
    else:  # no gate: NaN marks it (placed with the other statistics, for the collectives)
        probs = torch.full((num_loops,), float("nan"), device=mask.device)
    stats = {"objective": objective.detach().float().view(1),
             "tokens": tokens.view(1) if count_tokens else torch.zeros_like(tokens).view(1),
             "step_losses": step_losses.float(), "exit_probs": probs.float()}
    return objective, tokens.detach().to(torch.int), {"stats": stats}


def reduce_stats(reports: list, num_loops: int, device=None) -> dict:
    """Sum the micro-batch stats, all-reduce over pipeline stages (only the last computes
    losses) and data x context-parallel ranks (a CP rank saw its part of each sequence), and
    turn the sums into per-token means."""
    from megatron.core import parallel_state

    sizes = {"objective": 1, "tokens": 1, "step_losses": num_loops, "exit_probs": num_loops}
    if reports:
        packed = torch.stack([torch.cat([r["stats"][k] for k in STAT_FIELDS])
                              for r in reports]).sum(0)
    else:  # a stage before the last: it contributes zeros to the sums (on the device the
        # collective's backend serves: NCCL takes no CPU tensor)
        if device is None:
            from megaloop.device import current_device

            device = current_device()
        packed = torch.zeros(sum(sizes.values()), device=device)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(packed,
                                     group=parallel_state.get_pipeline_model_parallel_group())
    if parallel_state.get_data_parallel_world_size(with_context_parallel=True) > 1:
        torch.distributed.all_reduce(
            packed, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    sums = dict(zip(STAT_FIELDS, packed.split([sizes[k] for k in STAT_FIELDS])))
    tokens = max(sums["tokens"].item(), 1.0)
    step_losses = (sums["step_losses"] / tokens).tolist()
    probs = (sums["exit_probs"] / tokens).tolist()
    has_gate = all(p == p for p in probs)  # NaN when the model has no gate
    return {"loss": sums["objective"].item() / tokens, "tokens": int(sums["tokens"].item()),
            "step_losses": step_losses, "exit_probs": probs if has_gate else None}
