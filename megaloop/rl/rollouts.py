"""Group rollouts: G sampled completions of every prompt, their rewards, and the token layout the
objectives read.

One call of megaloop's Generator samples all ``groups x G`` completions through the batching
engine (prompts of one length prefill in one forward, every row decodes in one forward per
token; megaloop/inference/engine.py), completion b from stream b of
``SamplingParams.seed`` (megaloop/inference/sampling.py): the same seed gives the same rollouts,
on every tensor-parallel rank alike. Completion b = group * G + i. The text a reward reads is what the completion adds after
its prompt, decoded with the prompt (``continuation_text``), without the end-of-document token.

Layout: ``tokens`` [B, L] holds prompt + completion, right-padded with the tokenizer's EOD;
the log-prob of token j + 1 is read from position j, so ``response_mask`` [B, L - 1] is 1 at
position j exactly when token j + 1 is a completion token (an EOD the policy wrote included:
it chose to stop).

Every reward is checked where the environment returns it (``checked_reward``): a value that is
not a finite number, or a reward() that raises, is a RewardError naming the environment, the
prompt's index in its prompt set and the completion. Which prompts a step draws and the seed its
rollouts sample from (``prompt_indices``, ``sampling_seed``) are pure functions of (--seed, step).
"""

from __future__ import annotations

import math
import numbers
import random
from dataclasses import dataclass
from typing import Optional

import torch

from megaloop.inference.generate import Generator, SamplingParams, continuation_text
from megaloop.rl.environments import Environment, Prompt
from megaloop.training.exit_conditions import RunError

ROLLOUT_SEED_STRIDE = 1_000_003  # (seed, step) -> one integer; a prime keeps seeds apart
SHOWN_CHARS = 120  # of a completion quoted in an error (the line stays one line, readable)


class RewardError(RunError):
    """The environment's reward of a completion is not a finite number, or its reward()
    raised: the run stops with a one-line message naming the environment, the prompt and the
    value (a NaN reward would skip every step and an infinite one swamp the advantages, so none
    is used). Exit code 2: the environment, not the run, needs fixing."""

    exit_code = 2


def checked_reward(env: Environment, name: str, prompt: Prompt, index: int,
                   completion: str) -> float:
    """``env.reward(prompt, completion)`` as a float, or RewardError. ``name``: the --env the
    message names; ``index``: the prompt's index in the environment's prompt set."""
    shown = repr(completion if len(completion) <= SHOWN_CHARS
                 else completion[:SHOWN_CHARS] + "...")
    try:
        value = env.reward(prompt, completion)
    except Exception as exc:  # the user's code: name where it failed, keep its own message
        cause = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line
        raise RewardError(f"--env {name}: reward() raised on prompt {index} (completion "
                          f"{shown}): {cause}") from exc
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise RewardError(f"--env {name}: reward() returned {value!r} for prompt {index} "
                          f"(completion {shown}); a reward must be a finite number")
    return float(value)


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
    exit_depths: list
    """[B] per completion token, the loop steps it ran (all T without an exit rule)."""
    sampling_logprobs: list
    """[B] per completion token, its log-probability under the distribution it was drawn from
    (the rollout policy at its exit step, temperature and top-p applied)."""
    weight_version: int = 0
    """The training iteration whose weights sampled these rollouts."""


def rollout(generator: Generator, tokenizer, env: Environment, prompts: list[Prompt],
            group_size: int, max_tokens: int, params: SamplingParams, env_name: str = "",
            indices: Optional[list[int]] = None, weight_version: int = 0) -> Rollouts:
    """``group_size`` completions of each of ``prompts`` (at most ``max_tokens`` each), sampled
    by ``generator`` (its engine batches all of them; its exit rule, if any, decides each
    token's depth). A reward that is not a finite number raises RewardError naming
    ``env_name`` and the prompt's index in the environment's prompt set (``indices``, else its
    place in ``prompts``). ``weight_version``: recorded in the result."""
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
        group = b // group_size
        index = indices[group] if indices is not None else group
        rewards.append(checked_reward(env, env_name or type(env).__name__, prompts[group],
                                      index, completions[-1]))
    depths = [r.depths if generator.exit_rule is not None else [generator.num_loops] * len(r.out)
              for r in generator.requests]
    return Rollouts(list(prompts), tokens, mask,
                    torch.tensor(rewards, dtype=torch.float64).view(len(prompts), group_size),
                    completions, depths, [r.token_logprobs for r in generator.requests],
                    weight_version)


def prompt_indices(seed: int, step: int, count: int, size: int) -> list[int]:
    """The prompts of RL step ``step``: ``count`` distinct indices into a prompt set of
    ``size``, a pure function of (seed, step)."""
    return random.Random(seed * ROLLOUT_SEED_STRIDE + step).sample(range(size), count)


def sampling_seed(seed: int, step: int, dp_rank: int) -> int:
    """The rollout sampler's seed of data-parallel rank ``dp_rank`` at RL step ``step``."""
    return ((seed * ROLLOUT_SEED_STRIDE + step) * 1009 + dp_rank) % (2 ** 62)
