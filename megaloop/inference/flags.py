"""The flags every generation entry point shares (tools/generate.py, tools/serve.py) and the range
checks of their values, which those tools, the server's requests and the lm-eval adapter all call,
so a value is refused the same way wherever it is given. Standard library only: ``--help`` of
those tools imports no torch or megatron-core.

A check names the value as its caller spells it (``spell``): ``--top-p`` on a command line,
``top_p`` in a request body or in lm-eval's ``--model_args``.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional


def cli_name(name: str) -> str:
    """``top_p`` -> ``--top-p`` (the command-line spelling)."""
    return "--" + name.replace("_", "-")


def add_ckpt_step_flag(p: argparse.ArgumentParser) -> None:
    """--ckpt-step, defined once for the trainer and every tool that takes --load (the field
    megaloop.checkpoint.config.LoadConfig.ckpt_step): the step a damaged checkpoint's error
    suggests loads with it."""
    from megaloop.arguments import add_dataclass_args
    from megaloop.checkpoint.config import LoadConfig

    add_dataclass_args(p, LoadConfig, only=("ckpt_step",))


def add_tokenizer_flags(p: argparse.ArgumentParser) -> None:
    """The trainer's tokenizer flags (megaloop.data.config.TokenizerConfig: the same names,
    choices, spellings and help), unset unless given: for a folder that does not name its own
    tokenizer (read back by ``tokenizer_from_flags``)."""
    from megaloop.arguments import add_dataclass_args
    from megaloop.data.config import TokenizerConfig

    add_dataclass_args(p, TokenizerConfig, defaults={"tokenizer_type": None},
                       title="the tokenizer, for a folder that does not name its own (the "
                             "trainer's flags; default: the checkpoint's or the folder's)")


def tokenizer_from_flags(args: argparse.Namespace):
    """The validated TokenizerConfig of the flags ``add_tokenizer_flags`` added, or None when
    none was given; ValueError naming the flags given without --tokenizer-type."""
    import dataclasses

    from megaloop.arguments import dataclass_from_args
    from megaloop.data.config import TokenizerConfig

    given = [f.name for f in dataclasses.fields(TokenizerConfig)
             if getattr(args, f.name, None) is not None]
    if not given:
        return None
    if args.tokenizer_type is None:
        raise ValueError(f"{', '.join(cli_name(n) for n in given)} need --tokenizer-type")
    tokenizer = dataclass_from_args(TokenizerConfig, args)
    tokenizer.validate()
    return tokenizer


def add_generation_flags(p: argparse.ArgumentParser) -> None:
    """--num-loops, --kv-policy, --exit (checked by loading.check_generation_flags)."""
    p.add_argument("--num-loops", type=int, default=None,
                   help="loop steps per token, at least 1 (default: the trained --num-loops)")
    p.add_argument("--kv-policy", default="full",
                   help="full | last-step | first-step | shared-mod-<k> | none (default: full)")
    p.add_argument("--exit", default=None,
                   help="early exit: q:<q> | kl:<eps> | huginn-kl:<eps> | fixed:<n> | none (default: the model's "
                        "own rule, e.g. an imported Ouro folder's early_exit_threshold, else "
                        "all steps; none: all steps)")


def add_transformer_impl_flag(p: argparse.ArgumentParser, engine: bool) -> None:
    """--transformer-impl: the layer backend the loaded model is built with, whatever the
    checkpoint was saved with (checked by loading.check_transformer_impl). ``engine``: the entry
    point decodes with the batching engine, which runs the local layers only."""
    runs = "local (the default; the only one the batching engine runs)" if engine else \
        "local (the default), or transformer_engine on a GPU with Transformer Engine installed"
    p.add_argument("--transformer-impl", default=None,
                   help=f"layer backend to build the model with: {runs}. A checkpoint saved "
                        f"with either loads into either: the weights map by name")


def check_num_loops(value, spell: Callable[[str], str] = cli_name) -> None:
    """None (the trained depth) or an integer >= 1; ValueError naming the value otherwise."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{spell('num_loops')} {value}: the loop steps per token must be an "
                         f"integer of at least 1 (leave it out for the trained depth)")


# The smallest positive temperature: sampling divides the fp32 logits by it, and below about
# 1e-38 the quotient of any logit is infinite (softmax then gives NaN and the draw fails). At
# 1e-6 a logit would need a magnitude of 3e32 to overflow, which only a broken model produces.
MIN_TEMPERATURE = 1e-6
# A seed is a 64-bit integer, signed or unsigned (a negative seed s is the unsigned 2**64 + s):
# the sampler's streams (megaloop/inference/sampling.py) hash its 64 bits.
SEED_RANGE = (-2 ** 63, 2 ** 64 - 1)
# A seed of the process's generators (megaloop.parallel.initialize.set_seed: the trainer's --seed,
# import-hf's) seeds numpy's too, which take 0 .. 2**32 - 1 only.
PROCESS_SEED_RANGE = (0, 2 ** 32 - 1)


