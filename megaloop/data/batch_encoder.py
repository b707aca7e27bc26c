"""One batch of raw JSONL lines -> flat token arrays per output dataset (preprocessing's inner
step, run by every worker). Imports numpy and the tokenizer library only.

Every text of a batch goes to the tokenizer's native batch encoder in one call; the results are
flattened into one values array and one lengths array per output key, so a batch costs one write
per key and nothing per document.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy

from megaloop.data.indexed_format import optimal_dtype
from megaloop.data.sft_examples import assemble, sft_segments
from megaloop.data.tokenizers import Tokenizer

SFT_KEYS = ("text", "lossmask")


@dataclass
class BatchResult:
    documents_read: int  # non-blank lines
    bad: list[tuple[int, str]]  # (byte offset of the line, reason), in input order
    arrays: dict[str, tuple[numpy.ndarray, numpy.ndarray]]  # key -> (flat values, lengths)
    empty: dict[str, int]


class BatchEncoder:
    """Parses and encodes one batch of raw lines into flat arrays per output key."""

    def __init__(self, tokenizer: Tokenizer, data_format: str, json_keys: list[str],
                 append_eod: bool, threads: int = 1):
        self.tok = tokenizer
        self.data_format = data_format
        self.json_keys = json_keys
        self.append_eod = append_eod
        self.threads = threads
        self.dtype = optimal_dtype(tokenizer.vocab_size)

    def parse(self, offsets: list[int], lines: list[bytes]):
        """[(offset, texts or sft segments)], bad lines. Blank lines are skipped."""
        docs, bad = [], []
        for offset, raw in zip(offsets, lines):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as err:
                bad.append((offset, f"not valid JSON ({err})"))
                continue
            if self.data_format == "sft":
                try:
                    docs.append((offset, sft_segments(obj)))
                except ValueError as err:
                    bad.append((offset, str(err)))
                continue
            if not isinstance(obj, dict):
                bad.append((offset, "expected a JSON object"))
                continue
            missing = [k for k in self.json_keys if not isinstance(obj.get(k), str)]
            if missing:
                bad.append((offset, f"missing or non-string key(s) {missing} "
                                    f"(--json-keys {' '.join(self.json_keys)})"))
                continue
            docs.append((offset, [obj[k] for k in self.json_keys]))
        return docs, bad

    def _encode(self, texts: list[str]) -> list[list[int]]:
        if self.threads > 1 and hasattr(self.tok, "_sp"):
            return self.tok.tokenize_batch(texts, num_threads=self.threads)
        return self.tok.tokenize_batch(texts)

    def tokenize(self, docs: list[tuple[int, list[str]]]):
        """Encodings of every document's texts in one batch call, and rejected documents.

        If the tokenizer rejects some text (e.g. NullTokenizer on words), the batch is redone
        one document at a time so that the error names the line.
        """
        try:
            encoded = iter(self._encode([t for _, texts in docs for t in texts]))
            return [(off, [next(encoded) for _ in texts]) for off, texts in docs], []
        except Exception:
            ok, bad = [], []
            for off, texts in docs:
                try:
                    ok.append((off, [self.tok.tokenize(t) for t in texts]))
                except Exception as err:
                    bad.append((off, f"the tokenizer rejects it ({type(err).__name__}: {err})"))
            return ok, bad

    @staticmethod
    def flatten(docs: list[list[int]], dtype) -> tuple[numpy.ndarray, numpy.ndarray]:
        lengths = numpy.fromiter(map(len, docs), dtype=numpy.int64, count=len(docs))
        values = numpy.empty(int(lengths.sum()), dtype=dtype)
        pos = 0
        for ids, n in zip(docs, lengths.tolist()):
            values[pos:pos + n] = ids
            pos += n
        return values, lengths

    def __call__(self, offsets: list[int], lines: list[bytes]) -> BatchResult:
        docs, bad = self.parse(offsets, lines)
        if self.data_format == "sft":
            segments = dict(docs)
            encoded, rejected = self.tokenize([(o, [s[0] for s in segs]) for o, segs in docs])
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
        return BatchResult(len(docs), sorted(bad + rejected), arrays, empty)

    def _assemble_sft(self, segments, encoded, bad, n_docs) -> BatchResult:
        tokens, masks = [], []
        for off, pieces in encoded:
            segs = segments[off]
            # An example whose responses are all empty is a data error, not a lesson in
            # stopping at once: skip it (counted as empty).
            if any(ids for (_, is_response, _), ids in zip(segs, pieces) if is_response):
                ids, mask = assemble(segs, pieces, self.tok.eod)
                tokens.append(ids)
                masks.append(mask)
        n_empty = len(encoded) - len(tokens)
        arrays = {"text": self.flatten(tokens, self.dtype),
                  "lossmask": self.flatten(masks, numpy.uint8)}
        return BatchResult(n_docs, bad, arrays, {k: n_empty for k in SFT_KEYS})
