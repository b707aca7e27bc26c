"""Step time of this tree against another revision, measured in one run (prints, never asserts).

    python benchmarks/before_after.py --rev <git revision> [--rounds 30 --pp-repeats 3
                                      --decode-rounds 10]

For a refactor that must not cost speed: the revision is checked out into a temporary git
worktree and both trees are measured side by side.

(a) Single stage, in this one process: the looped model of each tree is built (the package of
    one tree imported, its modules dropped from ``sys.modules``, then the other's), with the
    same seed and shape, for `--exit-loss expected` and `last`; then their training steps
    (forward + backward + AdamW) are timed in interleaved rounds with a rotating order, so
    machine drift hits both trees alike. Median per variant and the after/before ratio.
(b) Pipeline, PP = 2: ``benchmarks/pipeline_bubble.py --sizes 2`` of each tree (forked gloo
    ranks), run alternately ``--pp-repeats`` times; median ms/iter of each and the ratio.
(c) Decoding: ``Generator.generate`` of each tree (KV cache ``full``) on the same model and
    prompts, without an exit rule and with ``--decode-exit``, timed in interleaved rounds with a
    rotating order as in (a); each call runs with its own tree's modules in ``sys.modules`` (so
    what it imports lazily is its own). Decoded tokens/s (the forwards after the prefill) and
    the mean executed depth under the rule.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from megaloop.runtime import quiet_megatron  # noqa: E402

quiet_megatron()

import torch  # noqa: E402


def _purge() -> None:
    for name in [m for m in sys.modules if m == "megaloop" or m.startswith("megaloop.")]:
        del sys.modules[name]


def _build(a, exit_loss: str):
    """The benchmark's looped model, built by the megaloop package imported now."""
    from megaloop.model.config import LoopConfig, ModelConfig
    from megaloop.model.looped_gpt import build_model

    torch.manual_seed(1234)
    cfg = ModelConfig(num_layers=a.num_layers, hidden_size=a.hidden_size,
                      num_attention_heads=4, max_position_embeddings=a.seq_length,
                      transformer_impl="local", swiglu=True, position_embedding_type="rope",
                      normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0,
                      disable_bias_linear=True)
    return build_model(cfg, LoopConfig(num_loops=a.num_loops, exit_loss=exit_loss),
                       a.vocab_size)


def build_models(tree: str, a) -> dict:
    """{variant: (model, optimizer)} built by ``tree``'s megaloop package."""
    _purge()
    sys.path.insert(0, tree)
    try:
        from megaloop.model.config import LoopConfig, ModelConfig
        from megaloop.model.looped_gpt import build_model

        assert os.path.dirname(sys.modules["megaloop"].__path__[0]) == tree
        models = {}
        for mode in ("expected", "last"):
            model = _build(a, mode)
            models[mode] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        return models
    finally:
        sys.path.remove(tree)
        _purge()


def single_stage(before: str, a) -> None:
    from megaloop import cpu_shim
    from megaloop.parallel.initialize import initialize_single_process

    cpu_shim.enable()
    initialize_single_process()
    torch.set_num_threads(a.threads)
    runs = {}
    for label, tree in (("before", before), ("after", ROOT)):
        for mode, pair in build_models(tree, a).items():
            runs[(label, mode)] = pair
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length), generator=g)
    labels = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length), generator=g)
    pos = torch.arange(a.seq_length).expand_as(ids)
    times = {k: [] for k in runs}
    keys = list(runs)
    for r in range(a.rounds + 2):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            model, opt = runs[k]
            start = time.perf_counter()
            model(ids, pos, None, labels=labels).objective.mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if r >= 2:  # warm-up rounds
                times[k].append(time.perf_counter() - start)
    print(f"(a) single stage: 0 + {a.num_layers} x {a.num_loops} + 0, hidden {a.hidden_size}, "
          f"seq {a.seq_length}, batch {a.micro_batch_size}, vocab {a.vocab_size}; median of "
          f"{a.rounds} interleaved steps")
    print(f"    {'exit loss':10s} {'before ms':>10s} {'after ms':>9s} {'after/before':>13s}")
    for mode in ("expected", "last"):
        b = statistics.median(times[("before", mode)]) * 1e3
        f = statistics.median(times[("after", mode)]) * 1e3
        print(f"    {mode:10s} {b:10.1f} {f:9.1f} {f / b:13.3f}")


