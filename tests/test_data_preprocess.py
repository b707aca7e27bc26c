"""tools/preprocess_data.py: Megatron format, round trip, worker invariance, bad input, SFT mask.

Expected values are computed independently: token ids straight from the sentencepiece library
(not megaloop's wrapper), the .idx read back with struct/numpy from the documented layout, and
SFT masks built by hand from the documented example layout.
"""

import gzip
import json
import os
import struct
import subprocess
import sys

import numpy
import pytest
import sentencepiece
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megaloop.data.config import TokenizerConfig
from megaloop.data.jsonl import BadInputError
from megaloop.data.preprocess import preprocess
from megaloop.data.tokenizers import train_sentencepiece

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A command as a terminal starts it in the foreground, Ctrl-C raising KeyboardInterrupt: a suite
# started in the background (`cmd &`, nohup, some CI runners) passes SIGINT on ignored, and Python
# keeps an ignored SIGINT ignored, so a Ctrl-C test would wait for nothing. Use as
# [sys.executable, "-c", FOREGROUND, script, *args].
FOREGROUND = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
              "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
WORDS = ("alpha beta gamma delta river stone seven eleven a=3; b=a+4; c=b*2; c=? answer: 14 "
         "x->y, y->z. follow two arrows").split()


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = numpy.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 40)))) for _ in range(n)]


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("tok") / "sp"
    return train_sentencepiece(corpus(400, seed=1), str(prefix), vocab_size=300)


def sp_cfg(model: str) -> TokenizerConfig:
    return TokenizerConfig("SentencePieceTokenizer", model)


