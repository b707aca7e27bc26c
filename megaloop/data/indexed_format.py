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

The digest file ``<prefix>.idx.digest`` (written by preprocessing and tools/merge_datasets.py,
ignored by Megatron-LM's tools) holds the SHA-1 of the ``.idx`` with the ``.idx``'s size and
mtime when the digest was taken: megaloop.data.datasets keys the index cache on it, so a rank
reads a few hundred bytes per dataset at start-up instead of every ``.idx`` in full. A digest
whose size or mtime no longer matches (the ``.idx`` was rewritten by another tool) is ignored.
"""

from __future__ import annotations

import hashlib
import json
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
        sha1 = write_index(idx_path, self.dtype, lengths)
        if idx_path.endswith(".idx"):
            write_digest(idx_path[:-4], sha1)


def write_index(idx_path: str, dtype, lengths: numpy.ndarray) -> str:
    """The ``.idx`` of one-sequence-per-document data with these sequence ``lengths``; returns
    the SHA-1 of the bytes written (for ``write_digest``, without reading the file back)."""
    lengths = numpy.asarray(lengths, dtype=numpy.int32)
    n = len(lengths)
    itemsize = numpy.dtype(dtype).itemsize
    pointers = numpy.zeros(n, dtype=numpy.int64)
    # int64 before the multiply: megatron-core computes pointers in int64 too.
    numpy.cumsum(lengths[:-1].astype(numpy.int64) * itemsize, out=pointers[1:])
    documents = numpy.arange(n + 1, dtype=numpy.int64)
    header = (INDEX_HEADER + struct.pack("<Q", INDEX_VERSION) + struct.pack("<B", DTYPE_CODES[dtype])
              + struct.pack("<Q", n) + struct.pack("<Q", len(documents)))
    sha = hashlib.sha1()
    with open(idx_path, "wb") as f:
        for part in (header, lengths, pointers, documents):  # buffers: no copies of big arrays
            f.write(part)
            sha.update(part)
    return sha.hexdigest()


DIGEST_SUFFIX = ".idx.digest"


def _stat_fields(path: str) -> dict:
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_digest(prefix: str, sha1: str) -> None:
    """Record ``sha1`` (of ``prefix.idx``'s bytes) next to it, with the ``.idx``'s current size
    and mtime; call it once the ``.idx`` has its final name (a rename keeps the mtime)."""
    record = {"sha1": sha1, "idx": _stat_fields(prefix + ".idx")}
    tmp = prefix + DIGEST_SUFFIX + f".tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, prefix + DIGEST_SUFFIX)


def hash_file(path: str) -> str:
    """SHA-1 of a whole file (for an ``.idx`` written by megatron-core's builder, once, in the
    tool that wrote it)."""
    sha = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha.update(block)
    return sha.hexdigest()


def read_digest(prefix: str):
    """The SHA-1 recorded for ``prefix.idx``, or None when there is no digest or it no longer
    describes the file (size or mtime changed since it was written)."""
    try:
        with open(prefix + DIGEST_SUFFIX, "rb", buffering=0) as f:
            record = json.loads(f.read(4096))
        if record["idx"] == _stat_fields(prefix + ".idx"):
            return str(record["sha1"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or unreadable: the caller keys on the file's stat and sampled bytes
    return None


def sampled_fields(prefix: str) -> bytes:
    """What keys a dataset without a valid digest, in a few hundred bytes read: the ``.idx``
    and ``.bin`` sizes and mtimes, the header, and the last document's length, pointer and
    boundary. A rewrite by any tool changes the mtime; the sampled bytes catch the rest."""
    idx = prefix + ".idx"
    parts = [json.dumps([_stat_fields(idx), _stat_fields(prefix + ".bin")]).encode()]
    with open(idx, "rb", buffering=0) as f:  # see check_indexed_dataset
        head = f.read(HEADER_BYTES)
        parts.append(head)
        if len(head) == HEADER_BYTES and head[:9] == INDEX_HEADER:
            _, _, n, d = struct.unpack_from("<QBQQ", head, 9)
            for offset, size in ((HEADER_BYTES + 4 * (n - 1), 4),
                                 (HEADER_BYTES + 4 * n + 8 * (n - 1), 8),
                                 (HEADER_BYTES + 12 * n + 8 * (d - 1), 8)):
                if n and d and offset >= HEADER_BYTES:
                    f.seek(offset)
                    parts.append(f.read(size))
    return b"\0".join(parts)


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
    # Unbuffered: a buffered read fills a buffer of the file system's block size, 1-4 MB of the
    # .idx per read on parallel file systems, on every rank, for the few bytes asked.
    with open(idx, "rb", buffering=0) as f:
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
