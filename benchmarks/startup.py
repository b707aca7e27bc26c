"""What one rank pays at start-up and at a checkpoint, on CPU (prints only).

    python benchmarks/startup.py init  [--shapes 1.4B 8B --tp 1 2 4 8]
    python benchmarks/startup.py data  [--tokens 1e9 1e10 1e11 --dir /tmp/startup-data]
    python benchmarks/startup.py save  [--hidden-size 768 --num-layers 12 --vocab-size 32000]

``init``: per-rank time and peak host memory of initialising a model's weights, with megatron-core's
CPU initialisation (every full weight drawn, the rank's slice kept) and with megaloop's
(megaloop.model.sharded_init: only the rank's tiles drawn). Method: one subprocess per (shape, TP,
method) initialises, as TP rank 0 of TP, the shards of one transformer layer (QKV, projection,
SwiGLU fc1 with megatron-core's stride 2, fc2) and of 1/8 of the embedding's rows, through the very
function megatron-core's layers call; the whole model's time is layers x the layer's time + 2 x 8
x the embedding fraction's (embedding and untied output layer: the same shape and partitioning). Peak host memory is the whole model's resident shard (its
parameters / TP in fp32, on the host until the trainer moves the model to its GPU) plus the
largest transient (peak RSS while initialising the layer minus what stays resident; for
megatron-core's path at least the full embedding it draws, vocabulary x hidden in fp32). CPU seconds
(``process_time``) are what an idle core takes; wall seconds here include the machine's load.

``data``: synthetic datasets of N tokens (~1,000-token documents; a real ``.idx``, a sparse
``.bin`` of the right size), then for one rank: the cache key (megaloop's, and the whole-file
SHA-1 it replaces), the files' check, the index build (rank 0, cold cache) and the cache load
(every other rank, warm cache): seconds, bytes read (/proc/self/io ``rchar``) and ``.idx`` pages
mapped (/proc/self/smaps), each phase in a fresh subprocess.

``save``: a ~100M-parameter model trained on CPU; per save mode (synchronous, ``--async-save``):
step time without a save, step time of the step during which a save runs, and the time the save
blocks the training loop.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

EMBED_FRACTION = 8  # the embedding is timed on 1/8 of its rows (its cost is linear in them)
# hidden, ffn, heads, kv heads, vocab, layers (untied embedding and output layer)
SHAPES = {"1.4B": (2048, 5632, 16, 16, 49152, 24), "8B": (4096, 14336, 32, 8, 128256, 32)}


def _weights(shape: str):
    """(name, output size, input size, partition dim, stride, per layer) of a shape's weights."""
    h, ffn, heads, kv, vocab, _ = SHAPES[shape]
    d = h // heads
    return [("qkv", (heads + 2 * kv) * d, h, 0, 1, True), ("proj", h, heads * d, 1, 1, True),
            ("fc1", 2 * ffn, h, 0, 2, True), ("fc2", h, ffn, 1, 1, True),
            ("embedding", vocab, h, 0, 1, False), ("output", vocab, h, 0, 1, False)]


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])


def _init_child(shape: str, tp: int, method: str) -> dict:
    import functools

    import torch
    from megatron.core.tensor_parallel import layers

    from megaloop.model import sharded_init

    torch.set_num_threads(1)
    fn = sharded_init.initialize_shard if method == "shard" else sharded_init._MEGATRON_INIT
    init = functools.partial(torch.nn.init.normal_, mean=0.0, std=0.02)
    base = _rss_kib()
    out, keep = {}, []
    for name, rows, cols, dim, stride, per_layer in _weights(shape):
        if name == "output":  # the embedding's shape and partitioning: counted twice below
            continue
        if not per_layer:  # 1/EMBED_FRACTION of the vocabulary rows, scaled up below
            rows //= EMBED_FRACTION
        per = (rows if dim == 0 else cols) // tp
        w = torch.nn.Parameter(torch.empty((per, cols) if dim == 0 else (rows, per)))
        wall, cpu = time.perf_counter(), time.process_time()
        fn(w, rows, cols, per, dim, init, stride=stride, rank=0, world_size=tp,
           skip_set_tensor_parallel_attributes=True)
        out[name] = (time.perf_counter() - wall, time.process_time() - cpu)
        keep.append(w)
        if name == "fc2":  # the layer's weights done: what stays resident, what came and went
            resident = sum(x.numel() * 4 for x in keep) / 1024
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
            out["layer_transient_mib"] = max(0.0, (peak - base - resident) / 1024)
    del layers
    return out


