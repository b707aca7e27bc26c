"""tools/preprocess_data.py as a user runs it: byte ranges per worker, empty inputs, Ctrl-C at
random moments, and a start-up that imports neither torch nor megatron-core.

Expected outputs come from an independent path: megatron-core's own ``IndexedDatasetBuilder`` fed
sentencepiece's encodings of the parsed JSON, one document at a time.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy
import pytest
import sentencepiece
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megaloop.data.config import TokenizerConfig
from megaloop.data.jsonl import BadInputError
from megaloop.data.jsonl import byte_ranges, read_batches
from megaloop.data.preprocess import preprocess
from megaloop.data.tokenizers import train_sentencepiece
from test_data_preprocess import FOREGROUND, corpus, write_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "preprocess_data.py")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("tok") / "sp"
    return train_sentencepiece(corpus(400, seed=1), str(prefix), vocab_size=300)


def test_byte_ranges_own_every_line_once(tmp_path):
    """Whatever the cut points (inside a line, on a newline, at a line start), every line is
    read by exactly one range, in order, with its true byte offset."""
    lines = [b"x" * n + b"\n" for n in (0, 3, 1, 0, 0, 7, 2, 11, 1, 0)] + [b"tail-no-newline"]
    path = tmp_path / "f.jsonl"
    path.write_bytes(b"".join(lines))
    starts = numpy.cumsum([0] + [len(x) for x in lines[:-1]]).tolist()
    size = os.path.getsize(path)
    for parts in range(1, size + 2):
        for batch in (1, 4, 1000):
            got = [(off, ln) for a, b in byte_ranges(size, parts)
                   for offs, lns in read_batches(str(path), a, b, batch)
                   for off, ln in zip(offs, lns)]
            assert got == list(zip(starts, lines)), (parts, batch)


def test_batches_are_bounded_by_bytes_not_lines(tmp_path):
    """Memory per worker is one batch: at most --batch-bytes plus one line, so a very long
    document ends its batch and many short ones share one (line counts do not matter)."""
    rng = numpy.random.default_rng(0)
    sizes = [int(n) for n in rng.integers(1, 300, size=400)] + [50_000] + [3] * 2000
    path = tmp_path / "f.jsonl"
    path.write_bytes(b"".join(b"x" * (n - 1) + b"\n" for n in sizes))
    batch_bytes = 4096
    batches = [lines for _, lines in read_batches(str(path), 0, None, batch_bytes)]
    assert sum(map(len, batches)) == len(sizes)
    for lines in batches:
        assert sum(map(len, lines)) - len(lines[-1]) <= batch_bytes  # full before the last line
    long = [lines for lines in batches if b"x" * 49_999 + b"\n" in lines]
    assert len(long) == 1 and long[0][-1] == b"x" * 49_999 + b"\n"  # nothing read after it
    assert max(map(len, batches)) > 1000  # tiny documents are not one batch each


def _megatron_reference(src: str, model: str, prefix: str) -> dict:
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for line in open(src, "rb"):
        ids = sp.encode(json.loads(line)["text"]) + [sp.eos_id()]
        builder.add_document(numpy.array(ids), [len(ids)])
    builder.finalize(prefix + ".idx")
    return {ext: open(prefix + ext, "rb").read() for ext in (".bin", ".idx")}


def test_workers_and_batches_match_megatron_builder(tmp_path, sp_model):
    # Documents from a few bytes to ~60 kB, so that ranges and batches cut everywhere.
    texts = corpus(300, seed=5)
    texts[7] = " ".join(corpus(2000, seed=6))
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    expected = _megatron_reference(src, sp_model, str(tmp_path / "ref"))
    cfg = TokenizerConfig("SentencePieceTokenizer", sp_model)
    for workers, batch in ((0, 1 << 20), (1, 100), (2, 1 << 20), (3, 7), (5, 4000)):
        out = str(tmp_path / f"w{workers}")
        preprocess(src, out, cfg, workers=workers, batch_bytes=batch, append_eod=True,
                   progress=False)
        got = {ext: open(f"{out}_text_document{ext}", "rb").read() for ext in (".bin", ".idx")}
        assert got == expected, (workers, batch)
        assert sorted(os.listdir(tmp_path)) == sorted(
            p for p in os.listdir(tmp_path) if ".tmp" not in p)


@pytest.mark.parametrize("rows,why", [([], "0 non-blank lines"),
                                      (["", "   "], "0 non-blank lines"),
                                      ([{"text": ""}, {"text": ""}], "2 empty after"),
                                      (["{bad", {"other": "x"}], "2 bad lines skipped")])
def test_nothing_to_write_is_an_error_naming_the_file(tmp_path, rows, why):
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    for workers in (0, 2):
        with pytest.raises(BadInputError, match=rf"{src}: no documents to write.*{why}"):
            preprocess(src, str(tmp_path / "out"), TokenizerConfig(vocab_size=9),
                       workers=workers, skip_bad_lines=True, progress=False)
        assert os.listdir(tmp_path) == ["in.jsonl"]  # no dataset that cannot be opened


def test_cli_empty_input_exit_code_and_message(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [])
    proc = subprocess.run([sys.executable, TOOL, "--input", src, "--output-prefix",
                           str(tmp_path / "out"), "--vocab-size", "9", "--no-progress"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and f"error: {src}: no documents to write" in proc.stderr


def test_startup_imports_neither_torch_nor_megatron(tmp_path, sp_model):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "alpha beta"}])
    proc = subprocess.run([sys.executable, "-X", "importtime", TOOL, "--input", src,
                           "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
                           "SentencePieceTokenizer", "--tokenizer-model", sp_model, "--workers",
                           "2", "--no-progress"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = [line.split("|")[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")]
    assert "sentencepiece" in imported and "numpy" in imported  # the probe sees imports
    assert [m for m in imported if m.split(".")[0] in ("torch", "megatron")] == []


def _session_processes(sid: int) -> list:
    """Live (not zombie) processes of session ``sid``: a run's workers keep its session."""
    alive = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if os.getsid(int(name)) == sid and state != "Z":
                alive.append(int(name))
        except OSError:  # ended meanwhile
            pass
    return alive


