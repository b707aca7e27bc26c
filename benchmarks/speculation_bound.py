"""Whether self-speculative decoding can pay for a model on this machine: the best speed-up
``--speculate d:k`` can reach, from measured inputs (prints, never asserts).

    bash examples/demo_cpu.sh            # trains the demo model and saves demo/checkpoint
    python benchmarks/speculation_bound.py --load demo/checkpoint --speculate 2:4
    python benchmarks/speculation_bound.py --tiny      # a random tiny model: a rehearsal, seconds

A round of j drafts emits E(j) = (1 - a^(j+1)) / (1 - a) tokens per row on average, each draft
kept with probability a ("Fast Inference from Transformers via Speculative Decoding", Leviathan
et al. 2023, section 3.3), and costs j c_draft + c_verify(j) seconds, where a plain decode step
emits one token in c_plain; so no choice of the round's drafts in 0..k decodes faster than

    bound = max over j in 0..k of E(j) c_plain / (j c_draft + c_verify(j))   (j = 0: 1, plain)

(megaloop/inference/speculation.py's DraftController picks j by the same rate as it runs). The
inputs, measured on held-out prompts (the last documents of --data-path, as benchmarks/decode.py
takes them), greedy:

- a: each prompt's full-depth greedy continuation (the plain run's) teacher-forced through the
  first d loop steps; a is the share of its positions whose depth-d argmax is the token decoding
  emitted there. In a greedy round a draft is kept exactly when so, the tokens before it being
  depth T's; the first generated token (the prefill's) is never drafted and is left out;
- c_plain: seconds of one engine step that decodes the batch plainly (no prefill in it), the
  median over the plain run's steps;
- c_draft, c_verify(j): the engine decoding the same prompts with ``--speculate d:j`` for each j
  in 1..k, each round timed by speculate_round in two phases (``times``: the drafts; the verify,
  acceptance and transfer); c_draft is the median over all rounds of the drafts' seconds per
  draft, c_verify(j) the median over the rounds of j drafts of the step's seconds minus its
  drafts' (so a round's cost and a plain step's both count the whole engine step).

Also printed per j, as a check of the model behind the bound: the engine's measured speed-up
(decoded tokens per second of the d:j run's decode steps over the plain run's), its accepted /
drafted beside what independent acceptance with rate a predicts, a (1 - a^j) / (j (1 - a)), and
whether its greedy text equals the plain run's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from megaloop.runtime import quiet_megatron  # noqa: E402

quiet_megatron()

import torch  # noqa: E402


# --prompts, --prompt-length, --max-tokens unless given: of a checkpoint, and of --tiny (seconds)
SIZES = {False: (8, 32, 48), True: (3, 8, 16)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", default="demo/checkpoint")
    p.add_argument("--data-path", default="demo/corpus_text_document")
    p.add_argument("--tiny", action="store_true",
                   help="a random tiny model (4 loop steps) and random prompts instead of --load "
                        "and --data-path: rehearses every measurement in seconds on CPU")
    p.add_argument("--speculate", default="2:4", help="d:k, as tools/serve.py's (default 2:4)")
    p.add_argument("--prompts", type=int, default=None,
                   help=f"held-out prompts (default {SIZES[False][0]}; --tiny: {SIZES[True][0]})")
    p.add_argument("--prompt-length", type=int, default=None,
                   help=f"default {SIZES[False][1]} (--tiny: {SIZES[True][1]})")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"new tokens per prompt (default {SIZES[False][2]}; --tiny: "
                        f"{SIZES[True][2]})")
    p.add_argument("--batch", type=int, default=1,
                   help="prompts decoded together (default 1: one stream, where speculation is "
                        "meant to help)")
    p.add_argument("--threads", type=int, default=1)
    return p


def tiny_model():
    """A random Llama-style model, 4 loop steps of one core layer between a prelude and a coda
    layer (tests/test_speculation.py's shape), and its vocabulary."""
    from megaloop.model.config import LoopConfig, ModelConfig
    from megaloop.model.looped_gpt import build_model

    torch.manual_seed(7)
    cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4,
                      max_position_embeddings=128, transformer_impl="local", norm_scheme="pre",
                      swiglu=True, position_embedding_type="rope", normalization="RMSNorm",
                      hidden_dropout=0.0, attention_dropout=0.0, disable_bias_linear=True)
    loop = LoopConfig(num_loops=4, num_prelude_layers=1, num_coda_layers=1)
    model = build_model(cfg, loop, 256)
    with torch.no_grad():  # (larger than the init's weights: drafts kept and rejected both)
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    from megaloop.device import current_device

    return model.cuda(current_device()).eval(), 250


