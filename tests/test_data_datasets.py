"""Datasets and the sample stream: blend proportions, stale-cache protection, empty splits,
resume determinism, DP partition, SFT loss mask and packing masks.

Data is written with the NullTokenizer, so every token says where it came from (source, document,
prompt or response) and expectations are computed from the tokens themselves.
"""

import json
import os
import signal

import numpy
import pytest
import torch
import torch.distributed as dist

from megaloop.data.config import DataConfig, TokenizerConfig
from megaloop.data.datasets import build_data_iterator, build_train_valid_test_datasets
from megaloop.data.preprocess import preprocess
from megaloop.data.tokenizers import build_tokenizer

VOCAB = 1000
EOD = VOCAB  # NullTokenizer: --vocab-size N gives EOD = N


@pytest.fixture(scope="module", autouse=True)
def process_group(tmp_path_factory):
    """A size-1 gloo group: megatron-core's BlendedDataset needs one for its cache."""
    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TokenizerConfig(vocab_size=VOCAB))


def write_dataset(path, docs, fmt="pretrain") -> str:
    """docs: lists of ids (pretrain) or (prompt ids, response ids); returns the dataset prefix."""
    src = f"{path}.jsonl"
    with open(src, "w") as f:
        for d in docs:
            row = ({"prompt": " ".join(map(str, d[0])), "response": " ".join(map(str, d[1]))}
                   if fmt == "sft" else {"text": " ".join(map(str, d))})
            f.write(json.dumps(row) + "\n")
    preprocess(src, str(path), TokenizerConfig(vocab_size=VOCAB), data_format=fmt, workers=0,
               append_eod=fmt == "pretrain", progress=False)
    return f"{path}_text_document"


def samples(dataset, n=None) -> list[torch.Tensor]:
    return [dataset[i]["tokens"] for i in range(len(dataset) if n is None else n)]


def test_blend_proportions(tmp_path, tokenizer):
    rng = numpy.random.default_rng(0)
    a = write_dataset(tmp_path / "a", [[1] * int(rng.integers(5, 30)) for _ in range(200)])
    b = write_dataset(tmp_path / "b", [[2] * int(rng.integers(5, 30)) for _ in range(200)])
    cfg = DataConfig(data_path=["0.3", a, "0.7", b], split="100,0,0")
    train, valid, test = build_train_valid_test_datasets(cfg, tokenizer, 16, 1, (1000, 0, 0))
    assert valid is None and test is None and len(train) == 1000
    # Each sample is drawn from one source; its non-EOD tokens say which.
    batches = list(build_data_iterator(train, 0, 10, 0, 1))
    tokens = torch.cat([b["tokens"] for b in batches])
    assert "dataset_id" not in batches[0] and tokens.shape == (1000, 16)
    from_a = (tokens == 1).any(1)
    assert not ((tokens == 1).any(1) & (tokens == 2).any(1)).any()
    assert abs(from_a.float().mean().item() - 0.3) < 0.02

    # per-split paths: validation comes from b only
    cfg = DataConfig(train_data_path=[a], valid_data_path=[b])
    train, valid, test = build_train_valid_test_datasets(cfg, tokenizer, 16, 1, (50, 20, 0))
    assert test is None
    assert all((t == 1).any() for t in samples(train)) and len(valid) >= 20
    assert all((t == 2).any() and not (t == 1).any() for t in samples(valid))


def test_reprocessing_in_place_never_reuses_stale_indices(tmp_path, tokenizer):
    cache = str(tmp_path / "cache")
    prefix = write_dataset(tmp_path / "d", [[7] * 30 for _ in range(20)])
    cfg = DataConfig(data_path=[prefix], split="100,0,0", data_cache_path=cache)
    old, _, _ = build_train_valid_test_datasets(cfg, tokenizer, 16, 3, (30, 0, 0))
    assert all((t[t != EOD] == 7).all() for t in samples(old))

    # New content under the same prefix, with other document lengths and per-document ids.
    write_dataset(tmp_path / "d", [[100 + i] * (5 + i % 11) for i in range(37)])
    fresh, _, _ = build_train_valid_test_datasets(cfg, tokenizer, 16, 3, (30, 0, 0))
    reference_cfg = DataConfig(data_path=[prefix], split="100,0,0",
                               data_cache_path=str(tmp_path / "empty_cache"))
    reference, _, _ = build_train_valid_test_datasets(reference_cfg, tokenizer, 16, 3,
                                                      (30, 0, 0))
    assert len(fresh) == len(reference)
    for got, want in zip(samples(fresh), samples(reference), strict=True):
        assert torch.equal(got, want)
    assert len(os.listdir(cache)) == 2  # one cache folder per content


