"""tools/merge_datasets.py: shards preprocessed separately merge into the bytes that
preprocessing their concatenation writes; mistakes are one-line errors."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _preprocess(jsonl, prefix, tokenizer):
    from megaloop.data.config import TokenizerConfig
    from megaloop.data.preprocess import preprocess

    preprocess(str(jsonl), str(prefix), TokenizerConfig(tokenizer_type="SentencePieceTokenizer",
                                                         tokenizer_model=tokenizer),
               append_eod=True, workers=0, progress=False)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from megaloop.data.tokenizers import train_sentencepiece

    tmp = tmp_path_factory.mktemp("merge")
    docs = [f"document {i}: the loop runs {i % 7} times and then {i * 13 % 11} more."
            for i in range(300)]
    model = train_sentencepiece(docs, str(tmp / "sp"), vocab_size=300)
    parts = [docs[:40], docs[40:41], docs[41:200], docs[200:]]  # one single-document shard
    (tmp / "shards").mkdir()
    for i, part in enumerate(parts):
        jsonl = tmp / f"part_{i:02d}.jsonl"
        jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
        _preprocess(jsonl, tmp / "shards" / f"part_{i:02d}", model)
    whole = tmp / "all.jsonl"
    whole.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    _preprocess(whole, tmp / "all", model)
    return tmp


def _run(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "merge_datasets.py"), *args],
                          capture_output=True, text=True, timeout=120)


def _tool(name):
    """tools/<name>.py as a module: its main(argv) in this process (the refusals below need no
    interpreter of their own; the merge and the partitioned runs above and below start one)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "megaloop" / "cli" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _main(capsys, name, *args):
    """(exit code, stdout, stderr) of tools/<name>.py's main(args) in this process."""
    capsys.readouterr()
    try:
        code = _tool(name).main(list(args))
    except SystemExit as exc:  # argparse's refusals
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_merged_shards_are_byte_identical_to_the_concatenation(shards):
    out = shards / "merged" / "corpus_text_document"
    proc = _run("--input", str(shards / "shards"), "--output-prefix", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "merged 4 datasets (300 documents)" in proc.stdout
    for ext in (".bin", ".idx"):
        assert (out.parent / f"corpus_text_document{ext}").read_bytes() == \
            (shards / f"all_text_document{ext}").read_bytes(), ext


def test_merge_mistakes_are_one_line_errors(shards, tmp_path, capsys):
    lone = tmp_path / "lone"
    lone.mkdir()
    src = shards / "shards" / "part_00_text_document.bin"
    (lone / "x.bin").write_bytes(src.read_bytes())
    code, _, err = _main(capsys, "merge_datasets", "--input", str(lone), "--output-prefix",
                         str(tmp_path / "o"))
    assert code == 2 and "x.idx is missing" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _main(capsys, "merge_datasets", "--input", str(empty), "--output-prefix",
                         str(tmp_path / "o"))
    assert code == 2 and "no .bin/.idx datasets" in err
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "a.idx").write_bytes((shards / "shards" / "part_00_text_document.idx").read_bytes())
    (cut / "a.bin").write_bytes(src.read_bytes()[:-2])
    code, _, err = _main(capsys, "merge_datasets", "--input", str(cut), "--output-prefix",
                         str(tmp_path / "o"))
    assert code == 2 and "a.bin" in err and "cut short" in err
    assert not os.path.exists(tmp_path / "o.bin")
    assert len(err.strip().splitlines()) == 1


def _preprocess_tool(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), *args],
                          capture_output=True, text=True, timeout=300)


def test_partitions_order_documents_as_megatron(shards, tmp_path, capsys):
    """--partitions 3: line i in partition i mod 3, merged in partition order, i.e. the bytes of
    preprocessing the lines in that order; with --keep-sequential-samples the input order. The
    round-robin run is the tool's own process; the others are its main() in this one."""
    lines = (shards / "all.jsonl").read_text().splitlines(keepends=True)
    reordered = tmp_path / "reordered.jsonl"
    reordered.write_text("".join(lines[p] for r in range(3) for p in range(r, len(lines), 3)))
    common = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
              str(shards / "sp.model"), "--append-eod", "--workers", "2", "--no-progress"]
    for extra, reference in ((["--partitions", "3"], reordered),
                             (["--partitions", "3", "--keep-sequential-samples"],
                              shards / "all.jsonl")):
        out = tmp_path / ("seq" if len(extra) == 3 else "rr")
        args = ["--input", str(shards / "all.jsonl"), "--output-prefix", str(out), *common,
                *extra]
        if out.name == "rr":  # the tool's own process (its merge imports megatron-core: seconds)
            proc = _preprocess_tool(*args)
            assert proc.returncode == 0, proc.stderr
        else:  # the same main() in this process, which has imported megatron-core already
            code, _, err = _main(capsys, "preprocess_data", *args)
            assert code == 0, err
        ref = tmp_path / f"ref_{out.name}"
        assert _main(capsys, "preprocess_data", "--input", str(reference), "--output-prefix",
                     str(ref), *common)[0] == 0
        for ext in (".bin", ".idx"):
            assert Path(f"{out}_text_document{ext}").read_bytes() == \
                Path(f"{ref}_text_document{ext}").read_bytes(), (extra, ext)
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".partitions")]
    code, _, err = _main(capsys, "preprocess_data", "--input", str(shards / "all.jsonl"),
                         "--output-prefix", str(tmp_path / "x"), *common, "--split-sentences")
    assert code == 2 and "--split-sentences is not supported" in err
