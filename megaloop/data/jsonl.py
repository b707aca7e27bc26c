"""Reading JSONL (optionally gzip-compressed), shared by preprocessing and tokenizer training.

Lines are read as bytes: a line with invalid UTF-8 is then a per-line error with a line number
(decoded by ``json.loads``), not a crash of the reader. Nothing here imports megatron.core.
"""

from __future__ import annotations

import gzip
import json
from typing import Any, Iterator


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
