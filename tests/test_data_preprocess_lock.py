"""One preprocessing run per output prefix: the lock ``<prefix>.preprocess.lock``.

Two runs into one prefix used to both report success, the later silently replacing the other's
files. The run holding the prefix here is a real preprocessing run (the library's
``preprocess``) reading a gzip stream from a named pipe, so it stays in the middle of its work
until the test feeds it.
"""

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from megaloop.data import preprocess as pre
from test_data_preprocess import corpus, sp_model, write_jsonl  # noqa: F401 (fixture)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "preprocess_data.py")

HOLDER = """
import faulthandler, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's (see FOREGROUND)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the stacks, should it hang
sys.path.insert(0, {repo!r})
from megaloop.data.config import TokenizerConfig
from megaloop.data.preprocess import preprocess
stats = preprocess({src!r}, {prefix!r}, TokenizerConfig("SentencePieceTokenizer", {model!r}),
                   workers=1, append_eod=True, progress=False)
print("documents", stats.documents_read)
"""


def _holder(tmp_path, prefix, model):
    """A preprocessing run into ``prefix`` that waits, lock held, for its input: feed it with
    ``_feed(tmp_path, rows)``."""
    fifo = str(tmp_path / "stream.jsonl.gz")
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.format(repo=REPO, src=fifo,
                                                                  prefix=prefix, model=model)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = prefix + pre.LOCK_SUFFIX
    deadline = time.monotonic() + 60
    while not os.path.exists(lock):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never took its lock"
        time.sleep(0.05)
    return proc, fifo


def _feed(fifo, rows):
    with gzip.open(fifo, "wt") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _cli(src, prefix, model, *extra):
    return subprocess.run([sys.executable, TOOL, "--input", src, "--output-prefix", prefix,
                           "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                           model, "--append-eod", "--no-progress", *extra],
                          capture_output=True, text=True, timeout=120)


def _refused_one_line(done, prefix, holder_text):
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"--output-prefix {prefix} is in use by another preprocessing run: {holder_text}" \
        in errors[0], errors


def test_a_second_run_is_refused_naming_the_first_which_is_left_intact(tmp_path, sp_model):
    out = tmp_path / "out"
    prefix = str(out / "o")
    rows = [{"text": t} for t in corpus(300, seed=3)]
    other = write_jsonl(tmp_path / "other.jsonl", [{"text": t} for t in corpus(50, seed=4)])
    holder, fifo = _holder(tmp_path, prefix, sp_model)
    try:
        who = f"pid {holder.pid} on host {socket.gethostname()}"
        _refused_one_line(_cli(other, prefix, sp_model), prefix, who)
        _refused_one_line(_cli(other, prefix, sp_model, "--partitions", "2"), prefix, who)
        # Nothing published by the refused runs (the holder's own part file is being written).
        assert not [p for p in os.listdir(out) if p.endswith((".bin", ".idx"))]
        _feed(fifo, rows)
        stdout, stderr = holder.communicate(timeout=120)
    finally:
        holder.kill()
    assert holder.returncode == 0 and "documents 300" in stdout, stderr
    assert not os.path.exists(prefix + pre.LOCK_SUFFIX)  # released on success
    # The first run's output is what the same rows give alone, untouched by the refused ones.
    reference = str(tmp_path / "ref" / "o")
    assert _cli(write_jsonl(tmp_path / "rows.jsonl", rows), reference, sp_model).returncode == 0
    for ext in (".bin", ".idx"):
        assert open(prefix + "_text_document" + ext, "rb").read() == \
            open(reference + "_text_document" + ext, "rb").read()
    # Free again: the next run goes ahead.
    assert _cli(other, prefix, sp_model).returncode == 0


def test_a_killed_runs_lock_is_taken_over_with_a_note(tmp_path, sp_model):
    prefix = str(tmp_path / "out" / "o")
    lock = prefix + pre.LOCK_SUFFIX
    holder, _ = _holder(tmp_path, prefix, sp_model)
    holder.kill()  # SIGKILL: no clean-up runs, the lock stays
    holder.communicate()
    assert os.path.exists(lock)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in corpus(50, seed=5)])
    done = _cli(src, prefix, sp_model)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"took over the stale lock {lock} of pid {holder.pid} on host " \
        f"{socket.gethostname()}" in done.stderr and \
        f"its process {holder.pid} no longer runs on this host" in done.stderr, done.stderr
    assert not os.path.exists(lock)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_run_releases_the_lock(tmp_path, sp_model, signum):
    out = tmp_path / "out"
    holder, _ = _holder(tmp_path, str(out / "o"), sp_model)
    holder.send_signal(signum)
    try:
        _, stderr = holder.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        holder.send_signal(signal.SIGUSR1)
        time.sleep(1)
        holder.kill()
        raise AssertionError(f"still running 60 s after the signal:\n{holder.communicate()[1]}")
    assert holder.returncode != 0 and ("KeyboardInterrupt" in stderr or
                                       "Terminated" in stderr), stderr
    assert os.listdir(out) == []  # neither the lock nor a temporary file


def test_a_failed_run_releases_the_lock(tmp_path, sp_model):
    out = tmp_path / "out"
    src = write_jsonl(tmp_path / "bad.jsonl", [{"text": "alpha"}, "not json"])
    done = _cli(src, str(out / "o"), sp_model)
    assert done.returncode == 1 and "error:" in done.stderr, done.stderr
    assert os.listdir(out) == []


def _foreign_lock(lock, age_s):
    with open(lock, "w") as f:
        json.dump({"host": "node-elsewhere", "pid": 1, "slurm_job_id": None,
                   "started": "then", "token": "x"}, f)
    os.utime(lock, (time.time() - age_s, time.time() - age_s))


def test_another_hosts_lock_is_kept_while_refreshed_and_taken_over_after(tmp_path, sp_model):
    out = tmp_path / "out"
    out.mkdir()
    prefix = str(out / "o")
    lock = prefix + pre.LOCK_SUFFIX
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in corpus(50, seed=6)])
    # Refreshed within the limit (a holder touches it every LOCK_REFRESH_S): a live run.
    _foreign_lock(lock, pre.LOCK_STALE_MIN * 60 - 2 * pre.LOCK_REFRESH_S)
    _refused_one_line(_cli(src, prefix, sp_model), prefix, "pid 1 on host node-elsewhere")
    _foreign_lock(lock, pre.LOCK_STALE_MIN * 60 + 60)
    done = _cli(src, prefix, sp_model)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"took over the stale lock {lock} of pid 1 on host node-elsewhere" in done.stderr \
        and f"not refreshed for {pre.LOCK_STALE_MIN + 1:.1f} min" in done.stderr, done.stderr
    assert not os.path.exists(lock)


def test_the_holder_refreshes_its_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(pre, "LOCK_REFRESH_S", 0.05)
    prefix = str(tmp_path / "o")
    lock = prefix + pre.LOCK_SUFFIX
    with pre.output_lock(prefix):
        os.utime(lock, (time.time() - 3600, time.time() - 3600))
        deadline = time.monotonic() + 10
        while time.time() - os.path.getmtime(lock) > 60 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert time.time() - os.path.getmtime(lock) < 60
    assert not os.path.exists(lock)
