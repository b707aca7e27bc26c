"""Where one decode step's time goes, per part, with megaloop's layer forward and with
megatron-core's (prints, never asserts).

    bash examples/demo_cpu.sh                       # trains the demo model: demo/checkpoint
    python benchmarks/decode_step.py [--load demo/checkpoint] [--rows 1,16] [--tokens 64]
    python benchmarks/decode_step.py --tiny         # a random tiny model, in seconds (the CI rehearsal)

The batching engine decodes ``--rows`` requests of a ``--prompt-length``-token prompt for
``--tokens`` greedy tokens each (no stop at EOD); the steps after the prefill are timed. Each part
is timed by wrapping the function that does it (host wall-clock, in this process: on a GPU
the parts would need device events, which the engine's own ``/stats`` uses): the transfer of
the step's integers to the device, the paged view (gather or reuse) and the write-back, the
transformer blocks (prelude, core at every loop step, coda), the LM head, sampling; the rest
of the step is the engine's and the recurrence's own Python (scheduling, the loop, step norms,
gates, embedding). Each configuration runs ``--repeats`` times, interleaved; a figure is the
mean and (range). Take figures on an otherwise idle machine and say so.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from megaloop.runtime import quiet_megatron  # noqa: E402

quiet_megatron()

import torch  # noqa: E402

PARTS = ("transfer", "view", "blocks", "head", "sampling", "write-back")


class Timer:
    """Seconds spent inside the wrapped functions, per part (nested calls count once)."""

    def __init__(self):
        self.spent = dict.fromkeys(PARTS, 0.0)
        self._depth = 0

    def wrap(self, owner, name: str, part: str):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if self._depth:
                return original(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.spent[part] += time.perf_counter() - start
                self._depth -= 1

        setattr(owner, name, timed)
        return owner, name, original


@contextlib.contextmanager
def timed_parts(model):
    """Wrap the parts' functions for the duration (``Timer.spent`` per part)."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megaloop.inference import engine, paged_kv, transfer
    from megaloop.model import layer_forward

    timer = Timer()
    wrapped = [
        timer.wrap(engine, "to_device", "transfer"),
        timer.wrap(paged_kv.PagedKV, "view", "view"),
        timer.wrap(paged_kv.PagedKV, "next_decode", "view"),
        timer.wrap(paged_kv.PagedKV, "write_back", "write-back"),
        timer.wrap(layer_forward, "block_forward", "blocks"),
        timer.wrap(TransformerBlock, "forward", "blocks"),
        timer.wrap(model, "lm_head", "head"),
        timer.wrap(engine, "sample_rows", "sampling"),
    ]
    del transfer
    try:
        yield timer
    finally:
        for owner, name, original in wrapped:
            if owner is model:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def decode(model, vocab: int, rows: int, prompt: int, tokens: int, layers: str):
    """(seconds per decode step, {part: seconds per step}, the engine's layer forward)."""
    from megaloop.inference.engine import EngineConfig, InferenceEngine

    engine = InferenceEngine(model, vocab, config=EngineConfig(
        max_sequence_length=prompt + tokens, max_batch=rows, layer_forward=layers))
    for i in range(rows):
        engine.add([(7 * i + j) % (vocab - 1) + 1 for j in range(prompt)], tokens,
                   ignore_eos=True)
    engine.step()  # the prefill (and each row's first token)
    steps = 0
    with timed_parts(model) as timer:
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
            steps += 1
        total = time.perf_counter() - start
    return total / steps, {k: v / steps for k, v in timer.spent.items()}, engine.forward_impl


def spread(values) -> str:
    values = list(values)
    return f"{sum(values) / len(values) * 1e3:.2f} ({min(values) * 1e3:.2f}-{max(values) * 1e3:.2f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", default=os.path.join(ROOT, "demo", "checkpoint"))
    parser.add_argument("--tiny", action="store_true",
                        help="a random tiny model instead of --load (seconds; the rehearsal)")
    parser.add_argument("--rows", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)

    from megaloop.inference.loading import load_for_generation, setup_processes

    setup_processes()
    if args.tiny:
        from megaloop.model.config import LoopConfig, ModelConfig
        from megaloop.model.looped_gpt import build_model

        cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, swiglu=True,
                          position_embedding_type="rope", normalization="RMSNorm",
                          hidden_dropout=0.0, attention_dropout=0.0, disable_bias_linear=True,
                          max_position_embeddings=256, transformer_impl="local")
        model, vocab = build_model(cfg, LoopConfig(num_loops=3), 128).eval(), 120
    else:
        model, tokenizer, _ = load_for_generation(args.load)
        vocab = tokenizer.vocab_size
    print(f"# decode step, {args.tokens} greedy tokens per row after a {args.prompt_length}-token "
          f"prompt, {args.threads} thread(s), {args.repeats} repeats interleaved; ms per step: "
          f"mean (range)")
    results: dict = {}
    for _ in range(args.repeats):
        for b in rows:
            for layers in ("auto", "megatron-core"):
                step, parts, impl = decode(model, vocab, b, args.prompt_length, args.tokens,
                                           layers)
                entry = results.setdefault((b, layers), {"impl": impl, "step": [],
                                                         **{p: [] for p in PARTS}})
                entry["step"].append(step)
                for p in PARTS:
                    entry[p].append(parts[p])
    print("| rows | layers | step | " + " | ".join(PARTS) + " | rest |")
    print("|---" * (len(PARTS) + 4) + "|")
    for (b, layers), e in results.items():
        rest = [s - sum(e[p][i] for p in PARTS) for i, s in enumerate(e["step"])]
        impl = e["impl"].split(" (")[0]
        print(f"| {b} | {impl} | {spread(e['step'])} | "
              + " | ".join(spread(e[p]) for p in PARTS) + f" | {spread(rest)} |")
    for b in rows:
        fast, slow = results[(b, "auto")]["step"], results[(b, "megatron-core")]["step"]
        ratios = [s / f for f, s in zip(fast, slow)]
        print(f"rows {b}: megaloop's layer forward {sum(ratios) / len(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}) megatron-core's step speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