@contextlib.contextmanager
def timed_rounds(rounds: list):
    """Every speculative round the engine runs meanwhile appends (drafts j, its ``times``)."""
    from megaloop.inference import engine as engine_module

    real = engine_module.speculate_round

    def timed(engine, requests, k, times=None):
        times = {} if times is None else times  # (an engine may ask for them itself)
        out = real(engine, requests, k, times)
        rounds.append((k, times))
        return out

    engine_module.speculate_round = timed  # the engine's call goes through the wrapper
    try:
        yield
    finally:
        engine_module.speculate_round = real


def decode(model, vocab, prompts, batch, max_tokens, speculate=""):
    """Decode ``prompts`` greedily, ``batch`` at a time: (the outputs, per decode step (seconds,
    tokens emitted, drafts j of its round or 0, its round's times or None), drafted,
    accepted). Steps that prefilled are left out, and so are steps that mixed a round with a
    plain forward (rows one token short of max_tokens)."""
    from megaloop.inference.engine import EngineConfig, InferenceEngine
    from megaloop.inference.generate import SamplingParams

    outs, steps, drafted, accepted = [], [], 0, 0
    for start in range(0, len(prompts), batch):
        group = prompts[start:start + batch]
        engine = InferenceEngine(model, vocab, config=EngineConfig(
            max_sequence_length=max(map(len, group)) + max_tokens, max_batch=len(group),
            speculate_fixed=True,
            prefill_chunk=max(map(len, group)), speculate=speculate))
        requests = [engine.add(p, max_tokens, SamplingParams()) for p in group]  # (no EOD)
        rounds: list = []
        with timed_rounds(rounds):
            while engine.has_work():
                before = (engine.stats["prefill_forwards"], engine.stats["decode_forwards"],
                          len(rounds), sum(len(r.out) for r in requests))
                clock = time.perf_counter()
                engine.step()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()  # (the step's last transfer waited already)
                seconds = time.perf_counter() - clock
                forwards = engine.stats["decode_forwards"] - before[1]
                emitted = sum(len(r.out) for r in requests) - before[3]
                new_rounds = rounds[before[2]:]
                if engine.stats["prefill_forwards"] != before[0]:
                    continue
                if not new_rounds and forwards == 1:
                    steps.append((seconds, emitted, 0, None))
                elif len(new_rounds) == 1 and forwards == new_rounds[0][0] + 1:
                    steps.append((seconds, emitted, *new_rounds[0]))
        outs += [r.out for r in requests]
        drafted += engine.stats["drafted"]
        accepted += engine.stats["accepted"]
    return outs, steps, drafted, accepted


@torch.no_grad()
def acceptance(model, vocab, prompts, outs, d):
    """(kept, positions): of each greedy continuation's tokens after the first, those whose
    depth-d argmax, teacher-forced over the prompt and the continuation, is that token."""
    from megatron.core import tensor_parallel

    from megaloop.device import current_device

    kept = positions = 0
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt + out], device=current_device())
        at = torch.arange(ids.size(1), device=current_device())[None]
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(
            model(ids, at, None, num_loops=d))[0, :, :vocab]
        # token out[i], i >= 1, is drafted from position len(prompt) + i - 1
        guess = logits[len(prompt):len(prompt) + len(out) - 1].argmax(-1).tolist()
        kept += sum(g == t for g, t in zip(guess, out[1:]))
        positions += len(out) - 1
    return kept, positions


