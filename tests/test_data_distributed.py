"""Datasets on 2 gloo ranks: every rank builds the same blend from one shared cache, and the two
ranks' micro-batches tile the global sample order."""

import json

import torch

from distributed import run_distributed
from megaloop.data.config import DataConfig, TokenizerConfig
from megaloop.data.datasets import build_data_iterator, build_train_valid_test_datasets
from megaloop.data.preprocess import preprocess
from megaloop.data.tokenizers import build_tokenizer


def _write(path, docs) -> str:
    with open(f"{path}.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": " ".join(map(str, d))}) + "\n")
    preprocess(f"{path}.jsonl", str(path), TokenizerConfig(vocab_size=500), workers=0,
               append_eod=True, progress=False)
    return f"{path}_text_document"


def _rank_body(rank, world_size, cfg):
    tokenizer = build_tokenizer(TokenizerConfig(vocab_size=500))
    train, _, _ = build_train_valid_test_datasets(cfg, tokenizer, 16, 11, (48, 0, 0))
    everything = torch.stack([train[i]["tokens"] for i in range(len(train))])
    mine = [b["tokens"] for b in build_data_iterator(train, 0, 2, rank, world_size)]
    return everything, mine


def test_two_ranks_build_the_same_blend_and_split_it(tmp_path):
    a = _write(tmp_path / "a", [[1 + i % 50] * (3 + i % 17) for i in range(90)])
    b = _write(tmp_path / "b", [[100 + i % 50] * (4 + i % 9) for i in range(60)])
    cfg = DataConfig(data_path=["0.4", a, "0.6", b], split="100,0,0",
                     data_cache_path=str(tmp_path / "cache"))
    (all0, mine0), (all1, mine1) = run_distributed(_rank_body, 2, cfg)
    assert torch.equal(all0, all1)  # a pure function of the seed, on every rank
    assert len(mine0) == len(mine1) == len(all0) // 4
    tiled = torch.cat([x for pair in zip(mine0, mine1) for x in pair])
    assert torch.equal(tiled, all0[: len(tiled)])
    assert len(list((tmp_path / "cache").iterdir())) == 1  # both ranks: one content key