def test_split_with_no_documents_is_an_error_not_a_hang(tmp_path, tokenizer):
    prefix = write_dataset(tmp_path / "small", [[3] * 20 for _ in range(3)])
    # 3 documents at 98/1/1: the builder's bookends round to 3..3 for valid and test.
    cfg = DataConfig(data_path=[prefix], split="98,1,1")
    def hang(*_):
        raise TimeoutError("dataset build hangs on an empty split")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(30)  # GPTDataset would spin forever; fail instead
    try:
        with pytest.raises(ValueError, match=r"valid split .* 0 documents .*--split"):
            build_train_valid_test_datasets(cfg, tokenizer, 8, 1, (10, 5, 0))
        # asking the empty splits for nothing is fine: they are not built
        train, valid, test = build_train_valid_test_datasets(cfg, tokenizer, 8, 1, (10, 0, 0))
        assert valid is None and test is None and len(train) >= 10
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_resume_equals_skip_and_dp_partition(tmp_path, tokenizer):
    prefix = write_dataset(tmp_path / "r", [[i % VOCAB] * 13 for i in range(120)])
    cfg = DataConfig(data_path=[prefix], split="100,0,0")
    train, _, _ = build_train_valid_test_datasets(cfg, tokenizer, 8, 5, (64, 0, 0))
    n = len(train)
    global_order = torch.stack(samples(train))  # sample i of the stream is dataset[i]

    def stream(consumed, mbs, rank, size):
        return [b["tokens"] for b in build_data_iterator(train, consumed, mbs, rank, size)]

    full = torch.cat(stream(0, 2, 0, 1))
    assert torch.equal(full, global_order[: n - n % 2])
    for k in (5, 6):  # resume at any k == the stream from 0 with k samples skipped
        resumed = torch.cat(stream(k, 2, 0, 1))
        assert torch.equal(resumed, global_order[k: k + len(resumed)])
        assert len(resumed) == (n - k) // 2 * 2

    # DP=2, mbs=3: each chunk of 6 samples is cut [rank0: 0..2 | rank1: 3..5]
    r0, r1 = stream(0, 3, 0, 2), stream(0, 3, 1, 2)
    assert len(r0) == len(r1) == n // 6
    interleaved = torch.cat([x for pair in zip(r0, r1) for x in pair])
    assert torch.equal(interleaved, global_order[: n // 6 * 6])
    for rank, ref in ((0, r0), (1, r1)):
        resumed = stream(12, 3, rank, 2)
        assert len(resumed) == len(ref) - 2
        assert all(torch.equal(x, y) for x, y in zip(resumed, ref[2:], strict=True))


def test_cyclic_iterator_wraps(tmp_path, tokenizer):
    prefix = write_dataset(tmp_path / "c", [[5] * 10 for _ in range(10)])
    train, _, _ = build_train_valid_test_datasets(
        DataConfig(data_path=[prefix], split="100,0,0"), tokenizer, 8, 1, (4, 0, 0))
    n = len(train)
    it = build_data_iterator(train, n - 1, 3, 0, 1, cyclic=True)
    got = [next(it)["tokens"] for _ in range(2)]
    want = [train[i]["tokens"] for i in (n - 1, 0, 1, 2, 3, 4)]
    assert torch.equal(torch.cat(got), torch.stack(want))


def test_sft_dataset_masks_and_packing(tmp_path, tokenizer):
    rng = numpy.random.default_rng(1)
    # prompt ids in [100, 200), response ids in [200, 300): the mask is readable from tokens
    examples = [(list(rng.integers(100, 200, int(rng.integers(1, 9)))),
                 list(rng.integers(200, 300, int(rng.integers(1, 6))))) for _ in range(80)]
    prefix = write_dataset(tmp_path / "s", examples, fmt="sft")
    cfg = DataConfig(data_path=[prefix], split="100,0,0", data_format="sft",
                     reset_position_ids=True, reset_attention_mask=True)
    train, _, _ = build_train_valid_test_datasets(cfg, tokenizer, 24, 1, (20, 0, 0))
    batch = next(build_data_iterator(train, 0, 4, 0, 1))
    assert batch["attention_mask"].shape == (4, 1, 24, 24)
    for tokens, labels, loss_mask, pos, masked in zip(
            batch["tokens"], batch["labels"], batch["loss_mask"], batch["position_ids"],
            batch["attention_mask"][:, 0]):
        is_response = ((labels >= 200) & (labels < 300)) | (labels == EOD)
        assert torch.equal(loss_mask, is_response.float())
        # positions and attention restart after every EOD among the inputs
        start = 0
        for j in range(24):
            assert pos[j] == j - start
            for i in range(24):
                assert bool(masked[j, i]) == (i > j or i < start)
            if tokens[j] == EOD:
                start = j + 1


def test_mock_data(tokenizer):
    train, valid, _ = build_train_valid_test_datasets(DataConfig(mock_data=True), tokenizer, 32,
                                                      1, (8, 4, 0))
    batch = next(build_data_iterator(train, 0, 4, 0, 1))
    assert {k: (tuple(v.shape), v.dtype) for k, v in batch.items()} == {
        "tokens": ((4, 32), torch.int64), "labels": ((4, 32), torch.int64),
        "loss_mask": ((4, 32), torch.float32), "position_ids": ((4, 32), torch.int64)}
    assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
