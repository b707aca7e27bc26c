"""CPU trainer step time against a plain PyTorch loop on the same model (prints, never asserts).

    python benchmarks/cpu_trainer.py [--iters 100 --rounds 3 --hidden-size 64]

The two trainers of the training parity test (tests/test_training_parity.py) side by side:
megaloop's ``Trainer.train_step`` with the loop's step hooks (megatron-core's schedule, DDP,
optimizer and clipping, on the CPU shim, one forked gloo rank) and the independent loop built from ``transformers``' Llama
modules (the same weights, the same samples, AdamW, clipping), one thread each. For each of
dense 4, dense 8 and looped 2 x 4 it times ``--iters`` iterations of each trainer, alternating
which goes first over ``--rounds`` rounds, and prints the median seconds per iteration of each
and megaloop's over the reference's (``--shim-mode``: also megaloop with the CPU shim's
TorchFunctionMode on every op, as the shim worked before). The first iterations (start-up,
first-touch allocation) are left out of the timing (``--warmup``). Both run the global batch
in one forward and backward (``--micro-batch-size 2``: megaloop in two micro-batches, as the
parity test runs it, which is gradient accumulation the reference does not do).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the parity test's reference and launcher
from megaloop import runtime  # noqa: E402

runtime.quiet_megatron()
import torch  # noqa: E402

from megaloop import cpu_shim  # noqa: E402

cpu_shim.enable()
import megatron.core  # noqa: E402,F401  (import once, before forking ranks)
import test_training_parity as parity  # noqa: E402
from distributed import run_distributed  # noqa: E402

CASES = {"dense 4": (4, 1), "dense 8": (8, 1), "looped 2 x 4": (2, 4)}


def _megaloop(rank, world, argv, warmup, mode=False):
    """Initial weights, the samples in consumption order, and seconds per timed iteration.
    ``mode``: with the shim's TorchFunctionMode on every op (how the shim worked before its
    level 2 became patches; the mode then only maps devices, the placement check stays off)."""
    torch.set_num_threads(1)
    if mode:
        cpu_shim._push_check_mode()
    from megaloop.parallel.initialize import initialize
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer

    cfg = parse_args(argv)
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    trainer = Trainer(cfg)
    weights = parity.full_params(trainer.model)
    samples = [{k: torch.as_tensor(v).clone() for k, v in trainer.train_dataset[i].items()}
               for i in range(parity.ITERS * parity.GBS)]
    def step(i):  # as the training loop runs it, with its step hooks
        trainer.hooks.before_step(i)
        trainer.train_step()
        trainer.hooks.after_step(i + 1)

    for i in range(warmup):
        step(i)
    start = time.perf_counter()
    for i in range(warmup, parity.ITERS):
        step(i)
    return weights, samples, (time.perf_counter() - start) / (parity.ITERS - warmup)


def _reference(weights, samples, layers, loops, warmup):
    """Seconds per iteration of the plain loop (the parity test's, timed after ``warmup``)."""
    torch.set_num_threads(1)
    marks = []
    step = torch.optim.AdamW.step

    def timed(self, *args, **kwargs):  # the end of each iteration
        out = step(self, *args, **kwargs)
        marks.append(time.perf_counter())
        return out

    torch.optim.AdamW.step = timed
    try:
        parity.reference(weights, samples, layers, loops, "pre")
    finally:
        torch.optim.AdamW.step = step
    return (marks[-1] - marks[warmup - 1]) / (len(marks) - warmup)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="megaloop's micro-batch (default: the whole global batch of "
                        f"{parity.GBS}, one forward and backward per step as the reference "
                        "runs; the parity test's 2 runs two micro-batches, gradient "
                        "accumulation the reference does not do)")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--shim-mode", action="store_true",
                   help="also time megaloop with the shim's TorchFunctionMode on every op")
    a = p.parse_args(argv)
    parity.ITERS, parity.HIDDEN, parity.SEQ = a.iters, a.hidden_size, a.seq_length
    parity.FFN = 4 * a.hidden_size
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "corpus_text_document")
        run_distributed(lambda rank, world: parity._write_corpus(prefix), 1)
        print(f"hidden {a.hidden_size}, seq {a.seq_length}, global batch {parity.GBS}, "
              f"{a.iters} iterations ({a.warmup} untimed), one thread "
              f"each; seconds per iteration, median of {a.rounds} rounds:", flush=True)
        mbs = a.micro_batch_size or parity.GBS
        print(f"megaloop micro-batch {mbs} ({parity.GBS // mbs} per step); the reference runs "
              f"the global batch at once", flush=True)
        for name in a.cases:
            layers, loops = CASES[name]
            # (argparse keeps the last --micro-batch-size)
            argv = parity._argv(prefix, layers, loops, "pre") + ["--micro-batch-size", str(mbs)]
            ours, theirs, moded = [], [], []
            for r in range(a.rounds):
                order = ["megaloop", "reference"] + (["mode"] if a.shim_mode else [])
                for which in order[r % len(order):] + order[:r % len(order)]:
                    if which == "mode":
                        moded.append(run_distributed(_megaloop, 1, argv, a.warmup, True)[0][2])
                    elif which == "megaloop":
                        weights, samples, s = run_distributed(_megaloop, 1, argv, a.warmup)[0]
                        ours.append(s)
                    else:
                        if not ours:  # the reference needs megaloop's weights and samples
                            weights, samples, s = run_distributed(_megaloop, 1, argv,
                                                                  a.warmup)[0]
                        theirs.append(_reference(weights, samples, layers, loops, a.warmup))
            m, t = statistics.median(ours), statistics.median(theirs)
            print(f"  {name:>13}: megaloop {m * 1e3:7.1f} ms ({min(ours) * 1e3:.1f}-"
                  f"{max(ours) * 1e3:.1f}), reference {t * 1e3:7.1f} ms ({min(theirs) * 1e3:.1f}-"
                  f"{max(theirs) * 1e3:.1f}), megaloop / reference {m / t:.2f}x", flush=True)
            if moded:
                mm = statistics.median(moded)
                print(f"  {'':>13}  with the shim's mode on every op {mm * 1e3:7.1f} ms "
                      f"({min(moded) * 1e3:.1f}-{max(moded) * 1e3:.1f}), / reference "
                      f"{mm / t:.2f}x", flush=True)


if __name__ == "__main__":
    main()
