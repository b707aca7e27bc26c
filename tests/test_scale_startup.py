"""Start-up work per rank does not grow with the data: the index-cache key reads a few hundred
bytes per dataset (a digest written beside the .idx, or the files' stat and sampled bytes), and
the document/sample/shuffle indices are built on rank 0 only while the other ranks wait and then
mmap the cache. Bytes read are counted from the kernel (/proc/self/io ``rchar``: every read()
of the process) and pages of the .idx mapped in (/proc/self/smaps ``Rss``)."""

import json
import os

import numpy
import pytest

from distributed import run_distributed
from megaloop.data.config import DataConfig, TokenizerConfig
from megaloop.data.datasets import build_train_valid_test_datasets, content_key
from megaloop.data.indexed_format import (DIGEST_SUFFIX, hash_file, read_digest, write_digest,
                                          write_index)
from megaloop.data.preprocess import preprocess

VOCAB = 1000


def _preprocess(path, docs) -> str:
    with open(f"{path}.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": " ".join(map(str, d))}) + "\n")
    preprocess(f"{path}.jsonl", str(path), TokenizerConfig(vocab_size=VOCAB), workers=0,
               append_eod=False, progress=False)
    return f"{path}_text_document"


def _large(prefix: str, documents: int, seed: int = 0) -> int:
    """A dataset of ``documents`` documents (50-150 tokens) with a real .idx and a sparse .bin
    (nothing here reads tokens); returns the .idx size."""
    lengths = numpy.random.default_rng(seed).integers(50, 150, documents).astype(numpy.int32)
    write_index(prefix + ".idx", numpy.uint16, lengths)
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(lengths.sum()) * 2)
    return os.path.getsize(prefix + ".idx")


def test_digest_written_by_preprocessing_is_the_idx_sha1_and_keys_the_cache(tmp_path):
    prefix = _preprocess(tmp_path / "d", [[7] * 10, [8] * 20, [9] * 30])
    assert read_digest(prefix) == hash_file(prefix + ".idx")  # independent: the file's bytes
    key = content_key([prefix])
    assert content_key([prefix]) == key  # stable from one run to the next

    # Re-tokenised in place with the same sizes: the same .idx and .bin sizes, header, and last
    # document (length, pointer, boundary); only the order of the first two lengths differs.
    size = os.path.getsize(prefix + ".idx"), os.path.getsize(prefix + ".bin")
    _preprocess(tmp_path / "d", [[8] * 20, [7] * 10, [9] * 30])
    assert (os.path.getsize(prefix + ".idx"), os.path.getsize(prefix + ".bin")) == size
    assert read_digest(prefix) == hash_file(prefix + ".idx")
    assert content_key([prefix]) != key

    # Rewritten by a tool that writes no digest (megatron-core's builder, as Megatron-LM's
    # preprocessing does): the old digest no longer describes the .idx and is ignored.
    fresh_key = content_key([prefix])
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for n in (5, 25, 30):
        import torch
        builder.add_item(torch.full((n,), 3, dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    assert os.path.exists(prefix + DIGEST_SUFFIX) and read_digest(prefix) is None
    stale_key = content_key([prefix])
    assert stale_key != fresh_key
    os.remove(prefix + DIGEST_SUFFIX)
    assert content_key([prefix]) == stale_key  # the same fallback as without any digest
    write_digest(prefix, hash_file(prefix + ".idx"))
    assert content_key([prefix]) not in (stale_key, fresh_key)


def test_fallback_key_without_digest_follows_a_rewrite(tmp_path):
    prefix = str(tmp_path / "x")
    _large(prefix, 1000, seed=1)
    os.remove(prefix + DIGEST_SUFFIX) if os.path.exists(prefix + DIGEST_SUFFIX) else None
    key = content_key([prefix])
    assert content_key([prefix]) == key
    # A same-size rewrite with other lengths in the middle: the mtime changes.
    before = os.stat(prefix + ".idx").st_mtime_ns
    lengths = numpy.random.default_rng(1).integers(50, 150, 1000).astype(numpy.int32)
    lengths[[10, 11]] = lengths[[11, 10]] if lengths[10] != lengths[11] else (60, 70)
    write_index(prefix + ".idx", numpy.uint16, lengths)
    os.utime(prefix + ".idx", ns=(before + 1000, before + 1000))  # coarse clocks: force it
    assert content_key([prefix]) != key


def test_merged_dataset_carries_the_digest_of_its_idx(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "merge_datasets", os.path.join(os.path.dirname(__file__), "..", "megaloop", "cli",
                                       "merge_datasets.py"))
    merge_datasets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge_datasets)
    shards = tmp_path / "shards"
    shards.mkdir()
    _preprocess(shards / "a", [[1] * 4, [2] * 9])
    _preprocess(shards / "b", [[3] * 6])
    whole = _preprocess(tmp_path / "whole", [[1] * 4, [2] * 9, [3] * 6])
    merged = str(tmp_path / "merged")
    merge_datasets.merge(merge_datasets.find_prefixes(str(shards)), merged)
    assert read_digest(merged) == hash_file(merged + ".idx") == read_digest(whole)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def _mapped_kib(path: str) -> int:
    """KiB of ``path`` mapped into this process (pages touched, plus the kernel's fault-around)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line
                inside = len(head) == 6 and head[5] == path
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


def _build_and_count(rank, world_size, prefix, cache):
    import torch

    from megaloop.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer(TokenizerConfig(vocab_size=VOCAB))
    cfg = DataConfig(data_path=[prefix], split="100,0,0", data_cache_path=cache)
    counts = []
    for _ in range(2):  # cold cache (rank 0 builds), then warm (every rank loads)
        torch.distributed.barrier()
        idx = os.path.abspath(prefix + ".idx")
        mapped, before = _mapped_kib(idx), _rchar()
        train, _, _ = build_train_valid_test_datasets(cfg, tokenizer, 1024, 5, (100, 0, 0))
        counts.append((_rchar() - before, _mapped_kib(idx) - mapped))
        first = train[0]["tokens"]  # usable: a sample comes out of the mmapped indices
        assert first.shape == (1024,)
        del train
    return counts, content_key([prefix])


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_read_per_rank_do_not_grow_with_the_data(tmp_path, world_size):
    prefix = str(tmp_path / "big")
    idx_bytes = _large(prefix, 200_000)  # ~4 MB of .idx, 2e7 tokens
    results = run_distributed(_build_and_count, world_size, prefix, str(tmp_path / "cache"),
                              timeout=180)
    assert len({key for _, key in results}) == 1  # every rank keys the cache alike
    assert results[0][1] == content_key([prefix])  # and so does this process, later
    results = [counts for counts, _ in results]
    for rank, counts in enumerate(results):
        for run, (read, mapped_kib) in enumerate(counts):
            # Reads: headers, sampled bytes, digests, .npy headers (tens of KiB), never the .idx.
            assert read < 64 * 1024 < idx_bytes // 16, (rank, run, read)
            if rank or run:  # only rank 0, on the cold cache, walks the document lengths
                assert mapped_kib < 256, (rank, run, mapped_kib)
    assert results[0][0][1] * 1024 > 200_000 * 4  # rank 0 did walk them (the counter counts)
