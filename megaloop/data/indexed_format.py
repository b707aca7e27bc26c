"""Megatron's indexed dataset format (``.bin`` + ``.idx``), written and checked with numpy alone.

Preprocessing must start in well under a second, and ``import megatron.core`` alone costs
seconds (it imports torch), so the writer here produces the very bytes megatron-core's
``IndexedDatasetBuilder`` writes (tests/test_data_indexed_format.py compares them) without
importing it. The training side still reads through megatron-core's ``IndexedDataset``.

Layout (version 1, little-endian), as megatron-core 0.16 reads it:

- ``.bin``: the token ids of every sequence, back to back, in the index's dtype;
- ``.idx``: ``MMIDIDX\\0\\0`` (9 bytes), version ``<Q`` = 1, dtype code ``<B``, sequence count
  ``<Q`` n, document count ``<Q`` d, then n int32 sequence lengths, n int64 byte pointers into
  the ``.bin``, d int64 document boundaries (sequence indices, ``0 .. n`` here: one sequence
  per document).

``check_indexed_dataset`` verifies a pair against itself (header, version, dtype, the sizes the
index declares against the files' sizes), so that a truncated ``.bin`` or an ``.idx`` paired
with another dataset's ``.bin`` is refused at start-up, naming the file, instead of failing
iterations later (or never, when the ``.idx`` is smaller).
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO

import numpy

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8  # magic, version, dtype code, two counts

# megatron.core.datasets.indexed_dataset.DType's numbering.
DTYPE_CODES = {numpy.uint8: 1, numpy.int8: 2, numpy.int16: 3, numpy.int32: 4, numpy.int64: 5,
               numpy.float64: 6, numpy.float32: 7, numpy.uint16: 8}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int):
    """Token dtype for a vocabulary: megatron-core's ``DType.optimal_dtype`` rule (uint16 below
    65500 ids, else int32), so either tool writes the same files."""
    return numpy.uint16 if vocab_size is not None and vocab_size < 65500 else numpy.int32


class IndexedWriter:
    """Streams sequences into ``bin_path``; ``finalize(idx_path)`` writes the index.

    One sequence per document, as Megatron-LM's preprocessing writes them. Lengths are kept as
    int32 numpy arrays (4 bytes per document), the only state that grows with the corpus.
    """

    def __init__(self, bin_path: str, dtype):
        if dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {dtype} is not one of Megatron's index dtypes")
        self.dtype = dtype
        self.bin_path = bin_path
        self.data_file: BinaryIO = open(bin_path, "wb")
        self._lengths: list[numpy.ndarray] = []

    def add_documents(self, values: numpy.ndarray, lengths: numpy.ndarray) -> None:
        """Append documents given flat (``values``) with their ``lengths``."""
        self.data_file.write(numpy.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self._lengths.append(numpy.asarray(lengths, dtype=numpy.int32))

    def add_lengths(self, lengths: numpy.ndarray) -> None:
        """Record documents whose tokens were appended to the .bin by another writer."""
        self._lengths.append(numpy.asarray(lengths, dtype=numpy.int32))

    def close(self) -> None:
        self.data_file.close()

    def finalize(self, idx_path: str) -> None:
        self.close()
        lengths = (numpy.concatenate(self._lengths) if self._lengths
                   else numpy.zeros(0, numpy.int32))
        write_index(idx_path, self.dtype, lengths)


def write_index(idx_path: str, dtype, lengths: numpy.ndarray) -> None:
    """The ``.idx`` of one-sequence-per-document data with these sequence ``lengths``."""
    lengths = numpy.asarray(lengths, dtype=numpy.int32)
    n = len(lengths)
    itemsize = numpy.dtype(dtype).itemsize
    pointers = numpy.zeros(n, dtype=numpy.int64)
    # int64 before the multiply: megatron-core computes pointers in int64 too.
    numpy.cumsum(lengths[:-1].astype(numpy.int64) * itemsize, out=pointers[1:])
    documents = numpy.arange(n + 1, dtype=numpy.int64)
    with open(idx_path, "wb") as f:
        f.write(INDEX_HEADER)
        f.write(struct.pack("<Q", INDEX_VERSION))
        f.write(struct.pack("<B", DTYPE_CODES[dtype]))
        f.write(struct.pack("<Q", n))
        f.write(struct.pack("<Q", len(documents)))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(documents.tobytes())


class BadIndexedDataset(ValueError):
    """An indexed dataset whose files do not agree; the message names the file and the fix."""


def check_indexed_dataset(prefix: str) -> int:
    """Check ``prefix.idx`` against itself and ``prefix.bin``; return the document count.

    Reads the header and the last sequence's length and pointer only (a few bytes, whatever the
    dataset's size).
    """
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    fix = "re-run tools/preprocess_data.py for it (or pair it with its own .bin/.idx)"
    idx_size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[:9] != INDEX_HEADER:
            raise BadIndexedDataset(f"{idx}: not a Megatron .idx file (bad header): {fix}")
        version, code, n, d = struct.unpack_from("<QBQQ", head, 9)
        if version != INDEX_VERSION:
            raise BadIndexedDataset(f"{idx}: index version {version}, expected {INDEX_VERSION}: "
                                    f"{fix}")
        if code not in CODE_DTYPES:
            raise BadIndexedDataset(f"{idx}: unknown dtype code {code}: {fix}")
        expected_idx = HEADER_BYTES + 4 * n + 8 * n + 8 * d
        # megatron-core's multimodal indexes add one int8 mode per sequence.
        if idx_size not in (expected_idx, expected_idx + n):
            raise BadIndexedDataset(
                f"{idx}: {idx_size} bytes, but its header declares {n} sequences and {d} "
                f"document boundaries ({expected_idx} bytes): the file is cut short or "
                f"damaged: {fix}")
        itemsize = numpy.dtype(CODE_DTYPES[code]).itemsize
        expected_bin = 0
        if n:
            f.seek(HEADER_BYTES + 4 * (n - 1))
            last_length, = struct.unpack("<i", f.read(4))
            f.seek(HEADER_BYTES + 4 * n + 8 * (n - 1))
            last_pointer, = struct.unpack("<q", f.read(8))
            expected_bin = last_pointer + last_length * itemsize
    bin_size = os.path.getsize(bin_)
    if bin_size != expected_bin:
        what = "cut short" if bin_size < expected_bin else "longer than its index says"
        raise BadIndexedDataset(
            f"{bin_}: {bin_size} bytes, but {idx} declares {n} sequences of "
            f"{numpy.dtype(CODE_DTYPES[code]).name} tokens ending at byte {expected_bin}: the "
            f".bin is {what}, or the .idx belongs to another dataset: {fix}")
    if n == 0 or d < 2:
        raise BadIndexedDataset(f"{idx}: the dataset holds no documents: {fix} with a non-empty "
                                "input")
    return d - 1