def tokens_per_s(steps) -> float:
    return sum(s[1] for s in steps) / sum(s[0] for s in steps)


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    for name, default in zip(("prompts", "prompt_length", "max_tokens"), SIZES[a.tiny]):
        if getattr(a, name) is None:
            setattr(a, name, default)
    from megaloop.inference.speculation import expected_tokens, parse_speculate

    try:
        d, k = parse_speculate(a.speculate)
        for name in ("prompts", "prompt_length", "batch", "threads"):
            if getattr(a, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(a, name)}: must be >= 1")
        if a.max_tokens < k + 2:  # the prefill's token, then a round of k needs k + 1 more
            raise ValueError(f"--max-tokens {a.max_tokens}: a round of {k} drafts needs at "
                             f"least {k + 2} new tokens (--speculate {a.speculate})")
        if not a.tiny and not os.path.isdir(a.load):
            raise ValueError(f"--load {a.load}: no checkpoint there; run `bash "
                             f"examples/demo_cpu.sh` first, or pass --tiny")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from megaloop.inference.loading import load_for_generation, setup_processes

    torch.set_num_threads(a.threads)
    setup_processes()
    if a.tiny:
        model, vocab = tiny_model()
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, vocab, (a.prompts, a.prompt_length), generator=g).tolist()
        source = "a random tiny model (--tiny)"
    else:
        from megaloop.data.heldout import validation_windows

        model, tokenizer, _ = load_for_generation(a.load)
        vocab = tokenizer.vocab_size
        prompts = torch.from_numpy(validation_windows(a.data_path, a.prompts,
                                                      a.prompt_length)).tolist()
        source = f"checkpoint {a.load}, held-out prompts of {a.data_path}"
    T = model.loop.num_loops
    try:
        parse_speculate(a.speculate, T)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    decode(model, vocab, prompts[:1], 1, 4)  # warm-up: allocator, first-touch
    decode(model, vocab, prompts[:1], 1, 4, f"{d}:{k}")
    outs, plain_steps, _, _ = decode(model, vocab, prompts, a.batch, a.max_tokens)
    kept, positions = acceptance(model, vocab, prompts, outs, d)
    acc = kept / positions
    runs = {j: decode(model, vocab, prompts, a.batch, a.max_tokens, f"{d}:{j}")
            for j in range(1, k + 1)}
    # Every run's rounds (a d:j run's last rounds draft fewer than j: its rows' least room)
    rounds = [s for run in runs.values() for s in run[1] if s[2]]
    c_plain = statistics.median(s[0] for s in plain_steps)
    c_draft = statistics.median(s[3]["draft_s"] / s[2] for s in rounds)
    c_verify = {j: statistics.median(s[0] - s[3]["draft_s"] for s in rounds if s[2] == j)
                for j in runs}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"

    print(f"speculation bound: {source}; --speculate {d}:{k} (draft depth {d} of T={T}), "
          f"{len(prompts)} prompts x {a.prompt_length} tokens, {a.max_tokens} new tokens each, "
          f"greedy, batch {a.batch}, {a.threads} thread(s), {device}")
    print(f"inputs: a {acc:.6g} ({kept} of {positions} drafted positions kept); c_plain "
          f"{c_plain:.6g} s; c_draft {c_draft:.6g} s ({c_draft / c_plain:.3f} c_plain; the depth "
          f"ratio d/T is {d / T:.3f})")
    print(f"{'j':>2s} {'E(j)':>9s} {'c_verify s':>11s} {'predicted x':>11s} {'engine x':>9s} "
          f"{'acc/drafted':>11s} {'iid pred':>9s} {'same text':>9s}")
    plain_rate = tokens_per_s(plain_steps)
    bounds = {0: 1.0}
    print(f"{0:2d} {1.0:9.6f} {'-':>11s} {1.0:11.6f} {1.0:9.3f}")
    for j, (spec_outs, steps, drafted, accepted) in runs.items():
        e = expected_tokens(acc, j)
        bounds[j] = e * c_plain / (j * c_draft + c_verify[j])
        predicted = acc * (1 - acc ** j) / (j * (1 - acc)) if acc < 1 else 1.0
        print(f"{j:2d} {e:9.6f} {c_verify[j]:11.6g} {bounds[j]:11.6f} "
              f"{tokens_per_s(steps) / plain_rate:9.3f} {accepted / drafted:11.3f} "
              f"{predicted:9.3f} {'yes' if spec_outs == outs else 'NO':>9s}")
    best = max(bounds, key=bounds.get)
    print(f"best: j = {best}, speed-up bound {bounds[best]:.6f}x over plain decoding "
          f"(max over j of E(j) c_plain / (j c_draft + c_verify(j)); "
          f"{'speculation can pay here' if best else 'speculation cannot pay here'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
