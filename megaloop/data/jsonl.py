"""Reading JSONL (optionally gzip-compressed), shared by preprocessing and tokenizer training.

Preprocessing workers read byte ranges of a file in batches bounded by bytes (``byte_ranges``,
``read_batches``); an error names a line by its number, counted only when needed
(``line_number``).

Lines are read as bytes: a line with invalid UTF-8 is then a per-line error with a line number
(decoded by ``json.loads``), not a crash of the reader. Nothing here imports megatron.core.
"""

from __future__ import annotations

import gzip
import json
from typing import Any, Iterator, Optional


DEFAULT_BATCH_BYTES = 1 << 20  # input bytes per encode batch (preprocess_data.py --batch-bytes)


class BadInputError(ValueError):
    """A line that is not JSON or lacks a key; the message starts with ``file:line:``."""


def open_lines(path: str):
    """Binary line reader; ``.gz`` is decompressed on the fly."""
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def iter_json(path: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) per non-blank line; BadInputError on a non-JSON line."""
    with open_lines(path) as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                yield lineno, json.loads(raw)
            except (ValueError, UnicodeDecodeError) as err:
                raise BadInputError(f"{path}:{lineno}: not valid JSON ({err})") from None


def byte_ranges(size: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``[0, size)``."""
    cuts = [size * i // parts for i in range(parts + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def read_batches(path: str, start: int = 0, end: Optional[int] = None,
                 batch_bytes: int = DEFAULT_BATCH_BYTES
                 ) -> Iterator[tuple[list[int], list[bytes]]]:
    """(byte offsets, raw lines) of the lines whose first byte lies in ``[start, end)``, in
    batches of at least ``batch_bytes`` (the last may be smaller; a longer line is one batch).
    Offsets count bytes of the decompressed stream (``.gz`` inputs need ``start == 0``)."""
    with open_lines(path) as f:
        pos = start
        if start > 0:  # the line holding byte start - 1 belongs to the range before
            f.seek(start - 1)
            pos = start - 1 + len(f.readline())
        while end is None or pos < end:
            lines = f.readlines(batch_bytes)  # whole lines, stops once batch_bytes are read
            if not lines:
                return
            offsets, kept = [], []
            for line in lines:
                if end is not None and pos >= end:
                    break
                offsets.append(pos)
                kept.append(line)
                pos += len(line)
            yield offsets, kept


def line_number(path: str, offset: int) -> int:
    """1-based number of the line starting at byte ``offset`` (for error messages only)."""
    count, done = 1, 0
    with open_lines(path) as f:
        while done < offset:
            block = f.read(min(1 << 20, offset - done))
            if not block:
                break
            count += block.count(b"\n")
            done += len(block)
    return count
