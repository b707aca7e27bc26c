"""Generate text with a looped model trained by megaloop.

    python tools/generate.py --load CKPT --prompt "x = 3 ; y = x + 4 ; y ?" --max-tokens 16
    python tools/generate.py --load CKPT --prompt-ids 5,6,7,8 --max-tokens 12 --kv-policy full
    torchrun --nproc_per_node 2 tools/generate.py --load CKPT ...      # tensor parallel

``--load`` is a checkpoint directory written by pretrain_looplm.py (its run config names the
model and the tokenizer; any TP size that saved it), or a folder written by
``tools/convert_checkpoint.py export-hf`` (config.json names the model; its tokenizer.json, or
where it has none ``--tokenizer-type`` / ``--tokenizer-model`` / ``--vocab-size``, the tokenizer).
``--prompt-ids`` prints the generated ids as
comma-separated integers on stdout (one line per prompt); ``--prompt`` prints the prompt and its
continuation decoded together (the prompt as the model read it: its last tokens with
``--keep-prompt-tail``).
``--num-loops`` may differ from the trained value (fewer: under-unrolling, more: extrapolation).
``--kv-policy``: ``full`` (a KV cache per loop step, exact), ``last-step``, ``first-step``,
``shared-mod-<k>`` (smaller caches, approximate), ``none`` (no cache: recompute every token).
``--exit``: per-token early exit that skips the remaining steps: ``q:<q>`` (Ouro's Q-exit on the
cumulative exit probability), ``kl:<eps>`` (Huginn: successive steps' next-token distributions
closer than eps), ``fixed:<n>``; the mean executed depth is printed on stderr.
``--transformer-impl``: the layer backend the model is built with, `local` unless told
otherwise, whatever the checkpoint was saved with (the weights map by name; a line says so where
the checkpoint's flag would build other layers on this machine).
``--bf16`` / ``--fp16`` / ``--fp32``: the precision the model is held in (default: on a GPU the
checkpoint's, bf16 if it trained with --bf16; on CPU fp32); a line on stderr names it.
``--speculate d:k``: self-speculative decoding, the batching engine's flag as tools/serve.py's
(megaloop/inference/speculation.py): greedy output is the same tokens, sooner where drafts pay.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


from megaloop import runtime
from megaloop.arguments import ArgumentParser, FlagCheck, add_dataclass_args, dataclass_from_args
from megaloop.inference.flags import (add_ckpt_step_flag, add_generation_flags,
                                      add_tokenizer_flags, add_transformer_impl_flag)
from megaloop.inference.precision import PrecisionConfig


# The batching engine's flags (megaloop/inference/engine.py's EngineConfig) generate takes; the
# others size a server's batches, which Generator sizes from the prompts.
GENERATE_ENGINE_FLAGS = ("speculate",)


def build_parser() -> argparse.ArgumentParser:
    from megaloop.inference.engine_config import EngineConfig

    p = ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True,
                   help="megaloop checkpoint directory, or a folder written by export-hf")
    add_ckpt_step_flag(p)
    add_tokenizer_flags(p)  # an exported folder without its own tokenizer files
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append",
                        help="prompt text (repeat for a batch); the output is decoded text")
    prompt.add_argument("--prompt-ids", action="append",
                        help="comma-separated token ids (repeat for a batch); the output is ids")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument("--keep-prompt-tail", action="store_true",
                   help="a prompt that, with --max-tokens, does not fit the model's context "
                        "keeps only its last tokens (default: such a prompt is refused)")
    add_generation_flags(p)
    add_transformer_impl_flag(p, engine=False)
    add_dataclass_args(p, PrecisionConfig)
    # The engine's flag, as tools/serve.py adds it (its module imports torch, so --help does)
    add_dataclass_args(p, EngineConfig, only=GENERATE_ENGINE_FLAGS)
    p.add_argument("--temperature", type=float, default=0.0, help=">= 0; 0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample from the k most likely tokens (default 0: all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the most likely tokens whose probability reaches p, in "
                        "(0, 1] (default 1: all)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed: an integer from -2**63 to 2**64 - 1, as a request's seed "
                        "to tools/serve.py (a negative seed s is 2**64 + s; default 0)")
    p.add_argument("--no-stop-at-eod", action="store_true",
                   help="keep generating past the end-of-document token")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from megaloop.inference.flags import (check_sampling, check_seed, fit_prompt,
                                          tokenizer_from_flags)
    from megaloop.inference.engine_config import EngineConfig
    from megaloop.inference.loading import (check_generation_flags, check_transformer_impl,
                                            parse_prompt_ids)
    from megaloop.inference.speculation import check_speculate

    precision = dataclass_from_args(PrecisionConfig, args)
    engine_config = dataclass_from_args(EngineConfig, args)  # (its GENERATE_ENGINE_FLAGS)
    # Every independent refusal at once (megaloop.arguments.FlagCheck)
    flags = FlagCheck()
    with flags.check():
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens {args.max_tokens}: must be >= 1")
    with flags.check():
        precision.validate()
    with flags.check():
        engine_config.validate()
    with flags.check():
        check_sampling(args.temperature, args.top_k, args.top_p)
    with flags.check():
        check_seed(args.seed)
    rule = impl = prompts_ids = tokenizer_cfg = None
    with flags.check():
        rule = check_generation_flags(args.load, args.kv_policy, args.exit, args.num_loops,
                                      ckpt_step=args.ckpt_step)
    with flags.check():
        impl = check_transformer_impl(args.transformer_impl, engine=False)
    with flags.check():
        prompts_ids = [parse_prompt_ids(t) for t in args.prompt_ids] if args.prompt_ids else None
    with flags.check():
        tokenizer_cfg = tokenizer_from_flags(args)
    if flags.ok:  # (needs the exit rule and an engine config that passed)
        with flags.check():
            check_speculate(engine_config.speculate, rule, args.kv_policy)
    if flags.refused():
        return 2

    runtime.quiet_megatron()
    from megaloop.inference.generate import Generator, SamplingParams
    from megaloop.inference.loading import (context_length, is_hf_folder, load_for_generation,
                                            setup_processes)
    from megaloop.parallel import initialize

    # The process's seed is not --seed: the sampler draws from its own counter-based streams of
    # --seed (megaloop/inference/sampling.py) and a loaded model holds no random state, while
    # numpy, seeded here, takes only 0 .. 2**32 - 1.
    tp = setup_processes()
    try:
        try:
            model, tokenizer, run = load_for_generation(args.load, tp, tokenizer=tokenizer_cfg,
                                                        ckpt_step=args.ckpt_step,
                                                        transformer_impl=impl,
                                                        precision=precision)
        except (ValueError, FileNotFoundError) as exc:
            print(f"error: --load {args.load}: {exc}", file=sys.stderr)
            return 2
        if tokenizer_cfg is not None and runtime.is_rank_zero() and \
                run.get("tokenizer") != dataclasses.asdict(tokenizer_cfg):
            where = "its own tokenizer.json" if is_hf_folder(args.load) else \
                "a run config that names the tokenizer"
            print(f"note: --tokenizer-type/--tokenizer-model/--vocab-size are ignored: "
                  f"{args.load} has {where}", file=sys.stderr)
        prompts = prompts_ids or [tokenizer.tokenize(t) for t in args.prompt]
        bad = [i for p in prompts for i in p if not 0 <= i < tokenizer.vocab_size]
        if bad:
            print(f"error: token id {bad[0]} is outside the vocabulary (size "
                  f"{tokenizer.vocab_size})", file=sys.stderr)
            return 2
        flag = "--prompt-ids" if prompts_ids else "--prompt"
        try:
            # Every rank holds the same prompts and config: all refuse alike, nothing hangs.
            prompts = [fit_prompt(p, args.max_tokens, context_length(run), args.keep_prompt_tail,
                                  tail_flag="--keep-prompt-tail", what=f"{flag} {i + 1}")
                       for i, p in enumerate(prompts)]
            gen = Generator(model, tokenizer.vocab_size, num_loops=args.num_loops,
                            kv_policy=args.kv_policy, exit_rule=rule,
                            eod=None if args.no_stop_at_eod else tokenizer.eod,
                            speculate=engine_config.speculate)
            params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
            outputs = gen.generate(prompts, args.max_tokens, params)
        except ValueError as exc:  # also a depth the model cannot run (e.g. an exit gate missing)
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if runtime.is_rank_zero():
            for i, out in enumerate(outputs):
                if prompts_ids is not None:
                    print(",".join(str(t) for t in out), flush=True)
                else:  # the prompt and its continuation, decoded together: the tokenizer
                    # puts a word boundary's space where a piece carries one (joining two
                    # decoded strings with a space gave "robot ." for "robot.")
                    print(tokenizer.detokenize(list(prompts[i]) + out), flush=True)
            if gen.depths:
                print(f"mean executed depth {sum(gen.depths) / len(gen.depths):.2f} of "
                      f"{gen.num_loops} over {len(gen.depths)} decoded tokens", file=sys.stderr)
    finally:
        initialize.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