def bench_init(args) -> None:
    print(f"init per rank, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, one thread "
          "per rank; whole model = layers x one layer + embedding + output")
    print(f"{'shape':>5} {'TP':>2} {'method':>9} {'wall s':>8} {'cpu s':>8} "
          f"{'host GiB':>9} {'shard GiB':>9}")
    for shape in args.shapes:
        h, ffn, heads, kv, vocab, n_layers = SHAPES[shape]
        for tp in args.tp:
            for method in ("megatron", "shard"):
                res = json.loads(subprocess.run(
                    [sys.executable, __file__, "_init_child", shape, str(tp), method],
                    capture_output=True, text=True, check=True,
                    env=dict(os.environ, OMP_NUM_THREADS="1")).stdout.splitlines()[-1])
                wall = cpu = 0.0
                params = 0
                for name, rows, cols, _, _, per_layer in _weights(shape):
                    k = n_layers if per_layer else EMBED_FRACTION
                    measured = res["embedding" if name == "output" else name]
                    wall += k * measured[0]
                    cpu += k * measured[1]
                    params += (n_layers if per_layer else 1) * rows * cols
                shard_gib = params / tp * 4 / 2**30
                # Transient: measured for the layer; megatron-core's full embedding master
                # (drawn whole on every rank) from its size, as it was timed on a fraction.
                transient = res["layer_transient_mib"] / 1024
                if method == "megatron":
                    transient = max(transient, vocab * h * 4 / 2**30)
                host = shard_gib + transient
                print(f"{shape:>5} {tp:>2} {method:>9} {wall:8.1f} {cpu:8.1f} {host:9.2f} "
                      f"{shard_gib:9.2f}", flush=True)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def _mapped_kib(path: str) -> int:
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:
                inside = len(head) == 6 and head[5] == path
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


def _make_dataset(prefix: str, tokens: float) -> None:
    """~1,000-token documents (uniform 500-1,500) totalling ``tokens``: a real .idx (with the
    digest preprocessing writes) and a sparse .bin; a hard link ``prefix_nodigest`` of both
    is the same data as a file made elsewhere (no digest)."""
    import numpy

    from megaloop.data.indexed_format import write_digest, write_index

    docs = int(tokens // 1000)
    lengths = numpy.random.default_rng(0).integers(500, 1501, docs, dtype=numpy.int32)
    write_digest(prefix, write_index(prefix + ".idx", numpy.uint16, lengths))
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(lengths.sum(dtype=numpy.int64)) * 2)
    for ext in (".idx", ".bin"):
        if os.path.exists(prefix + "_nodigest" + ext):
            os.remove(prefix + "_nodigest" + ext)
        os.link(prefix + ext, prefix + "_nodigest" + ext)


def _data_child(prefix: str, cache: str) -> dict:
    """One rank's start-up data phases, in order; per phase (seconds, bytes read, .idx KiB
    mapped)."""
    import shutil

    import torch

    from megaloop import runtime

    runtime.quiet_megatron()
    from megaloop.data.config import DataConfig, TokenizerConfig
    from megaloop.data.datasets import build_train_valid_test_datasets, content_key
    from megaloop.data.indexed_format import check_indexed_dataset, hash_file
    from megaloop.data.tokenizers import build_tokenizer

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1)
    tokenizer = build_tokenizer(TokenizerConfig(vocab_size=50000))
    cfg = DataConfig(data_path=[prefix], split="100,0,0", data_cache_path=cache)
    idx = os.path.abspath(prefix + ".idx")
    shutil.rmtree(cache, ignore_errors=True)
    out, keep = {}, []

    def phase(name, fn):
        mapped, read, start = _mapped_kib(idx), _rchar(), time.perf_counter()
        keep.append(fn())
        out[name] = (time.perf_counter() - start, _rchar() - read, _mapped_kib(idx) - mapped)

    phase("check (.bin/.idx sizes)", lambda: check_indexed_dataset(prefix))
    phase("cache key (digest)", lambda: content_key([prefix]))
    phase("cache key (no digest)", lambda: content_key([prefix + "_nodigest"]))
    phase("old key (SHA-1 of the .idx)", lambda: hash_file(idx))
    build = lambda: build_train_valid_test_datasets(cfg, tokenizer, 4096, 1, (1000, 0, 0))  # noqa
    phase("index build (rank 0, cold cache)", build)
    phase("index load (other ranks, warm)", build)
    return out


