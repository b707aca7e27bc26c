"""JSONL -> Megatron indexed datasets (the engine behind tools/preprocess_data.py).

Layout of the work: the main process reads raw lines in fixed-size chunks and hands them to a
pool of worker processes; each worker parses its chunk, batch-encodes every text of the chunk in
one call into the tokenizer's native encoder, and returns flat numpy arrays (one pickle per
chunk, not per document). The main process writes the results strictly in input order through
megatron-core's ``IndexedDatasetBuilder``. Chunk boundaries depend only on ``chunk_size``, so
the output is byte-identical for any number of workers.

Outputs go to temporary names and are renamed only when the whole input succeeded: a final
``.bin/.idx`` pair never holds a partial run.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from itertools import chain
from typing import Iterator, Optional

import numpy
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from megaloop.data.config import TokenizerConfig
from megaloop.data.jsonl import BadInputError, read_chunks
from megaloop.data.sft import assemble, sft_segments
from megaloop.data.tokenizers import Tokenizer, build_tokenizer

SFT_KEYS = ("text", "lossmask")


@dataclass
class PreprocessStats:
    documents_read: int = 0
    bad_lines: int = 0
    documents: dict[str, int] = field(default_factory=dict)  # written, per key
    empty: dict[str, int] = field(default_factory=dict)  # skipped because empty, per key
    tokens: dict[str, int] = field(default_factory=dict)  # per key (EODs included)
    seconds: float = 0.0
    outputs: list[str] = field(default_factory=list)  # dataset prefixes written

    def summary(self) -> str:
        lines = [f"documents read: {self.documents_read}   bad lines skipped: {self.bad_lines}"]
        for key in self.documents:
            lines.append(f"[{key}] documents: {self.documents[key]}   tokens: {self.tokens[key]}"
                         f"   empty skipped: {self.empty[key]}")
        total = next(iter(self.tokens.values()), 0)  # first key's tokens (sft: the text)
        secs = max(self.seconds, 1e-9)
        lines.append(f"time: {self.seconds:.2f} s   {self.documents_read / secs:,.0f} docs/s   "
                     f"{total / secs:,.0f} tokens/s")
        return "\n".join(lines)


# -- worker side -------------------------------------------------------------------------------

_worker: Optional["_ChunkEncoder"] = None


@dataclass
class ChunkResult:
    documents_read: int
    bad: list[tuple[int, str]]  # (line number, reason)
    arrays: dict[str, tuple[numpy.ndarray, numpy.ndarray]]  # key -> (flat values, lengths)
    empty: dict[str, int]


class _ChunkEncoder:
    def __init__(self, tokenizer: Tokenizer, data_format: str, json_keys: list[str],
                 append_eod: bool):
        self.tok = tokenizer
        self.data_format = data_format
        self.json_keys = json_keys
        self.append_eod = append_eod
        self.dtype = DType.optimal_dtype(tokenizer.vocab_size)

    def parse(self, first: int, lines: list[bytes]):
        """[(line number, texts or sft segments)], bad lines. Blank lines are skipped."""
        docs, bad = [], []
        for lineno, raw in enumerate(lines, start=first):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as err:
                bad.append((lineno, f"not valid JSON ({err})"))
                continue
            if self.data_format == "sft":
                try:
                    docs.append((lineno, sft_segments(obj)))
                except ValueError as err:
                    bad.append((lineno, str(err)))
                continue
            if not isinstance(obj, dict):
                bad.append((lineno, "expected a JSON object"))
                continue
            missing = [k for k in self.json_keys if not isinstance(obj.get(k), str)]
            if missing:
                bad.append((lineno, f"missing or non-string key(s) {missing} "
                                    f"(--json-keys {' '.join(self.json_keys)})"))
                continue
            docs.append((lineno, [obj[k] for k in self.json_keys]))
        return docs, bad

    def tokenize(self, docs: list[tuple[int, list[str]]]):
        """Encodings of every document's texts in one batch call, and rejected documents.

        If the tokenizer rejects some text (e.g. NullTokenizer on words), the chunk is redone
        one document at a time so that the error names the line.
        """
        try:
            encoded = iter(self.tok.tokenize_batch([t for _, texts in docs for t in texts]))
            return [(lineno, [next(encoded) for _ in texts]) for lineno, texts in docs], []
        except Exception:
            ok, bad = [], []
            for lineno, texts in docs:
                try:
                    ok.append((lineno, [self.tok.tokenize(t) for t in texts]))
                except Exception as err:
                    bad.append((lineno, f"the tokenizer rejects it ({type(err).__name__}: {err})"))
            return ok, bad

    def flatten(self, docs: list[list[int]], dtype) -> tuple[numpy.ndarray, numpy.ndarray]:
        lengths = numpy.fromiter(map(len, docs), dtype=numpy.int64, count=len(docs))
        values = numpy.fromiter(chain.from_iterable(docs), dtype=dtype, count=int(lengths.sum()))
        return values, lengths

    def __call__(self, chunk: tuple[int, list[bytes]]) -> ChunkResult:
        docs, bad = self.parse(*chunk)
        if self.data_format == "sft":
            segments = dict(docs)
            encoded, rejected = self.tokenize([(n, [s[0] for s in segs]) for n, segs in docs])
            return self._assemble_sft(segments, encoded, sorted(bad + rejected), len(docs))
        encoded, rejected = self.tokenize(docs)
        arrays, empty = {}, {}
        for j, key in enumerate(self.json_keys):
            kept = [ids[j] for _, ids in encoded if ids[j]]
            empty[key] = len(encoded) - len(kept)
            if self.append_eod:
                for ids in kept:
                    ids.append(self.tok.eod)
            arrays[key] = self.flatten(kept, self.dtype)
        return ChunkResult(len(docs), sorted(bad + rejected), arrays, empty)

    def _assemble_sft(self, segments, encoded, bad, n_docs) -> ChunkResult:
        tokens, masks = [], []
        for lineno, pieces in encoded:
            segs = segments[lineno]
            # An example whose responses are all empty is a data error, not a lesson in
            # stopping at once: skip it (counted as empty).
            if any(ids for (_, is_response, _), ids in zip(segs, pieces) if is_response):
                ids, mask = assemble(segs, pieces, self.tok.eod)
                tokens.append(ids)
                masks.append(mask)
        n_empty = len(encoded) - len(tokens)
        arrays = {"text": self.flatten(tokens, self.dtype),
                  "lossmask": self.flatten(masks, numpy.uint8)}
        return ChunkResult(n_docs, bad, arrays, {k: n_empty for k in SFT_KEYS})


def _init_worker(tok_cfg: TokenizerConfig, *args) -> None:
    global _worker
    _worker = _ChunkEncoder(build_tokenizer(tok_cfg), *args)


def _encode(chunk: tuple[int, list[bytes]]) -> ChunkResult:
    return _worker(chunk)


# -- main side ---------------------------------------------------------------------------------

class ChunkBuilder(IndexedDatasetBuilder):
    """megatron-core's builder, fed a whole chunk of documents per call.

    Writes exactly what ``add_document(doc, [len(doc)])`` per document writes (one sequence per
    document), in one write: per-document calls cost the main process more than the workers'
    tokenization saves once there are two workers.
    """

    def add_documents(self, values: numpy.ndarray, lengths: numpy.ndarray) -> None:
        self.data_file.write(numpy.asarray(values, dtype=self.dtype).tobytes(order="C"))
        first = len(self.sequence_lengths)
        self.sequence_lengths.extend(lengths.tolist())
        self.document_indices.extend(range(first + 1, first + len(lengths) + 1))


def _ordered_results(chunks, workers: int, init_args: tuple) -> Iterator[ChunkResult]:
    """Results in input order with at most ``4 * workers`` chunks in flight.

    Like ``Pool.imap`` (ordered), but imap's feeder thread reads the whole input ahead of the
    workers; a bounded window keeps memory flat on corpora larger than RAM.
    """
    if workers == 0:  # in-process: debugging, and tiny inputs
        _init_worker(*init_args)
        yield from map(_encode, chunks)
        return
    with multiprocessing.get_context("fork").Pool(workers, _init_worker, init_args) as pool:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode, (chunk,)))
            if len(pending) >= 4 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def preprocess(input_path: str, output_prefix: str, tok_cfg: TokenizerConfig,
               json_keys: tuple[str, ...] = ("text",), data_format: str = "pretrain",
               workers: int = 1, append_eod: bool = False, skip_bad_lines: bool = False,
               chunk_size: int = 256, log_interval: int = 1000, progress: bool = True
               ) -> PreprocessStats:
    """Tokenize ``input_path`` (JSONL or JSONL.gz) into ``<output_prefix>_<key>_document``.

    Raises BadInputError on the first bad line unless ``skip_bad_lines``.
    """
    from tqdm import tqdm

    tokenizer = build_tokenizer(tok_cfg)
    keys = SFT_KEYS if data_format == "sft" else tuple(json_keys)
    token_dtype = DType.optimal_dtype(tokenizer.vocab_size)
    dtypes = {k: numpy.uint8 if k == "lossmask" else token_dtype for k in keys}
    finals = {k: output_prefix_for(output_prefix, k) for k in keys}
    tmp = f".tmp{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    builders = {k: ChunkBuilder(finals[k] + ".bin" + tmp, dtype=dtypes[k]) for k in keys}
    stats = PreprocessStats(documents={k: 0 for k in keys}, empty={k: 0 for k in keys},
                            tokens={k: 0 for k in keys})
    start = time.perf_counter()
    bar = tqdm(unit="doc", disable=not progress, smoothing=0.1, dynamic_ncols=True)
    next_log = log_interval
    init_args = (tok_cfg, data_format, list(json_keys), append_eod)
    try:
        for result in _ordered_results(read_chunks(input_path, chunk_size), workers, init_args):
            if result.bad and not skip_bad_lines:
                lineno, reason = result.bad[0]
                raise BadInputError(f"{input_path}:{lineno}: {reason} (pass --skip-bad-lines to "
                                    "skip such lines)")
            stats.bad_lines += len(result.bad)
            stats.documents_read += result.documents_read
            for key, (values, lengths) in result.arrays.items():
                builders[key].add_documents(values, lengths)
                stats.documents[key] += len(lengths)
                stats.tokens[key] += len(values)
                stats.empty[key] += result.empty[key]
            bar.update(result.documents_read)
            if stats.documents_read >= next_log:
                next_log += log_interval
                rate = stats.tokens[keys[0]] / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)
        for key in keys:
            builders[key].finalize(finals[key] + ".idx" + tmp)
    except BaseException:
        for key in keys:
            builders[key].data_file.close()
            for ext in (".bin", ".idx"):
                if os.path.exists(finals[key] + ext + tmp):
                    os.remove(finals[key] + ext + tmp)
        raise
    finally:
        bar.close()
    # Success: publish. .bin first, so a reader that sees the new .idx also sees the new .bin.
    for key in keys:
        for ext in (".bin", ".idx"):
            os.replace(finals[key] + ext + tmp, finals[key] + ext)
    stats.seconds = time.perf_counter() - start
    stats.outputs = [finals[k] for k in keys]
    return stats