def pipeline(before: str, a) -> None:
    flags = ["--sizes", "2", "--num-loops", str(a.num_loops), "--num-layers", str(a.num_layers),
             "--hidden-size", str(a.hidden_size), "--seq-length", str(a.seq_length),
             "--vocab-size", str(a.vocab_size), "--steps", str(a.pp_steps)]
    ms = {"before": [], "after": []}
    for _ in range(a.pp_repeats):
        for label, tree in (("before", before), ("after", ROOT)):
            out = subprocess.run([sys.executable, os.path.join(tree, "benchmarks",
                                                               "pipeline_bubble.py")] + flags,
                                 capture_output=True, text=True, check=True, cwd=tree).stdout
            row = re.search(r"^\s*2\s+\d+\s+([\d.]+)", out, re.M)
            ms[label].append(float(row.group(1)))
    b, f = statistics.median(ms["before"]), statistics.median(ms["after"])
    print(f"(b) pipeline, PP = 2 (benchmarks/pipeline_bubble.py --sizes 2), median of "
          f"{a.pp_repeats} alternating runs: before {b:.1f} ms/iter, after {f:.1f} ms/iter, "
          f"after/before {f / b:.3f}  (runs: before {ms['before']}, after {ms['after']})")


@contextlib.contextmanager
def _tree(tree: str, modules: dict):
    """Run with ``tree``'s megaloop package: its modules in ``sys.modules`` (those imported
    lazily meanwhile are kept in ``modules`` for the next time), the tree first on the path."""
    _purge()
    sys.modules.update(modules)
    sys.path.insert(0, tree)
    try:
        yield
    finally:
        modules.update({n: m for n, m in sys.modules.items()
                        if n == "megaloop" or n.startswith("megaloop.")})
        sys.path.remove(tree)
        _purge()


def decoding(before: str, a) -> None:
    """Tokens/s of each tree's Generator, the two trees' runs interleaved in rounds with a
    rotating order (after single_stage: the process is initialised)."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.decode_prompt),
                            generator=g).tolist()
    trees, runs = {}, {}
    for label, tree in (("before", before), ("after", ROOT)):
        modules: dict = {}
        with _tree(tree, modules):
            from megaloop.inference.early_exit import parse_exit
            from megaloop.inference.generate import Generator

            assert os.path.dirname(sys.modules["megaloop"].__path__[0]) == tree
            model = _build(a, "expected").eval()
            for text in ("none", a.decode_exit):
                gen = Generator(model, a.vocab_size, kv_policy="full",
                                exit_rule=parse_exit(text))
                gen.generate(prompts, 4)  # warm-up (and the tree's lazy imports)
                runs[(label, text)] = (gen, [], [])
        trees[label] = (tree, modules)
    keys = list(runs)
    for r in range(a.decode_rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            gen, rates, depths = runs[key]
            with _tree(*trees[key[0]]):
                gen.depths = []
                gen.generate(prompts, a.decode_tokens)
            rates.append(gen.stats["decode_forwards"] * len(prompts) / gen.stats["decode_s"])
            depths += gen.depths
    print(f"(c) decoding: batch {a.micro_batch_size}, prompt {a.decode_prompt}, "
          f"{a.decode_tokens} new tokens, KV cache full; median of {a.decode_rounds} "
          f"interleaved rounds")
    print(f"    {'exit rule':10s} {'before tok/s':>12s} {'after tok/s':>11s} {'after/before':>13s}"
          f" {'mean depth before/after':>24s}")
    for text in ("none", a.decode_exit):
        b = statistics.median(runs[("before", text)][1])
        f = statistics.median(runs[("after", text)][1])
        depth = "" if text == "none" else " / ".join(
            f"{sum(runs[(label, text)][2]) / len(runs[(label, text)][2]):.2f}"
            for label in ("before", "after"))
        print(f"    {text:10s} {b:12.1f} {f:11.1f} {f / b:13.3f} {depth:>24s}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rev", required=True, help="the git revision to compare against")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-loops", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pp-repeats", type=int, default=3)
    p.add_argument("--pp-steps", type=int, default=6)
    p.add_argument("--skip-pipeline", action="store_true")
    p.add_argument("--decode-exit", default="q:0.5", help="the exit rule of (c)")
    p.add_argument("--decode-prompt", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--decode-rounds", type=int, default=10)
    p.add_argument("--skip-decoding", action="store_true")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = os.path.join(tmp, "before")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", before, a.rev],
                       check=True, capture_output=True)
        try:
            short = subprocess.run(["git", "-C", before, "rev-parse", "--short", "HEAD"],
                                   capture_output=True, text=True).stdout.strip()
            print(f"before: {a.rev} ({short}), after: this tree; {os.cpu_count()} CPU cores",
                  flush=True)
            if not a.skip_pipeline:
                pipeline(before, a)
            single_stage(before, a)
            if not a.skip_decoding:
                decoding(before, a)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", before],
                           check=False, capture_output=True)


if __name__ == "__main__":
    main()
