"""Steps per second of megaloop's training step with and without ``gc.freeze()`` after the first
step (prints, never asserts).

    python benchmarks/gc_freeze.py [--iters 100 --rounds 3 --hidden-size 64]

The step hooks used to freeze what exists after the first step (the model, the optimizer state,
megatron-core's buffers) out of the garbage collector's generations, so that the collections a
step's garbage triggers would not traverse it. This times the trainer's step with its hooks (the
CPU training parity test's models, one forked gloo rank, one thread) with that freeze and
without it, alternating which goes first over ``--rounds`` rounds, and prints the median steps/s
of each with the range over the rounds, the collections of each generation during the timed
steps, and what one full collection costs with nothing frozen. The first ``--warmup`` steps are
left out of the timing. The machine's load matters: say what ``uptime`` said.

What it showed (2 shared cores, load average about 1 during the runs): the freeze's difference
in steps/s stayed within the spread of the rounds (dense 4, 300 steps: 23.7 steps/s frozen,
24.9 plain; 100 steps: +17% and -3% for the two cases, ranges overlapping). Without it a run
makes one full collection (about 240 ms here) after its start-up and none in the next 300 steps,
about 2% of them; so the hooks no longer freeze.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the parity test's models and launcher
from megaloop import runtime  # noqa: E402

runtime.quiet_megatron()
import torch  # noqa: E402

from megaloop import cpu_shim  # noqa: E402

cpu_shim.enable()
import megatron.core  # noqa: E402,F401  (import once, before forking ranks)
import test_training_parity as parity  # noqa: E402
from distributed import run_distributed  # noqa: E402

CASES = {"dense 4": (4, 1), "looped 2 x 4": (2, 4)}


def _steps_per_second(rank, world, argv, warmup, freeze):
    """Timed steps/s of the trainer's step with its hooks, ``freeze``: everything frozen after
    the first step; the collections per generation, the objects frozen, and the seconds of one
    full collection afterwards with nothing frozen."""
    torch.set_num_threads(1)
    from megaloop.training.run_config import parse_args
    from megaloop.parallel.initialize import initialize
    from megaloop.training.trainer import Trainer

    cfg = parse_args(argv)
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    trainer = Trainer(cfg)

    def step(i):  # as the training loop runs it, with its step hooks
        trainer.hooks.before_step(i)
        trainer.train_step()
        trainer.hooks.after_step(i + 1)
        if freeze and i == 0:  # what the hooks did after the first step
            gc.collect()
            gc.freeze()

    for i in range(warmup):
        step(i)
    before = [s["collections"] for s in gc.get_stats()]
    start = time.perf_counter()
    for i in range(warmup, parity.ITERS):
        step(i)
    seconds = time.perf_counter() - start
    after = [s["collections"] for s in gc.get_stats()]
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    t0 = time.perf_counter()
    gc.collect()  # what a full collection costs when the run's objects are in sight
    full = time.perf_counter() - t0
    return (parity.ITERS - warmup) / seconds, [a - b for a, b in zip(after, before)], \
        frozen, full


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    a = p.parse_args(argv)
    parity.ITERS, parity.HIDDEN, parity.SEQ = a.iters, a.hidden_size, a.seq_length
    parity.FFN = 4 * a.hidden_size
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "corpus_text_document")
        run_distributed(lambda rank, world: parity._write_corpus(prefix), 1)
        print(f"hidden {a.hidden_size}, seq {a.seq_length}, global batch {parity.GBS}, "
              f"{a.iters} steps ({a.warmup} untimed), one thread; steps/s, median (min-max) "
              f"of {a.rounds} rounds; gc collections per generation in the timed steps:",
              flush=True)
        for name in a.cases:
            layers, loops = CASES[name]
            args = parity._argv(prefix, layers, loops, "pre") + ["--micro-batch-size",
                                                                 str(parity.GBS)]
            rates = {True: [], False: []}
            counts, fulls = {}, []
            for r in range(a.rounds):
                for freeze in ((True, False) if r % 2 == 0 else (False, True)):
                    rate, collected, frozen, full = run_distributed(
                        _steps_per_second, 1, args, a.warmup, freeze)[0]
                    rates[freeze].append(rate)
                    counts[freeze] = (collected, frozen)
                    fulls.append(full)
            for freeze in (True, False):
                x = rates[freeze]
                collected, frozen = counts[freeze]
                print(f"  {name:>13} {'freeze' if freeze else 'plain':>6}: "
                      f"{statistics.median(x):6.2f} steps/s ({min(x):.2f}-{max(x):.2f}); "
                      f"collections {collected}, {frozen} objects frozen", flush=True)
            gain = statistics.median(rates[True]) / statistics.median(rates[False]) - 1
            print(f"  {name:>13} freeze vs plain: {gain:+.1%}; one full collection with "
                  f"nothing frozen: {statistics.median(fulls) * 1e3:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
