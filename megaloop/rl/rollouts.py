"""Group rollouts: G sampled completions of every prompt, their rewards, and the token layout the
objectives read.

One call of megaloop's Generator samples all ``groups x G`` completions in one batch (prompts of
different lengths share it; megaloop/inference/generate.py), from a CPU generator seeded by
``SamplingParams.seed``: the same seed gives the same rollouts, on every tensor-parallel rank
alike. Completion b = group * G + i. The text a reward reads is what the completion adds after
its prompt, decoded with the prompt (``continuation_text``), without the end-of-document token.

Layout: ``tokens`` [B, L] holds prompt + completion, right-padded with the tokenizer's EOD;
the log-prob of token j + 1 is read from position j, so ``response_mask`` [B, L - 1] is 1 at
position j exactly when token j + 1 is a completion token (an EOD the policy wrote included:
it chose to stop).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaloop.inference.generate import Generator, SamplingParams, continuation_text
from megaloop.rl.environments import Environment, Prompt


@dataclass
class Rollouts:
    """The completions of one rollout step."""

    prompts: list[Prompt]
    """One per group."""
    tokens: torch.Tensor
    """[B, L] prompt + completion ids, right-padded with EOD."""
    response_mask: torch.Tensor
    """[B, L - 1] float: 1 where position j's next token (j + 1) is a completion token."""
    rewards: torch.Tensor
    """[groups, G] the environment's reward of each completion."""
    completions: list[str]
    """[B] the text each completion adds after its prompt (EOD dropped)."""


def rollout(generator: Generator, tokenizer, env: Environment, prompts: list[Prompt],
            group_size: int, max_tokens: int, params: SamplingParams) -> Rollouts:
    """``group_size`` completions of each of ``prompts`` (at most ``max_tokens`` each)."""
    if group_size < 1 or max_tokens < 1:
        raise ValueError(f"group size {group_size} and max tokens {max_tokens} must be >= 1")
    prompt_ids = [tokenizer.tokenize(p.text) for p in prompts]
    batch = [ids for ids in prompt_ids for _ in range(group_size)]
    outputs = generator.generate(batch, max_tokens, params)
    width = max(len(p) + len(o) for p, o in zip(batch, outputs))
    tokens = torch.full((len(batch), width), tokenizer.eod, dtype=torch.long)
    mask = torch.zeros(len(batch), width - 1)
    completions, rewards = [], []
    for b, (ids, out) in enumerate(zip(batch, outputs)):
        tokens[b, :len(ids) + len(out)] = torch.tensor(ids + out)
        mask[b, len(ids) - 1:len(ids) - 1 + len(out)] = 1.0
        text_ids = out[:-1] if out and out[-1] == tokenizer.eod else out
        completions.append(continuation_text(tokenizer, ids, text_ids))
        rewards.append(env.reward(prompts[b // group_size], completions[-1]))
    return Rollouts(list(prompts), tokens, mask,
                    torch.tensor(rewards, dtype=torch.float64).view(len(prompts), group_size),
                    completions)
