"""GRPO and RLTT as pure functions of tensors.

GRPO ("DeepSeekMath", Shao et al. 2024): G completions per prompt, each with a scalar reward; the
advantage of completion i is its reward standardised within its group,
``A_i = (r_i - mean(r)) / (std(r) + eps)`` (std: the unbiased sample deviation, as TRL and
Megatron-RL's GRPO compute it), the same for every token of the completion. Per response token,
with ``rho = exp(logp - old_logp)`` the ratio to the policy that sampled the rollouts,

    loss_tok = -( min(rho * A, clip(rho, 1 - eps_clip, 1 + eps_clip) * A) - beta * k3 )
    k3       = exp(ref_logp - logp) - (ref_logp - logp) - 1

(k3: the unbiased, non-negative KL estimator of Schulman's "Approximating KL Divergence", against
a frozen reference policy). ``token-mean`` averages ``loss_tok`` over every response token of the
batch (DAPO's choice: a long completion weighs by its length); ``sequence-mean`` averages within
each completion and then over completions (the GRPO paper's).

RLTT ("Prioritize the Process, Not Just the Outcome", Williams & Tureci, 2026): a looped model
reads a distribution out at every loop step t, so the log-probability of a sampled token is
taken as ``sum_t w_t log P^(t)(y | ...)`` over the T steps, with ``w`` from ``loop_weights``:
``uniform`` (1/T), ``progressive`` (t^alpha / sum_s s^alpha), ``exit_pdf`` (the model's own exit
distribution p_t per token, detached) or ``last`` ((0, ..., 0, 1): plain GRPO on the final
step's distribution). The aggregated log-probs then go through ``grpo_loss`` unchanged, the
policy's, the sampling policy's and the reference's each with the same weights, so RLTT with
``last`` is GRPO exactly.

A group whose rewards are all equal carries no learning signal: its advantages are exactly 0
(set, not computed: the mean of equal floats need not equal them), so only the KL term reaches
its completions.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

Aggregation = Literal["token-mean", "sequence-mean"]
WEIGHTINGS = ("uniform", "progressive", "exit_pdf", "last")


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """[groups, G] rewards -> [groups, G] advantages ``(r - mean) / (std + eps)`` per group;
    exactly 0 in a group whose rewards are all equal (and for G = 1)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)}: expected [groups, group size]")
    rewards = rewards.double()
    mean = rewards.mean(1, keepdim=True)
    std = rewards.std(1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(mean)
    advantages = (rewards - mean) / (std + eps)
    uniform = rewards.amax(1, keepdim=True) == rewards.amin(1, keepdim=True)
    return torch.where(uniform, torch.zeros_like(advantages), advantages)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference) from the sampled tokens' log-probs."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: Aggregation) -> torch.Tensor:
    """Mean of ``per_token`` [B, S] over the response tokens (``mask`` 1): ``token-mean`` over
    all of them, ``sequence-mean`` within each completion, then over completions."""
    mask = mask.to(per_token.dtype)
    if how == "token-mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    if how == "sequence-mean":
        per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
        return per_seq.mean()
    raise ValueError(f"aggregation {how!r}: use token-mean or sequence-mean")


def aggregate_parts(per_token: torch.Tensor, mask: torch.Tensor, how: Aggregation
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``aggregate`` as (numerator, denominator) of a part of the batch: the parts' numerators
    summed over the parts' denominators summed is ``aggregate`` of the whole batch (so a batch
    split into micro-batches and data-parallel ranks gets the whole batch's mean). ``token-mean``:
    (sum over response tokens, their count); ``sequence-mean``: (sum of each completion's mean,
    the number of completions)."""
    mask = mask.to(per_token.dtype)
    if how == "token-mean":
        return (per_token * mask).sum(), mask.sum()
    if how == "sequence-mean":
        per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
        return per_seq.sum(), torch.tensor(float(per_seq.numel()), dtype=per_token.dtype,
                                           device=per_token.device)
    raise ValueError(f"aggregation {how!r}: use token-mean or sequence-mean")


def grpo_per_token(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: Optional[torch.Tensor],
                   advantages: torch.Tensor, clip_eps: float = 0.2, kl_beta: float = 0.0
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """(per-token GRPO loss [B, S], the k3 KL per token (detached; None without ``ref_logp``),
    1.0 where the ratio was clipped) before aggregation; ``grpo_loss``'s arguments. A trainer
    that splits a batch into micro-batches sums these itself (megaloop/rl/train.py)."""
    if kl_beta and ref_logp is None:
        raise ValueError("kl_beta > 0 needs ref_logp (the reference policy's log-probs)")
    ratio = torch.exp(logp - old_logp.detach())
    adv = advantages.to(logp.dtype).unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl = None
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp.detach())
        if kl_beta:
            per_token = per_token + kl_beta * kl
        kl = kl.detach()
    was_clipped = ((ratio < 1.0 - clip_eps) | (ratio > 1.0 + clip_eps)).to(logp.dtype).detach()
    return per_token, kl, was_clipped


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: Optional[torch.Tensor],
              advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float = 0.2,
              kl_beta: float = 0.0, aggregation: Aggregation = "token-mean"
              ) -> tuple[torch.Tensor, dict]:
    """The GRPO loss (a scalar to minimise) and its statistics.

    ``logp`` [B, S]: the current policy's log-prob of each sampled token (with gradient);
    ``old_logp``: the sampling policy's (no gradient; equal to ``logp`` on the first update of a
    rollout batch, so the ratio is 1); ``ref_logp``: the frozen reference's (None with
    ``kl_beta`` 0); ``advantages`` [B]: one per completion; ``mask`` [B, S]: 1 on the response
    tokens. Statistics (detached floats): ``kl`` (the k3 mean, token-mean), ``clip_fraction``
    (response tokens whose ratio was clipped)."""
    per_token, kl, was_clipped = grpo_per_token(logp, old_logp, ref_logp, advantages, clip_eps,
                                                kl_beta)
    stats = {}
    if kl is not None:
        stats["kl"] = float(aggregate(kl, mask, "token-mean"))
    loss = aggregate(per_token, mask, aggregation)
    stats["clip_fraction"] = float(aggregate(was_clipped, mask, "token-mean"))
    return loss, stats


def loop_weights(kind: str, num_loops: int, alpha: float = 1.0,
                 exit_probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RLTT's loop weights: [T] for ``uniform``, ``progressive`` and ``last``; for ``exit_pdf``
    the given exit distribution [T, B, S], detached (weights steer credit, they are not trained
    through)."""
    if kind == "uniform":
        return torch.full((num_loops,), 1.0 / num_loops)
    if kind == "progressive":
        t = torch.arange(1, num_loops + 1, dtype=torch.float64) ** alpha
        return (t / t.sum()).float()
    if kind == "last":
        w = torch.zeros(num_loops)
        w[-1] = 1.0
        return w
    if kind == "exit_pdf":
        if exit_probs is None or exit_probs.shape[0] != num_loops:
            raise ValueError(f"exit_pdf weights need the exit distribution [T={num_loops}, B, S]")
        return exit_probs.detach()
    raise ValueError(f"loop weighting {kind!r}: use one of {', '.join(WEIGHTINGS)}")


def rltt_log_probs(step_logp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_t w_t log P^(t)`` [B, S] from the per-step log-probs of the sampled tokens
    [T, B, S] and weights [T] (or [T, B, S]). A zero weight contributes exactly 0."""
    if weights.dim() == 1:
        weights = weights.view(-1, *([1] * (step_logp.dim() - 1)))
    return (weights.to(step_logp.dtype) * step_logp).sum(0)