def bench_data(args) -> None:
    print(f"data start-up of one rank, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs; "
          "seconds | bytes read (rchar) | .idx KiB mapped")
    for tokens in args.tokens:
        os.makedirs(args.dir, exist_ok=True)
        prefix = os.path.join(args.dir, f"synthetic_{tokens:.0e}")
        start = time.perf_counter()
        _make_dataset(prefix, tokens)
        made = time.perf_counter() - start
        res = json.loads(subprocess.run(
            [sys.executable, __file__, "_data_child", prefix, prefix + "_cache"],
            capture_output=True, text=True, check=True,
            env=dict(os.environ, OMP_NUM_THREADS="1")).stdout.splitlines()[-1])
        print(f"{tokens:.0e} tokens, {int(tokens // 1000):,} documents, .idx "
              f"{os.path.getsize(prefix + '.idx') / 2**20:,.0f} MiB (written in {made:.0f} s)")
        for name, (secs, read, mapped) in res.items():
            print(f"  {name:<34} {secs:9.3f} s {read:>15,} B {mapped:>12,} KiB", flush=True)
        if not args.keep:
            import shutil

            shutil.rmtree(prefix + "_cache", ignore_errors=True)
            for path in os.listdir(args.dir):
                if path.startswith(os.path.basename(prefix)):
                    os.remove(os.path.join(args.dir, path))


def bench_save(args) -> None:
    """Step time without a save, during a save, and the time a save blocks, sync vs async."""
    import shutil
    import statistics
    import tempfile

    import torch

    from megaloop import cpu_shim, runtime

    runtime.quiet_megatron()
    torch.set_num_threads(args.threads)
    cpu_shim.enable()
    from megaloop.parallel.initialize import destroy, initialize_single_process
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer, count_parameters

    root = args.dir or tempfile.mkdtemp(prefix="megaloop_save_bench_")
    rows = []
    try:
        for mode in ("sync", "async"):
            cfg = parse_args([
                "--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
                "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
                "--disable-bias-linear", "--num-layers", str(args.num_layers),
                "--hidden-size", str(args.hidden_size),
                "--num-attention-heads", str(max(args.hidden_size // 64, 1)),
                "--seq-length", "128", "--max-position-embeddings", "128",
                "--micro-batch-size", "1", "--train-iters", "1000", "--mock-data",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", str(args.vocab_size),
                "--eval-iters", "0", "--save", os.path.join(root, mode)]
                + (["--async-save"] if mode == "async" else []))
            cfg.validate(world_size=1)
            if mode == "sync":
                initialize_single_process(cfg.parallel, cfg.training.seed)
            trainer = Trainer(cfg)
            params = count_parameters(trainer.model)

            def step():
                start = time.perf_counter()
                trainer.train_step()
                trainer.iteration += 1
                trainer.finalize_saves(blocking=False)
                return time.perf_counter() - start

            for _ in range(2):
                step()  # warm-up (Adam moments, allocator)
            plain = [step() for _ in range(args.steps)]
            blocked, during, total = [], [], []
            for _ in range(args.saves):
                start = time.perf_counter()
                trainer.save()
                blocked.append(time.perf_counter() - start)
                during.append(step())  # the step in which the background writers run
                trainer.finalize_saves(blocking=True)
                # From the save's start to its publication (sync: the save itself; async:
                # through the step(s) it overlapped, as the writers share the host's cores).
                total.append(blocked[-1] if mode == "sync" else time.perf_counter() - start)
                step()
            rows.append((mode, statistics.median(plain), statistics.median(during),
                         statistics.median(blocked), statistics.median(total)))
            if trainer.async_saver is not None:
                trainer.async_saver.close()
    finally:
        destroy()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"save, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, {args.threads} threads, "
          f"{params:,} parameters (hidden {args.hidden_size}, {args.num_layers} layers, vocab "
          f"{args.vocab_size}), medians of {args.saves} saves / {args.steps} steps")
    sync_blocked = rows[0][3]
    print(f"{'mode':>6} {'step s':>8} {'step during save s':>19} {'ratio':>6} "
          f"{'save blocks s':>14} {'of sync save':>13} {'save to published s':>20}")
    for mode, plain, during, blocked, total in rows:
        print(f"{mode:>6} {plain:8.3f} {during:19.3f} {during / plain:6.2f} {blocked:14.3f} "
              f"{blocked / sync_blocked:13.2f} {total:20.3f}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_init_child":
        print(json.dumps(_init_child(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_data_child":
        print(json.dumps(_data_child(sys.argv[2], sys.argv[3])))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("init", help="per-rank weight initialisation")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tp", nargs="+", type=int, default=[1, 2, 4, 8])
    p = sub.add_parser("data", help="one rank's data start-up at several dataset sizes")
    p.add_argument("--tokens", nargs="+", type=float, default=[1e9, 1e10, 1e11])
    p.add_argument("--dir", default="/tmp/megaloop-startup-data")
    p.add_argument("--keep", action="store_true", help="keep the synthetic datasets")
    p = sub.add_parser("save", help="step and blocking time of a save, sync vs async")
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    {"init": bench_init, "data": bench_data, "save": bench_save}[args.what](args)


if __name__ == "__main__":
    main()
