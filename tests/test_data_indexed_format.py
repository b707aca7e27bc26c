"""megaloop/data/indexed_format.py against megatron-core: the writer's bytes equal megatron-core's
``IndexedDatasetBuilder``'s, files read back through megatron-core's ``IndexedDataset``, and the
start-up check refuses a pair whose files disagree (naming the file) while accepting every pair
megatron-core writes. Also: megaloop's NullTokenizer equals megatron-core's on the same texts."""

import os
import shutil

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from megaloop.data.config import DataConfig
from megaloop.data.indexed_format import (BadIndexedDataset, IndexedWriter,
                                          check_indexed_dataset, optimal_dtype)
from megaloop.data.tokenizers import NullTokenizer
from test_data_tokenizers import McoreNull


def _documents(seed: int, n: int, high: int) -> list[numpy.ndarray]:
    rng = numpy.random.default_rng(seed)
    return [rng.integers(0, high, size=int(rng.integers(1, 50))) for _ in range(n)]


def _write_both(tmp_path, docs, dtype, batches):
    """The same documents through megatron-core's builder (one add_document per document) and
    through IndexedWriter (in ``batches`` flat batches)."""
    ref = str(tmp_path / "mcore")
    builder = IndexedDatasetBuilder(ref + ".bin", dtype=dtype)
    for d in docs:
        builder.add_document(d, [len(d)])
    builder.finalize(ref + ".idx")
    ours = str(tmp_path / "ours")
    writer = IndexedWriter(ours + ".bin", dtype)
    for part in numpy.array_split(numpy.arange(len(docs)), batches):
        chunk = [docs[i] for i in part]
        writer.add_documents(numpy.concatenate(chunk) if chunk else numpy.zeros(0, dtype),
                             numpy.array([len(c) for c in chunk], dtype=numpy.int64))
    writer.finalize(ours + ".idx")
    return ref, ours


@pytest.mark.parametrize("dtype,high,batches", [(numpy.uint16, 65499, 1), (numpy.uint16, 300, 7),
                                                (numpy.int32, 151000, 3), (numpy.uint8, 2, 5)])
def test_bytes_equal_megatron_core_builder(tmp_path, dtype, high, batches):
    docs = _documents(high, 120, high)
    ref, ours = _write_both(tmp_path, docs, dtype, batches)
    for ext in (".bin", ".idx"):
        with open(ref + ext, "rb") as a, open(ours + ext, "rb") as b:
            assert a.read() == b.read(), ext
    ds = IndexedDataset(ours)
    assert len(ds) == len(docs)
    for i in (0, 1, len(docs) // 2, len(docs) - 1):
        assert ds[i].dtype == dtype and ds[i].tolist() == docs[i].tolist()
    assert check_indexed_dataset(ours) == len(docs) == check_indexed_dataset(ref)


def test_optimal_dtype_is_megatron_cores_rule():
    from megatron.core.datasets.indexed_dataset import DType

    for vocab in (2, 1000, 65499, 65500, 65501, 200000, None):
        assert optimal_dtype(vocab) == DType.optimal_dtype(vocab)


def test_null_tokenizer_equals_megatron_cores():
    for vocab in (10, 500):
        ours, ref = NullTokenizer(vocab), McoreNull(vocab)
        assert (ours.vocab_size, ours.eod) == (ref.vocab_size, ref.eod)
        for text in ("1 2 3", "7", "0 12 5  "[:-2], "4 4 4 4"):
            assert ours.tokenize(text) == ref.text_to_ids(text)
            assert ours.detokenize(ours.tokenize(text)) == ref.ids_to_text(ref.text_to_ids(text))
        for bad in ("1  2", "a b"):  # megatron-core rejects these too: a bad line, not a guess
            with pytest.raises(ValueError):
                ref.text_to_ids(bad)
            with pytest.raises(ValueError):
                ours.tokenize(bad)


@pytest.fixture
def two_datasets(tmp_path):
    prefixes = []
    for name, seed, n in (("a", 1, 40), ("b", 2, 30)):
        os.makedirs(tmp_path / name)
        prefixes.append(_write_both(tmp_path / name, _documents(seed, n, 300), numpy.uint16, 1)[0])
    return prefixes


def _refused(prefix: str, match: str) -> str:
    """The check and DataConfig.validate (start-up, no process group) both refuse ``prefix``."""
    with pytest.raises(BadIndexedDataset, match=match) as err:
        check_indexed_dataset(prefix)
    with pytest.raises(ValueError, match=match):
        DataConfig(data_path=[prefix]).validate()
    return str(err.value)


def test_truncated_bin_is_refused_naming_it(two_datasets):
    a, _ = two_datasets
    size = os.path.getsize(a + ".bin")
    with open(a + ".bin", "r+b") as f:
        f.truncate(size - 2)
    message = _refused(a, "cut short")
    assert a + ".bin" in message and str(size - 2) in message and str(size) in message


def test_idx_paired_with_another_datasets_bin_is_refused(two_datasets):
    a, b = two_datasets
    shutil.copy(b + ".bin", a + ".bin")
    assert a + ".bin" in _refused(a, "another dataset")


def test_smaller_idx_is_refused(two_datasets, tmp_path):
    """An .idx written for the first 10 documents next to the full .bin: megatron-core would
    silently train on those 10 documents only."""
    a, _ = two_datasets
    full = IndexedDataset(a)
    sub = str(tmp_path / "sub")
    writer = IndexedWriter(sub + ".bin", numpy.uint16)
    for i in range(10):
        writer.add_documents(full[i], numpy.array([len(full[i])]))
    writer.finalize(sub + ".idx")
    del full
    shutil.copy(sub + ".idx", a + ".idx")
    assert a + ".bin" in _refused(a, "longer than its index says")


@pytest.mark.parametrize("offset,value,match", [(0, b"XMIDIDX", "bad header"),
                                                (9, b"\x02", "version 2"),
                                                (17, b"\x09", "unknown dtype code 9")])
def test_bad_header_version_dtype_are_refused(two_datasets, offset, value, match):
    a, _ = two_datasets
    with open(a + ".idx", "r+b") as f:
        f.seek(offset)
        f.write(value)
    assert a + ".idx" in _refused(a, match)


def test_cut_idx_is_refused(two_datasets):
    a, _ = two_datasets
    with open(a + ".idx", "r+b") as f:
        f.truncate(os.path.getsize(a + ".idx") - 8)
    assert a + ".idx" in _refused(a, "cut short or damaged")