def test_ctrl_c_and_sigterm_at_random_moments_stop_fast_and_leave_nothing(tmp_path, sp_model):
    """24 runs, each interrupted at a random moment of its ~1 s (start-up, encoding, joining
    the parts, publishing) by SIGINT (Ctrl-C) or SIGTERM (SLURM, `timeout`), sent to the whole
    process group or to the main process only: every run ends within 2 s of the signal, leaves
    no worker process and no temporary file, and leaves either no output or the complete one (a
    signal that lands after publishing can still end the process with a non-zero code; it never
    leaves half a dataset)."""
    rows = [{"text": t} for t in corpus(6000, seed=9)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out_dir = tmp_path / "out"
    cmd = [sys.executable, "-c", FOREGROUND, TOOL, "--input", src, "--output-prefix",
           str(out_dir / "o"),
           "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model,
           "--workers", "2", "--batch-bytes", "20000", "--append-eod", "--no-progress"]
    runs = []
    for _ in range(2):  # how long a whole run is (the shorter of two: load varies)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
        runs.append(time.perf_counter() - t0)
    whole = min(runs)
    complete = {p: open(out_dir / p, "rb").read() for p in os.listdir(out_dir)}
    rng = random.Random(0)
    outcomes = []
    for trial in range(24):
        for p in os.listdir(out_dir):
            os.remove(out_dir / p)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        time.sleep(rng.uniform(0.05, 0.75 * whole))
        signum = signal.SIGINT if trial % 4 < 2 else signal.SIGTERM
        # Half the time to the whole process group (a terminal's Ctrl-C, `timeout`, SLURM),
        # else to the main process alone (`kill PID`).
        if trial % 2:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        sent = time.perf_counter()
        try:
            _, err = proc.communicate(timeout=2.0)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            pytest.fail(f"trial {trial}: still running 2 s after {signum.name}")
        took = time.perf_counter() - sent
        survivors = _session_processes(proc.pid)
        if survivors:
            os.killpg(proc.pid, signal.SIGKILL)
        assert not survivors, (trial, signum.name, survivors, err[-1500:])
        left = sorted(os.listdir(out_dir))
        assert not [p for p in left if ".tmp" in p], (trial, signum.name, left, proc.returncode,
                                                      err[-1500:])
        # 130 / 143: the tool's clean-up ran; -SIGINT / -SIGTERM: before its handler or after
        # its end; a KeyboardInterrupt inside Python's own start-up (site import) exits 1.
        assert (proc.returncode in (0, 128 + signum, -signum)
                or b"KeyboardInterrupt" in err), (trial, signum.name, proc.returncode, err)
        if proc.returncode == 0 or left:
            # The .idx digest is written after publishing and records the .idx's mtime: its
            # hash must match, when it was written at all.
            data = [p for p in left if not p.endswith(".digest")]
            assert {p: open(out_dir / p, "rb").read() for p in data} == \
                {p: v for p, v in complete.items() if not p.endswith(".digest")}, trial
            for p in set(left) - set(data):
                assert json.loads(open(out_dir / p).read())["sha1"] == \
                    json.loads(complete[p])["sha1"], trial
        outcomes.append((proc.returncode, bool(left), round(took, 2)))
    interrupted = sum(rc != 0 and not published for rc, published, _ in outcomes)
    assert interrupted >= 8, outcomes  # the trials did hit running work


@pytest.mark.parametrize("interrupt, code", [("Terminated", 143), ("KeyboardInterrupt", 130)])
def test_signal_during_a_c_extension_import_is_an_interruption(tmp_path, sp_model, monkeypatch,
                                                               interrupt, code):
    """A SIGTERM or Ctrl-C that lands while sentencepiece's C extension initialises reaches
    the tool as ImportError("initialization failed") with the interrupt as its context (seen
    in the random-signal test above under load): the tool exits 143 / 130 as for any other
    interruption (as it does when the signal lands outside an import), and a plain ImportError
    still propagates."""
    import importlib.util

    import megaloop.data.preprocess as pre

    spec = importlib.util.spec_from_file_location(
        "preprocess_tool", os.path.join(REPO, "megaloop", "cli", "preprocess_data.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    exc = pre.Terminated if interrupt == "Terminated" else KeyboardInterrupt

    def interrupted_import(*args, **kwargs):
        try:
            raise exc()
        except KeyboardInterrupt:
            raise ImportError("initialization failed")

    monkeypatch.setattr(pre, "preprocess", interrupted_import)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a b c"}])
    argv = ["--input", src, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
            "SentencePieceTokenizer", "--tokenizer-model", sp_model, "--no-progress"]
    assert tool.main(argv) == code

    def interrupted_run(*args, **kwargs):  # the same signal outside any import
        raise exc()

    monkeypatch.setattr(pre, "preprocess", interrupted_run)
    assert tool.main(argv) == code

    def broken_import(*args, **kwargs):
        raise ImportError("no module named x")

    monkeypatch.setattr(pre, "preprocess", broken_import)
    with pytest.raises(ImportError, match="no module named x"):
        tool.main(argv)
