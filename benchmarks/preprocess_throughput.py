"""Preprocessing throughput against the raw tokenizer, on the demo corpus (prints, never asserts).

    python benchmarks/preprocess_throughput.py [--num-docs 50000] [--vocab-size 1024]

Generates the demo corpus, trains a sentencepiece BPE on it, then measures in the same run:

- raw: sentencepiece's batch encoder on the corpus texts, one thread (JSON already parsed);
- preprocess_data at 1 and 2 workers (JSONL in, .bin/.idx out, everything included).

The ratio is preprocessing tokens/s per worker over raw tokens/s on one thread; the target is
>= 0.8. With N workers on N cores the main process (reading, writing) shares the cores, so the
per-worker figure at N = cores is a lower bound.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megaloop import runtime  # noqa: E402

runtime.quiet_megatron()

from megaloop.data.config import TokenizerConfig  # noqa: E402
from megaloop.data.tokenizers import build_tokenizer, train_sentencepiece  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-docs", type=int, default=50000)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3, help="best of N timings")
    args = p.parse_args()

    import make_demo_corpus  # tools/, imported below after the path is set
    from megaloop.data.preprocess import preprocess

    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "demo.jsonl")
        make_demo_corpus.main(["--output", corpus, "--num-docs", str(args.num_docs)])
        texts = [json.loads(line)["text"] for line in open(corpus)]
        model = train_sentencepiece((ln for t in texts for ln in t.split("\n")),
                                    os.path.join(tmp, "tok"), args.vocab_size)
        cfg = TokenizerConfig("SentencePieceTokenizer", model)
        sp = build_tokenizer(cfg)._sp  # the raw sentencepiece processor

        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            encoded = sp.encode(texts, num_threads=1)
            best = min(best, time.perf_counter() - t0)
        n_tokens = sum(map(len, encoded))
        raw = n_tokens / best
        print(f"corpus: {len(texts)} docs, {os.path.getsize(corpus) / 2**20:.1f} MiB, "
              f"{n_tokens} tokens (vocab {args.vocab_size}), {os.cpu_count()} cores")
        print(f"raw sentencepiece batch encode, 1 thread: {len(texts) / best:,.0f} docs/s  "
              f"{raw:,.0f} tokens/s")
        for workers in (1, 2):
            secs = float("inf")
            for _ in range(args.repeats):
                stats = preprocess(corpus, os.path.join(tmp, f"out{workers}"), cfg,
                                   workers=workers, progress=False)
                secs = min(secs, stats.seconds)
            docs_s, tok_s = stats.documents_read / secs, stats.tokens["text"] / secs
            print(f"preprocess --workers {workers}: {docs_s:,.0f} docs/s  {tok_s:,.0f} tokens/s  "
                  f"per worker {docs_s / workers:,.0f} docs/s  {tok_s / workers:,.0f} tokens/s  "
                  f"ratio to raw {tok_s / workers / raw:.2f}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "tools"))
    main()
