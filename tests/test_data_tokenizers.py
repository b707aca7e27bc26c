"""Tokenizers and data config: trained sentencepiece (pad != EOD), HF tokenizer.json, null
tokenizer against megatron-core's, and config validation before any process group exists."""

import argparse
import json
import os
import subprocess
import sys

import numpy
import pytest
import sentencepiece
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer as _McoreNull

from megaloop.arguments import add_dataclass_args, dataclass_from_args
from megaloop.data.config import DataConfig, TokenizerConfig
from megaloop.data.indexed_format import IndexedWriter
from megaloop.data.tokenizers import build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = ["the quiet river follows the old road.", "a=3; b=a+4; c=b*2; c=? answer: 14.",
        "A->C, B->A, C->B. start at B, follow 2 arrows. where are you? answer: C."]


def McoreNull(vocab_size: int):
    """megatron-core's NullTokenizer for megaloop's ``--vocab-size N`` (N ordinary ids, then EOD =
    N; Megatron-LM's meaning through megatron-core 0.16). megatron-core 0.17 made vocab_size count
    the EOD (EOD = N - 1); megaloop keeps the meaning, so that a flag trains the same model (and
    reads the same data) on either version: on 0.17+ the reference is asked for N + 1."""
    ref = _McoreNull(vocab_size)
    return ref if ref.eod == vocab_size else _McoreNull(vocab_size + 1)



def test_train_tokenizer_cli_pad_differs_from_eod(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": TEXT[i % 3] + f" {i}\nline two {i}"}) + "\n"
                           for i in range(300)))
    prefix = tmp_path / "tok" / "demo"
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "train_tokenizer.py"), "--input",
                    str(src), "--output-prefix", str(prefix), "--vocab-size", "320"],
                   check=True, capture_output=True, timeout=120)
    raw = sentencepiece.SentencePieceProcessor(model_file=f"{prefix}.model")
    tok = build_tokenizer(TokenizerConfig("SentencePieceTokenizer", f"{prefix}.model"))
    assert tok.vocab_size == raw.get_piece_size() == 320
    assert tok.eod == raw.eos_id() and tok.pad == raw.pad_id()
    assert tok.pad >= 0 and tok.eod >= 0 and tok.pad != tok.eod
    # byte_fallback: characters never seen in training still round-trip exactly
    for text in TEXT + ["zebra ü ∑ 你好"]:
        assert tok.tokenize(text) == raw.encode(text)
        assert tok.detokenize(tok.tokenize(text)) == text
    assert raw.unk_id() not in tok.tokenize("zebra ü ∑ 你好")


def test_huggingface_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(TEXT * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<pad>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.decoder = decoders.ByteLevel()
    hf.save(str(tmp_path / "tokenizer.json"))

    tok = build_tokenizer(TokenizerConfig("HuggingFaceTokenizer", str(tmp_path)))  # folder
    assert tok.eod == hf.token_to_id("</s>") and tok.pad == hf.token_to_id("<pad>")
    assert tok.vocab_size == hf.get_vocab_size()
    assert tok.tokenize_batch(TEXT) == [hf.encode(t, add_special_tokens=False).ids for t in TEXT]
    assert tok.detokenize(tok.tokenize(TEXT[1])) == TEXT[1]

    # tokenizer_config.json names the special tokens when present
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<unk>"}, "pad_token": "<pad>"}))
    tok = build_tokenizer(TokenizerConfig("HuggingFaceTokenizer",
                                          str(tmp_path / "tokenizer.json")))
    assert tok.eod == hf.token_to_id("<unk>")


def test_null_tokenizer_matches_megatron_core():
    tok = build_tokenizer(TokenizerConfig(vocab_size=100))
    ref = McoreNull(100)
    assert (tok.vocab_size, tok.eod) == (ref.vocab_size, ref.eod)
    assert tok.eod == tok.vocab_size - 1 and tok.pad != tok.eod
    assert tok.tokenize("4 5 99") == ref.text_to_ids("4 5 99") == [4, 5, 99]
    assert tok.tokenize("   ") == []
    assert tok.detokenize([4, 5]) == "4 5"


@pytest.mark.parametrize("cfg, flag", [
    (TokenizerConfig(), "--vocab-size"),
    (TokenizerConfig("SentencePieceTokenizer"), "--tokenizer-model"),
    (TokenizerConfig("SentencePieceTokenizer", "/nonexistent.model"), "/nonexistent.model"),
    (TokenizerConfig("HuggingFaceTokenizer", "/", vocab_size=5), "--vocab-size"),
])
def test_tokenizer_config_errors(cfg, flag):
    with pytest.raises(ValueError, match=flag):
        cfg.validate()


def test_data_config_errors(tmp_path):
    for prefix in ("a", "b_text_document"):  # valid one-document datasets
        writer = IndexedWriter(str(tmp_path / prefix) + ".bin", numpy.uint16)
        writer.add_documents(numpy.array([1, 2, 3]), numpy.array([3]))
        writer.finalize(str(tmp_path / prefix) + ".idx")
    a, b = str(tmp_path / "a"), str(tmp_path / "b_text_document")
    cases = [
        (DataConfig(), "--data-path PREFIX"),
        (DataConfig(mock_data=True, data_path=[a]), "--mock-data"),
        (DataConfig(data_path=[a], train_data_path=[a]), "exclusive"),
        (DataConfig(valid_data_path=[a]), "without --train-data-path"),
        (DataConfig(data_path=[a + ".bin"]), "without .bin/.idx"),
        (DataConfig(data_path=["0.3", a, "0.7", str(tmp_path / "missing")]), "missing.bin"),
        (DataConfig(data_path=["-1", a, "2", a]), "weights must be > 0"),
        (DataConfig(data_path=[a], split="90,x"), "--split"),
        (DataConfig(data_path=[a], data_format="sft"), "_text_document"),
        (DataConfig(data_path=[b], data_format="sft"), "b_lossmask_document.bin"),
        (DataConfig(mock_data=True, data_format="sft"), "loss mask"),
        # An odd blend is not read as prefixes (that failed with "0.5.bin not found").
        (DataConfig(data_path=["0.5", a, "0.5"]), "weight/prefix pairs, but 3 values"),
    ]
    for cfg, message in cases:
        with pytest.raises(ValueError, match=message):
            cfg.validate()
    with pytest.raises(ValueError, match="--split 100,0,0 leaves no documents for validation, "
                                         "but --eval-iters 5 .* pass --eval-iters 0"):
        DataConfig(data_path=[a], split="100,0,0").validate(eval_iters=5)
    DataConfig(data_path=[a], split="100,0,0").validate(eval_iters=0)
    DataConfig(data_path=["0.3", a, "0.7", a], split="98,2").validate()
    DataConfig(data_path=[b]).validate()


def test_flags_derived_from_dataclasses():
    p = argparse.ArgumentParser()
    add_dataclass_args(p, TokenizerConfig)
    add_dataclass_args(p, DataConfig)
    ns = p.parse_args(["--data-path", "0.3", "x", "0.7", "y", "--split", "98,2,0",
                       "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
                       "--reset-position-ids", "--data-format", "sft"])
    data, tok = dataclass_from_args(DataConfig, ns), dataclass_from_args(TokenizerConfig, ns)
    assert data.blends() == [(["x", "y"], [0.3, 0.7])]
    assert data.reset_position_ids and not data.reset_attention_mask
    assert (data.split, data.data_format, tok.vocab_size) == ("98,2,0", "sft", 64)
