"""Checkpoint size and save/load time for a ~50M-parameter looped model, on CPU (prints only).

    python benchmarks/checkpoint_io.py [--hidden-size 512 --num-layers 8 --vocab-size 32000
                                        --num-loops 4 --repeats 3 --threads 2]

One process, a size-1 gloo group and megaloop's CPU shim; the model, megatron optimizer and LR
scheduler are built exactly as the trainer builds them (``Trainer`` with mock data), one training
step fills the Adam moments, then ``save_checkpoint`` and ``load_checkpoint`` are timed (the
median of ``--repeats``; every save writes a new iteration, every load reads it back into the live
model and optimizer). The checkpoint's size on disk is its files' bytes: fp32 weights plus two fp32
Adam moments, so about 12 bytes per parameter. Printed: parameters, size (MiB and bytes per
parameter), save s, load s, write and read throughput (MiB/s).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megaloop import runtime  # noqa: E402

runtime.quiet_megatron()


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(path) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-loops", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    torch_threads = args.threads

    import torch

    torch.set_num_threads(torch_threads)
    from megaloop import cpu_shim

    cpu_shim.enable()
    from megaloop.parallel.initialize import destroy, initialize_single_process
    from megaloop.training import checkpointing
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer, count_parameters

    heads = max(args.hidden_size // 64, 1)
    cfg = parse_args([
        "--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
        "--disable-bias-linear",
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(heads), "--num-loops", str(args.num_loops),
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
        "--train-iters", "10", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(args.vocab_size), "--eval-iters", "0"])
    cfg.validate(world_size=1)
    initialize_single_process(cfg.parallel, cfg.training.seed)
    trainer = Trainer(cfg)
    params = count_parameters(trainer.model)
    trainer.train_step()  # Adam moments exist from here on

    root = args.dir or tempfile.mkdtemp(prefix="megaloop_ckpt_bench_")
    saves, loads = [], []
    try:
        for i in range(1, args.repeats + 1):
            start = time.perf_counter()
            path = checkpointing.save_checkpoint(root, i, trainer.model, trainer.optimizer,
                                                 trainer.scheduler, run_config=cfg.to_dict())
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            checkpointing.load_checkpoint(root, trainer.model, trainer.optimizer,
                                          trainer.scheduler)
            loads.append(time.perf_counter() - start)
        size = _dir_bytes(path)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        destroy()

    mib = size / 2**20
    save_s, load_s = statistics.median(saves), statistics.median(loads)
    print(f"model: {args.num_layers} layers x T={args.num_loops}, hidden {args.hidden_size}, "
          f"vocab {args.vocab_size} (tied), {torch_threads} threads")
    print(f"parameters            {params:,}")
    print(f"checkpoint size       {mib:.1f} MiB ({size / params:.2f} bytes/parameter: "
          f"fp32 weights + Adam exp_avg + exp_avg_sq)")
    print(f"save (median of {args.repeats})    {save_s:.2f} s  ({mib / save_s:.0f} MiB/s)   "
          f"all: {', '.join(f'{s:.2f}' for s in saves)}")
    print(f"load (median of {args.repeats})    {load_s:.2f} s  ({mib / load_s:.0f} MiB/s)   "
          f"all: {', '.join(f'{s:.2f}' for s in loads)}")


if __name__ == "__main__":  # dist_checkpointing's writer may start processes: keep the guard
    main()
