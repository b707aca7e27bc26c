"""Pipeline bubble of a looped model on CPU (prints, never asserts).

    python benchmarks/pipeline_bubble.py [--sizes 1 2 4 --num-loops 4 --num-layers 4
        --hidden-size 128 --seq-length 128 --micro-batch-size 1 --global-batch-size 8
        --vocab-size 1024 --steps 6]

For each pipeline size P (one forked gloo rank per stage, one thread each) the trainer runs the
same model on the same global batch: K core layers split over P stages, T loops as V = T virtual
chunks (interleaved 1F1B; T = 1 would use plain 1F1B). Printed per P:

- ms/iter: median wall time of a full training iteration (schedule + optimizer), slowest rank;
- speedup against P = 1 at the same global batch;
- measured bubble: the part of the schedule's wall time a stage spends neither in a chunk's
  forward nor in its backward (waiting for its neighbours, plus p2p), averaged over stages. It is
  timed by wrapping megatron-core's ``schedules.forward_step`` / ``backward_step``;
- theoretical bubble of interleaved 1F1B with V chunks and M micro-batches (Narayanan et al.
  2021): idle / total = (P - 1) / (V * M + P - 1), for equal chunk times.

- predicted: the bubble of megaloop/parallel/balance.py's cost model (the schedule replayed on
  FLOP costs of every chunk), for the layout the row runs.

Each P > 1 runs side by side (``--balance``): the even split; ``layers``, the split
``--pipeline-balance auto`` chooses when no LM loss may move; and ``auto``, the split and the
steps whose LM loss the first stage computes (``r1,3``: steps 1 and 3).

Caveats, on purpose in the output: the chunks are not equal (the last stage reads out at every
loop step: step norm, coda, gate, LM head and cross-entropy; the first stage embeds once), so the
measured bubble exceeds the theory by the imbalance; gloo's p2p on CPU adds waiting the cost
model does not count; and ranks beyond the machine's cores share cores, so their "bubble" also
holds time spent waiting for a CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the fork-per-rank launcher of the test suite
from megaloop import runtime  # noqa: E402

runtime.quiet_megatron()

import torch  # noqa: E402

from megaloop import cpu_shim  # noqa: E402

cpu_shim.enable()
import megatron.core  # noqa: E402,F401  (import once, before forking ranks)
from distributed import run_distributed  # noqa: E402


def _rank(rank, world, flags, steps):
    from megatron.core.pipeline_parallel import schedules

    from megaloop.parallel.initialize import initialize
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer

    busy = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - start
        return wrapper

    schedules.forward_step = timed(schedules.forward_step)
    schedules.backward_step = timed(schedules.backward_step)
    cfg = parse_args(flags)
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    trainer = Trainer(cfg)
    run = trainer._run
    schedule_time = [0.0]

    def timed_run(*args, **kwargs):
        start = time.perf_counter()
        out = run(*args, **kwargs)
        schedule_time[0] += time.perf_counter() - start
        return out

    trainer._run = timed_run
    iters, idle, busy_ms = [], [], []
    for i in range(steps + 2):
        torch.distributed.barrier()
        busy[0] = schedule_time[0] = 0.0
        start = time.perf_counter()
        trainer.train_step()
        elapsed = time.perf_counter() - start
        if i >= 2:  # warm-up: allocator, first-touch of buffers
            iters.append(elapsed)
            idle.append(1.0 - busy[0] / schedule_time[0])
            busy_ms.append(busy[0] * 1000)
    return iters, idle, busy_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--num-loops", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--balance", nargs="+", default=["even", "layers", "auto"],
                   choices=["even", "layers", "auto"],
                   help="what to run at each P > 1, side by side: --pipeline-balance even; "
                        "`layers`: --pipeline-balance auto choosing the split only (no LM loss "
                        "moves to the first stage); auto: split and moved LM losses")
    a = p.parse_args()
    base = ["--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
            "--disable-bias-linear",
            "--num-layers", str(a.num_layers), "--num-loops", str(a.num_loops),
            "--hidden-size", str(a.hidden_size), "--num-attention-heads", "4",
            "--seq-length", str(a.seq_length), "--max-position-embeddings", str(a.seq_length),
            "--micro-batch-size", str(a.micro_batch_size),
            "--global-batch-size", str(a.global_batch_size), "--train-iters", str(a.steps + 2),
            "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(a.vocab_size), "--eval-iters", "0"]
    M = a.global_batch_size // a.micro_batch_size
    V = a.num_loops
    print(f"looped model 0 + {a.num_layers} x {a.num_loops} + 0, hidden {a.hidden_size}, "
          f"seq {a.seq_length}, vocab {a.vocab_size}; global batch {a.global_batch_size} = "
          f"{M} micro-batches of {a.micro_batch_size}; {os.cpu_count()} CPU cores, 1 thread/rank")
    print(f"{'P':>3} {'V':>3} {'split':>16} {'ms/iter':>9} {'speedup':>8} "
          f"{'bubble measured':>16} {'predicted':>10} {'theory':>7}  busy ms per stage "
          f"(forward + backward)")
    base_ms = None
    runs = [(P, b) for P in a.sizes for b in (a.balance if P > 1 else ["even"])]
    for P, how in runs:
        flags = base + ["--pipeline-model-parallel-size", str(P)]
        split, predicted = "-", 0.0
        if P > 1:
            from megaloop.parallel.balance import plan
            from megaloop.training.run_config import parse_args

            flags += ["--pipeline-balance", "even" if how == "even" else "auto"]
            if how == "layers":
                flags += ["--pipeline-first-stage-readouts", ""]
            cfg = parse_args(flags)
            try:
                cfg.validate(world_size=P)
            except ValueError as error:
                print(f"{P:>3} --pipeline-balance {how}: {error}")
                continue
            chosen = plan(cfg, a.vocab_size, M)
            split, predicted = f"{how} {'/'.join(map(str, chosen.layers))}", chosen.bubble
            if chosen.first_readouts:  # steps whose LM loss the first stage computes
                split += f" r{','.join(map(str, chosen.first_readouts))}"
        results = run_distributed(_rank, P, flags, a.steps, timeout=900)
        per_step = [max(r[0][i] for r in results) for i in range(a.steps)]
        ms = statistics.median(per_step) * 1000
        idle = statistics.mean(statistics.median(r[1]) for r in results)
        base_ms = base_ms or (ms if P == 1 else None)
        theory = (P - 1) / (V * M + P - 1) if P > 1 else 0.0
        speedup = f"{base_ms / ms:8.2f}" if base_ms else f"{'-':>8}"
        note = " (more ranks than cores)" if P > (os.cpu_count() or 1) else ""
        busy = " ".join(f"{statistics.median(r[2]):.0f}" for r in results)
        print(f"{P:>3} {V if P > 1 else 1:>3} {split:>16} {ms:9.1f} {speedup} {idle:16.1%} "
              f"{predicted:10.1%} {theory:7.1%}  [{busy}]{note}", flush=True)


if __name__ == "__main__":
    main()