def read_idx(path: str):
    """Independent reader of Megatron's .idx layout: magic, version, dtype code, counts, arrays."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:9] == b"MMIDIDX\x00\x00"
    version, = struct.unpack_from("<Q", data, 9)
    dtype_code, = struct.unpack_from("<B", data, 17)
    n_seq, n_doc = struct.unpack_from("<QQ", data, 18)
    off = 34
    lengths = numpy.frombuffer(data, numpy.int32, n_seq, off)
    off += 4 * n_seq
    pointers = numpy.frombuffer(data, numpy.int64, n_seq, off)
    off += 8 * n_seq
    doc_idx = numpy.frombuffer(data, numpy.int64, n_doc, off)
    off += 8 * n_doc
    assert off == len(data), "trailing bytes in .idx"
    return version, dtype_code, lengths, pointers, doc_idx


def test_round_trip_and_independent_idx_reader(tmp_path, sp_model):
    texts = corpus(50)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    stats = preprocess(src, str(tmp_path / "out"), sp_cfg(sp_model), append_eod=True,
                       workers=0, batch_bytes=64, progress=False)
    sp = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    expected = [sp.encode(t) + [sp.eos_id()] for t in texts]

    prefix = str(tmp_path / "out_text_document")
    ds = IndexedDataset(prefix)
    assert len(ds) == len(texts) == stats.documents["text"]
    for i, ids in enumerate(expected):
        assert ds[i].tolist() == ids
    assert ds[0].dtype == numpy.uint16  # vocab 300 < 65500: Megatron's choice

    version, code, lengths, pointers, doc_idx = read_idx(prefix + ".idx")
    assert version == 1 and code == 8  # DType.uint16 in Megatron's numbering
    assert lengths.tolist() == [len(e) for e in expected]
    assert pointers.tolist() == (2 * numpy.concatenate([[0], numpy.cumsum(lengths)[:-1]])).tolist()
    assert doc_idx.tolist() == list(range(len(texts) + 1))  # one sequence per document
    numpy.testing.assert_array_equal(ds.sequence_lengths, lengths)
    numpy.testing.assert_array_equal(ds.index.sequence_pointers, pointers)
    numpy.testing.assert_array_equal(ds.document_indices, doc_idx)
    flat = numpy.fromfile(prefix + ".bin", dtype=numpy.uint16)
    assert flat.tolist() == [t for e in expected for t in e]
    assert stats.tokens["text"] == flat.size


def test_int32_tokens_for_large_vocab(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "70000 3 65499"}])
    preprocess(src, str(tmp_path / "out"), TokenizerConfig(vocab_size=70000), workers=0,
               append_eod=True, progress=False)
    _, code, _, _, _ = read_idx(str(tmp_path / "out_text_document.idx"))
    assert code == 4  # int32: vocab >= 65500
    # Keep the dataset alive while reading: it unmaps its arrays when collected.
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds[0].tolist() == [70000, 3, 65499, 70000]  # EOD = vocab_size


def test_worker_count_invariance_and_gzip(tmp_path, sp_model):
    rows = [{"text": t, "title": t[:7]} for t in corpus(300, seed=3)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    with open(src, "rb") as f, gzip.open(tmp_path / "in.jsonl.gz", "wb") as g:
        g.write(f.read())
    outputs = {}
    for name, path, workers in (("w1", src, 1), ("w2", src, 2), ("gz", src + ".gz", 2)):
        preprocess(path, str(tmp_path / name), sp_cfg(sp_model), json_keys=("text", "title"),
                   workers=workers, append_eod=True, batch_bytes=300, progress=False)
        outputs[name] = {f"{k}{ext}": open(tmp_path / f"{name}_{k}_document{ext}", "rb").read()
                         for k in ("text", "title") for ext in (".bin", ".idx")}
    assert outputs["w1"] == outputs["w2"] == outputs["gz"]
    assert len(outputs["w1"]["text.bin"]) > 0


def test_bad_lines_stop_with_location_or_are_skipped(tmp_path):
    cfg = TokenizerConfig(vocab_size=100)
    rows = [{"text": "1 2"}, {"text": "3"}, "{not json", {"text": "4"}, {"txt": "5"}, {"text": ""},
            {"text": "6 7"}, {"text": "8 words"}]
    src = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(BadInputError, match=rf"{src}:3: not valid JSON"):
        preprocess(src, str(tmp_path / "out"), cfg, workers=2, batch_bytes=20, progress=False)
    # atomic: no final and no temporary files from the failed run
    assert [p for p in os.listdir(tmp_path) if p.startswith("out")] == []

    src2 = write_jsonl(tmp_path / "bad2.jsonl", [r for r in rows if r != "{not json"])
    with pytest.raises(BadInputError, match=rf"{src2}:4: missing or non-string key"):
        preprocess(src2, str(tmp_path / "out"), cfg, workers=0, progress=False)

    src3 = write_jsonl(tmp_path / "bad3.jsonl", [r for r in rows if r not in ("{not json",
                                                                            {"txt": "5"})])
    with pytest.raises(BadInputError, match=rf"{src3}:6: the tokenizer rejects it"):
        preprocess(src3, str(tmp_path / "out"), cfg, workers=0, progress=False)

    stats = preprocess(src, str(tmp_path / "out"), cfg, workers=2, batch_bytes=20,
                       skip_bad_lines=True, progress=False)
    assert stats.bad_lines == 3 and stats.empty["text"] == 1
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3], [4], [6, 7]]


def test_sft_loss_mask_hand_built(tmp_path):
    # NullTokenizer: text is ids, so the expected layout can be written by hand.
    # Documented layout: prompt tokens (mask 0), response tokens (mask 1), EOD (mask 1).
    cfg = TokenizerConfig(vocab_size=50)  # EOD = 50
    rows = [{"prompt": "5 6 7", "response": "8 9"},
            {"prompt": "1", "response": ""},  # no response tokens: skipped as empty
            {"prompt": "", "response": "4"}]
    src = write_jsonl(tmp_path / "sft.jsonl", rows)
    stats = preprocess(src, str(tmp_path / "s"), cfg, data_format="sft", workers=0,
                       progress=False)
    tokens = IndexedDataset(str(tmp_path / "s_text_document"))
    mask = IndexedDataset(str(tmp_path / "s_lossmask_document"))
    assert [tokens[i].tolist() for i in range(len(tokens))] == [[5, 6, 7, 8, 9, 50], [4, 50]]
    assert [mask[i].tolist() for i in range(len(mask))] == [[0, 0, 0, 1, 1, 1], [1, 1]]
    numpy.testing.assert_array_equal(tokens.sequence_lengths, mask.sequence_lengths)
    assert stats.empty["text"] == 1


def test_sft_messages_mask(tmp_path, sp_model):
    sp = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    msgs = [{"role": "system", "content": "alpha beta"}, {"role": "user", "content": "c=?"},
            {"role": "assistant", "content": "answer: 14"}, {"role": "user", "content": "x->y"},
            {"role": "assistant", "content": "gamma"}]
    src = write_jsonl(tmp_path / "m.jsonl", [{"messages": msgs}])
    preprocess(src, str(tmp_path / "m"), sp_cfg(sp_model), data_format="sft", workers=0,
               progress=False)
    exp_tokens, exp_mask = [], []
    for m in msgs:  # the documented layout: "role:" then content, EOD after assistant turns
        head, body = sp.encode(m["role"] + ":"), sp.encode(m["content"])
        is_asst = m["role"] == "assistant"
        exp_tokens += head + body + ([sp.eos_id()] if is_asst else [])
        exp_mask += [0] * len(head) + [int(is_asst)] * (len(body) + is_asst)
    tokens = IndexedDataset(str(tmp_path / "m_text_document"))
    mask = IndexedDataset(str(tmp_path / "m_lossmask_document"))
    assert tokens[0].tolist() == exp_tokens
    assert mask[0].tolist() == exp_mask


def test_cli_reports_bad_line(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2"}, {"body": "3"}])
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", src,
         "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "10", "--workers", "2", "--append-eod"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert f"{src}:2: missing or non-string key" in proc.stderr
    assert not any(p.startswith("out") for p in os.listdir(tmp_path))
