"""Preprocessing against the path Megatron-LM's tool takes, on ~20 MB of real text (prints, never
asserts).

    python benchmarks/preprocess_throughput.py [--megabytes 20] [--vocab-size 1000] [--repeats 3]

One run measures, on the same JSONL (the .py/.md/.txt/.rst files of this Python environment's
site-packages, one document per file) and the same sentencepiece BPE model trained on it:

- the Megatron-LM path: a fresh process that imports torch and megatron-core, encodes each
  document with sentencepiece and writes it with megatron-core's ``IndexedDatasetBuilder``
  (what Megatron-LM's tools/preprocess_data.py does per document, minus its worker pool);
- ``tools/preprocess_data.py --workers 1`` and ``--workers 2``, whole runs as a user starts them;
- steady-state throughput at 1 and 2 workers: ``preprocess()`` called in this process, timed
  from the first batch to the index written (start-up excluded);
- byte identity of every output with the Megatron-LM path's;
- the machine's ceiling at the same moments: sentencepiece alone in 2 forked processes against
  1 (on a 2-core machine shared with other work this is often far below 2).

Goals (issue "preprocessing at twice Megatron-LM's speed"): whole run at 1 worker <= 0.5x the
Megatron-LM path; 2 workers >= 1.6x the steady-state throughput of 1 worker; identical bytes.
Each figure is the best of ``--repeats`` runs; CPU seconds are printed next to wall times
because other processes sharing the cores lengthen wall times but not CPU times.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megaloop.data.config import TokenizerConfig  # noqa: E402
from megaloop.data.preprocess import preprocess  # noqa: E402
from megaloop.data.tokenizers import train_sentencepiece  # noqa: E402

# The Megatron-LM path, run as its own process so that its start-up counts as it does for a user.
MEGATRON_PATH = r"""
import json, sys
import numpy, sentencepiece, torch  # noqa: F401  (Megatron-LM's tool imports torch)
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
src, model, prefix = sys.argv[1:]
sp = sentencepiece.SentencePieceProcessor(model_file=model)
builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(sp.get_piece_size()))
with open(src, "rb") as f:
    for line in f:
        ids = sp.encode(json.loads(line)["text"]) + [sp.eos_id()]
        builder.add_document(numpy.array(ids, dtype=numpy.int64), [len(ids)])
builder.finalize(prefix + ".idx")
"""


def gather_corpus(path: str, megabytes: float) -> tuple[int, int]:
    """Real text found on this machine: site-packages source and docs, one file per line."""
    import sysconfig

    root = sysconfig.get_paths()["purelib"]
    target, total, docs = int(megabytes * 2**20), 0, 0
    with open(path, "w") as out:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                if not name.endswith((".py", ".md", ".txt", ".rst")):
                    continue
                try:
                    with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                        text = f.read()
                except (OSError, UnicodeDecodeError):
                    continue
                if text.strip():
                    line = json.dumps({"text": text}) + "\n"
                    out.write(line)
                    total, docs = total + len(line), docs + 1
                    if total >= target:
                        return docs, total
    return docs, total


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process and its children) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def best(cmd: list[str], repeats: int) -> tuple[float, float]:
    """Least wall and least CPU seconds over ``repeats`` runs."""
    runs = [timed(cmd) for _ in range(repeats)]
    return min(r[0] for r in runs), min(r[1] for r in runs)


def raw_encode_seconds(model: str, texts: list[str], processes: int) -> float:
    """Wall seconds of sentencepiece's batch encoder alone on ``texts`` split over forked
    processes (no JSON, no writing): what the cores can give right now."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    start, pids = time.perf_counter(), []
    for i in range(processes):
        pid = os.fork()
        if pid == 0:
            sp.encode(texts[i::processes], num_threads=1)
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    return time.perf_counter() - start


def read(prefix: str) -> bytes:
    return b"".join(open(prefix + ext, "rb").read() for ext in (".bin", ".idx"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--megabytes", type=float, default=20.0)
    p.add_argument("--vocab-size", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3, help="best of N timings")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "corpus.jsonl")
        docs, size = gather_corpus(src, args.megabytes)
        with open(src) as f:
            sentences = [ln for line in f for ln in json.loads(line)["text"].split("\n")[:400]]
        model = train_sentencepiece(sentences[:300000], os.path.join(tmp, "sp"),
                                    args.vocab_size, num_threads=os.cpu_count())
        cfg = TokenizerConfig("SentencePieceTokenizer", model)
        print(f"corpus: {docs} documents, {size / 2**20:.1f} MiB of site-packages text; "
              f"sentencepiece BPE vocab {args.vocab_size}; {os.cpu_count()} cores; "
              f"best of {args.repeats}")

        ref = os.path.join(tmp, "megatron")
        mc_wall, mc_cpu = best([sys.executable, "-W", "ignore", "-c", MEGATRON_PATH, src, model,
                                ref], args.repeats)
        tool = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", src,
                "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
                "--append-eod", "--no-progress"]
        whole = {}
        for w in (1, 2):
            wall, cpu = best(tool + ["--workers", str(w), "--output-prefix",
                                          os.path.join(tmp, f"tool{w}")], args.repeats)
            whole[w] = (wall, cpu)

        # Steady state, interleaved with the machine's own ceiling measured the same way
        # (sentencepiece alone on the parsed texts in 1 and 2 forked processes), so that both
        # see the same load from whatever else shares the cores.
        texts = [json.loads(line)["text"] for line in open(src, "rb")]
        steady, raw, tokens = {1: [], 2: []}, {1: [], 2: []}, 0
        for _ in range(args.repeats):
            for w in (1, 2):
                raw[w].append(raw_encode_seconds(model, texts, w))
                stats = preprocess(src, os.path.join(tmp, f"lib{w}"), cfg, workers=w,
                                   append_eod=True, progress=False)
                steady[w].append(stats.seconds)
                tokens = stats.tokens["text"]
        steady = {w: min(v) for w, v in steady.items()}
        raw = {w: min(v) for w, v in raw.items()}

        reference = read(ref)
        identical = all(read(os.path.join(tmp, name)) == reference
                        for name in ("tool1_text_document", "tool2_text_document",
                                     "lib1_text_document", "lib2_text_document"))

    print(f"{'':38s} {'wall s':>8s} {'cpu s':>8s} {'vs Megatron-LM path':>20s}")
    print(f"{'Megatron-LM path (torch + mcore)':38s} {mc_wall:8.2f} {mc_cpu:8.2f} {1.0:20.2f}")
    for w in (1, 2):
        wall, cpu = whole[w]
        print(f"{f'megaloop --workers {w} (whole run)':38s} {wall:8.2f} {cpu:8.2f} "
              f"{wall / mc_wall:20.2f}")
    for w in (1, 2):
        print(f"steady state, {w} worker(s): {tokens / steady[w] / 1e6:.2f} M tokens/s "
              f"({steady[w]:.2f} s for {tokens:,} tokens)")
    print(f"whole run at 1 worker / Megatron-LM path: {whole[1][0] / mc_wall:.2f}x "
          "(goal <= 0.5)")
    print(f"steady-state throughput, 2 workers / 1 worker: {steady[1] / steady[2]:.2f}x "
          "(goal >= 1.6)")
    print(f"  this machine's ceiling now: sentencepiece alone in 2 processes / 1 process: "
          f"{raw[1] / raw[2]:.2f}x ({raw[1]:.2f} s / {raw[2]:.2f} s)")
    print(f"outputs byte-identical to the Megatron-LM path's: {'yes' if identical else 'NO'}")


if __name__ == "__main__":
    main()
