"""tools/preprocess_data.py whose main process is SIGKILLed (the OOM killer, `timeout -s KILL`,
SLURM's final kill): its workers end with it, and the next run removes what it left.

Before: the workers outlived the main process for good (each still held the read end of its
own pipe, so it blocked on a full pipe instead of failing; and they ignore SIGINT and SIGTERM by
design), and the killed run's temporary files stayed beside the dataset after later runs.
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from megaloop.data.tokenizers import train_sentencepiece
from test_data_preprocess import corpus, write_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "preprocess_data.py")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("tok") / "sp"
    return train_sentencepiece(corpus(400, seed=1), str(prefix), vocab_size=300)


def _alive(pid: int) -> bool:
    """Running (a zombie has ended; it only waits for its parent to read its exit code)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(name))
            except OSError:
                pass
    return out


def _kill_mid_run(tmp_path, sp_model, out_dir) -> tuple[int, list[int], list[str]]:
    """Start the tool with 2 workers, SIGKILL its main process while both are encoding; return
    its pid, its workers' pids and the temporary files it had written by then.

    One line per batch (--batch-bytes 100): a worker sends its parent a message per batch, so
    a worker the parent no longer reads soon has a full pipe, and 20 000 lines are many more
    batches than the workers finish before the kill."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in corpus(20_000, seed=3)])
    cmd = [sys.executable, TOOL, "--input", src, "--output-prefix", str(out_dir / "o"),
           "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model,
           "--workers", "2", "--batch-bytes", "100", "--append-eod", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        # Both workers started and writing their parts.
        while len(workers) < 2 or not any(".tmp" in p for p in os.listdir(out_dir)):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.02)
            workers = _children(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        temporaries = sorted(p for p in os.listdir(out_dir) if ".tmp" in p)
        assert not (out_dir / "o_text_document.idx").exists(), "the run ended before the kill"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        proc.stderr.close()
    return proc.pid, workers, temporaries


def test_workers_end_within_seconds_of_their_parents_sigkill(tmp_path, sp_model):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    parent, workers, _ = _kill_mid_run(tmp_path, sp_model, out_dir)
    deadline = time.monotonic() + 5.0
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [w for w in workers if _alive(w)]
    for w in survivors:  # the test leaves nothing running either way
        os.kill(w, signal.SIGKILL)
    assert not survivors, f"workers {survivors} of the SIGKILLed run {parent} ran 5 s on"


def test_the_next_run_removes_a_killed_runs_temporaries_only(tmp_path, sp_model):
    """The next run into the same output removes the temporary files of the run killed on this
    machine (its pid is dead), and keeps those of a run still going (a live pid) and those of a
    run on another machine (a shared filesystem: its pid says nothing here)."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    parent, workers, temporaries = _kill_mid_run(tmp_path, sp_model, out_dir)
    for w in workers:  # what the workers of a killed run come to (the test above)
        if _alive(w):
            os.kill(w, signal.SIGKILL)
    assert temporaries, "the killed run left no temporary file: nothing to clean up"
    host = socket.gethostname()
    live = f"o_text_document.bin.tmp{os.getpid()}_{host}"  # this test's process is alive
    remote = f"o_text_document.bin.tmp{parent}_elsewhere.example.org.3"
    for name in (live, remote):
        (out_dir / name).write_bytes(b"another run's part")

    cmd = [sys.executable, TOOL, "--input", str(tmp_path / "in.jsonl"), "--output-prefix",
           str(out_dir / "o"), "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
           sp_model, "--workers", "2", "--append-eod", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    left = sorted(p for p in os.listdir(out_dir) if ".tmp" in p)
    assert left == sorted([live, remote]), (temporaries, left)
    assert f"run {parent}" in done.stderr, done.stderr  # the user is told what was removed

    reference = tmp_path / "ref"  # the same input into a clean folder
    subprocess.run(cmd[:5] + [str(reference / "o")] + cmd[6:], check=True, capture_output=True,
                   timeout=120)
    for ext in (".bin", ".idx"):
        assert (out_dir / f"o_text_document{ext}").read_bytes() == \
            (reference / f"o_text_document{ext}").read_bytes()


def test_the_next_run_removes_a_killed_partitioned_runs_folder(tmp_path, sp_model):
    """--partitions N copies the input into a folder beside the output: SIGKILLed, that copy
    stays, and the next run into the same folder (with or without --partitions) removes it,
    keeping a live run's."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in corpus(20_000, seed=4)])
    cmd = [sys.executable, TOOL, "--input", src, "--output-prefix", str(out_dir / "o"),
           "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model,
           "--workers", "2", "--no-progress"]
    proc = subprocess.Popen(cmd + ["--partitions", "2"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not any(p.startswith(".partitions") and os.listdir(out_dir / p)
                      for p in os.listdir(out_dir)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
            time.sleep(0.02)
        workers = _children(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):  # the session's survivors, if any
            os.killpg(proc.pid, signal.SIGKILL)
    for w in workers:
        while _alive(w):  # SIGKILLed with the session above
            time.sleep(0.01)
    killed = [p for p in os.listdir(out_dir) if p.startswith(".partitions")]
    assert len(killed) == 1, killed
    live = f".partitions.tmp{os.getpid()}_{socket.gethostname()}-abc_123"
    (out_dir / live).mkdir()

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p for p in os.listdir(out_dir) if p.startswith(".")) == [live], done.stderr
    assert f"removed {killed[0]}" in done.stderr
