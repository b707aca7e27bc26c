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
not a finite number (an integer beyond a float's range included), a reward() that raises, or one
that does not return within --reward-timeout, is a RewardError naming the environment, the
prompt's index in its prompt set and the completion.

The timeout is SIGALRM's (``reward_deadline``): the alarm raises RewardTimeout inside reward()
in the main thread, so the call unwinds and nothing of it is left running, where a watchdog
thread could only abandon a call that never returns, still burning a core, and a subprocess per
reward would fork the whole trainer for every completion and lose the environment's own state.
RewardTimeout is a BaseException, so a reward() that catches Exception does not swallow it. What
it cannot stop is a C call that never returns to the interpreter (which Ctrl-C cannot stop
either). Which prompts a step draws and the seed its
rollouts sample from (``prompt_indices``, ``sampling_seed``) are pure functions of (--seed, step).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import random
import signal
import threading
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


class RewardTimeout(BaseException):
    """Raised inside reward() by the --reward-timeout alarm; a BaseException, as
    KeyboardInterrupt is, so that the environment's ``except Exception`` lets it through."""


def _expire(signum, frame):
    raise RewardTimeout()


@contextlib.contextmanager
def reward_deadline(seconds: Optional[float]):
    """RewardTimeout in the block once ``seconds`` have passed (None: no deadline). SIGALRM
    reaches Python code in the main thread only: elsewhere, RuntimeError."""
    if seconds is None:
        yield
        return
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("--reward-timeout stops reward() with SIGALRM, which only the main "
                           "thread receives: run train_rl.py's training in the main thread")
    previous = signal.signal(signal.SIGALRM, _expire)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, previous)


def _shown_value(value) -> str:
    """What a message says reward() returned: its repr, shortened (an integer beyond a float's
    range by its digits: their repr is as long, and over 4300 digits repr refuses)."""
    if isinstance(value, int) and abs(value) > 2 ** 64:
        digits = len(str(abs(value))) if value.bit_length() < 14_000 else "over 4000"
        return f"an integer of {digits} digits"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def checked_reward(env: Environment, name: str, prompt: Prompt, index: int,
                   completion: str, timeout: Optional[float] = None) -> float:
    """``env.reward(prompt, completion)`` as a float, or RewardError. ``name``: the --env the
    message names; ``index``: the prompt's index in the environment's prompt set; ``timeout``:
    seconds reward() may take (--reward-timeout; None: no limit)."""
    shown = repr(completion if len(completion) <= SHOWN_CHARS
                 else completion[:SHOWN_CHARS] + "...")

    def call():  # the user's code: what it raises is named below, with its own message
        try:
            return env.reward(prompt, completion), None
        except Exception as exc:
            return None, exc

    try:
        with reward_deadline(timeout):  # (its own RuntimeError is not reward()'s)
            value, error = call()
    except RewardTimeout:
        raise RewardError(f"--env {name}: reward() did not return within --reward-timeout "
                          f"{timeout:g} s on prompt {index} (completion {shown}); fix it, or "
                          f"raise --reward-timeout if it is only slow") from None
    if error is not None:
        cause = " ".join(f"{type(error).__name__}: {error}".split())  # one line
        raise RewardError(f"--env {name}: reward() raised on prompt {index} (completion "
                          f"{shown}): {cause}") from error
    reason = None
    if not isinstance(value, numbers.Real):
        reason = "a reward must be a finite number"
    else:
        try:
            if not math.isfinite(float(value)):
                reason = "a reward must be a finite number"
        except OverflowError:  # an int (or Fraction) beyond a float's range: float() refuses it
            reason = "it is beyond a float's range; a reward must be a finite number"
    if reason is not None:
        raise RewardError(f"--env {name}: reward() returned {_shown_value(value)} for prompt "
                          f"{index} (completion {shown}); {reason}")
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
            indices: Optional[list[int]] = None, weight_version: int = 0,
            reward_timeout: Optional[float] = None) -> Rollouts:
    """``group_size`` completions of each of ``prompts`` (at most ``max_tokens`` each), sampled
    by ``generator`` (its engine batches all of them; its exit rule, if any, decides each
    token's depth). A reward that is not a finite number, or that takes longer than
    ``reward_timeout`` seconds (None: no limit), raises RewardError naming ``env_name`` and the
    prompt's index in the environment's prompt set (``indices``, else its place in
    ``prompts``). ``weight_version``: recorded in the result."""
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
                                      index, completions[-1], reward_timeout))
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