def check_sampling(temperature: float, top_k: int, top_p: float,
                   spell: Callable[[str], str] = cli_name) -> None:
    """temperature 0 (greedy) or in [MIN_TEMPERATURE, inf), top_k >= 0 (0 = all),
    0 < top_p <= 1 (1 = all)."""
    if not temperature >= 0:  # also refuses NaN
        raise ValueError(f"{spell('temperature')} {temperature}: must be >= 0 (0 = greedy)")
    if not temperature < float("inf"):
        raise ValueError(f"{spell('temperature')} {temperature}: must be finite (a large "
                         f"temperature samples nearly uniformly; 0 = greedy)")
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"{spell('temperature')} {temperature}: too small to sample with (the "
                         f"logits divided by it overflow); use 0 for greedy decoding or at least "
                         f"{MIN_TEMPERATURE:g}")
    if top_k < 0:
        raise ValueError(f"{spell('top_k')} {top_k}: must be >= 0 (0 = every token)")
    if not 0 < top_p <= 1:
        raise ValueError(f"{spell('top_p')} {top_p}: must be in (0, 1] (1 = every token; a "
                         f"smaller p keeps the most likely tokens whose probability reaches p)")


def check_seed(seed, spell: Callable[[str], str] = cli_name, valid: tuple = SEED_RANGE,
               why: str = "a 64-bit seed, signed or unsigned") -> None:
    """An integer in ``valid`` (inclusive; the sampler's SEED_RANGE unless the caller's seed
    feeds something narrower, ``why`` saying what); ValueError naming the value otherwise. The
    one check of every seed a user gives: generate.py's --seed, a request's ``seed``, the
    trainer's --seed (megaloop/training/config.py)."""
    low, high = valid
    if isinstance(seed, bool) or not isinstance(seed, int) or not low <= seed <= high:
        raise ValueError(f"{spell('seed')} {seed}: must be an integer from {low} to {high} "
                         f"({why})")


def fit_prompt(ids: list, max_tokens: int, context: Optional[int], keep_tail: bool = False,
               spell: Callable[[str], str] = cli_name, tail_flag: Optional[str] = None,
               what: str = "the prompt") -> list:
    """``ids``, or its last ``context - max_tokens`` tokens with ``keep_tail``, so that the prompt
    and the tokens to generate fit the model's context (positions past it were never trained:
    the output would be garbage). ``context`` None: unknown, nothing is checked. ``tail_flag``:
    how the caller asks for ``keep_tail`` (named in the refusal).

    A refusal names the prompt's length, ``max_tokens`` and the context, and a bound that is
    accepted when given back: the prompt takes its tokens of the context first, so the bound on
    ``max_tokens`` is ``context - len(ids)`` (``context - 1`` only where ``keep_tail`` cuts the
    prompt to what is left, down to one token)."""
    n = len(ids)
    if context is None or n + max_tokens <= context:
        return ids
    room = context - max_tokens  # the prompt tokens that fit beside max_tokens
    mt = spell("max_tokens")
    over = (f"{what} has {_tokens(n)} and {mt} is {max_tokens}: {n + max_tokens} tokens exceed "
            f"the model's context of {context}")
    if keep_tail:
        if room >= 1:
            return ids[-room:]
        # Even one prompt token leaves no room: the tail kept can shrink to one token, no less.
        raise ValueError(f"{over}, and {tail_flag or 'keeping the tail'} keeps at least the "
                         f"prompt's last token: use {mt} {context - 1} at most")
    hint = f", or pass {tail_flag} to keep its last {room} tokens" if tail_flag and room >= 1 \
        else ""
    if n >= context:
        # The prompt alone fills the context: no max_tokens of at least 1 fits beside it.
        fix = f"shorten it to at most {room} tokens{hint}" if room >= 1 else \
            f"shorten it and lower {mt} so that the two add up to at most {context}"
        raise ValueError(f"{over}; the prompt alone ({_tokens(n)}) fills the context, "
                         f"leaving no room for {mt}: {fix}")
    raise ValueError(f"{over}; lower {mt} {max_tokens} to at most {context - n} (the context "
                     f"less the prompt's {_tokens(n)}), or shorten the prompt{hint}")


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def parse_speculate(text: str, num_loops: int = 0):
    """``d:k`` -> (d, k), or None for ""; ValueError naming --speculate otherwise (d < T when
    ``num_loops`` T is given)."""
    if not text:
        return None
    try:
        d, k = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"--speculate {text!r}: give d:k (draft depth d, k drafted tokens per "
                         f"round), e.g. 2:4") from None
    if d < 1 or k < 1:
        raise ValueError(f"--speculate {text}: the draft depth and the drafted tokens must be "
                         f">= 1")
    if num_loops and d >= num_loops:
        raise ValueError(f"--speculate {text}: the draft depth {d} must be below the decoding "
                         f"depth {num_loops} (--num-loops)")
    return d, k
