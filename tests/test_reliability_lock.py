"""One run per --save folder: the lock file taken at start-up (megaloop/training/save_lock.py).

Holders are real processes: two training runs started together, a subprocess that took the lock
(alive, then killed), a lock written by hand for another host; the checks read the refusal, the
exit code, and what is left in the folder.
"""

import json
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from distributed import run_distributed
from test_reliability import _main
from test_training import BASE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = BASE + ["--micro-batch-size", "2"]
LOCK = "megaloop_run.lock"


def _slow_main(rank, world, flags):
    """pretrain_looplm.main whose steps take 0.5 s each (a run that is still training when the
    other one starts)."""
    from megaloop.training import trainer as trainer_mod

    step = trainer_mod.Trainer.train_step

    def slow_step(self):
        time.sleep(0.5)
        return step(self)

    trainer_mod.Trainer.train_step = slow_step
    return _main(rank, world, flags, set())


def _run_when_set(start, flags, results, name):
    start.wait()
    results.put((name, run_distributed(_slow_main, 1, flags, timeout=180)[0]))


def test_two_runs_started_together_one_refuses(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    flags = TINY + ["--train-iters", "6", "--save", ckpt, "--save-interval", "2"]
    ctx = mp.get_context("fork")
    start, results = ctx.Event(), ctx.Queue()
    runs = [ctx.Process(target=_run_when_set, args=(start, flags + ["--log-jsonl", str(
        tmp_path / f"{name}.jsonl")], results, name)) for name in ("a", "b")]
    for p in runs:
        p.start()
    start.set()
    codes = dict(results.get(timeout=300) for _ in runs)
    for p in runs:
        p.join(timeout=10)
    assert sorted(codes.values()) == [0, 2], codes
    winner = next(name for name, code in codes.items() if code == 0)
    loser = next(name for name, code in codes.items() if code == 2)
    loser_log = tmp_path / f"{loser}.jsonl"  # refused before its first step
    assert not loser_log.exists() or loser_log.read_text() == ""
    # Only the winner's checkpoints, complete, and the lock released.
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004", "iter_0000006",
                                        "latest_checkpointed_iteration.txt"]
    assert [json.loads(line)["iteration"] for line in open(tmp_path / f"{winner}.jsonl")] == \
        [1, 2, 3, 4, 5, 6]


HOLDER = """
import sys, time
from megaloop.training.save_lock import SaveLock, _take
refusal, notes, token = _take(sys.argv[1], 60.0)
lock = SaveLock(sys.argv[1] + "/megaloop_run.lock", token)  # releases at exit and on SIGTERM
print("held" if refusal is None else refusal, flush=True)
time.sleep(120)
"""


def _holder(save_dir):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, save_dir], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, env=dict(os.environ, SLURM_JOB_ID="4242"))
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_holder_is_named_and_a_dead_one_taken_over(tmp_path, capfd):
    ckpt = str(tmp_path / "ckpt")
    flags = TINY + ["--train-iters", "1", "--save", ckpt]
    assert run_distributed(_main, 1, flags, set())[0] == 0  # a checkpoint for the --load below
    saved = sorted(os.listdir(ckpt))
    holder = _holder(ckpt)
    try:
        assert run_distributed(_main, 1, flags, set())[0] == 2
        err = capfd.readouterr().err
        line = [x for x in err.splitlines() if x.startswith("error:")]
        assert len(line) == 1 and f"pid {holder.pid} on host {socket.gethostname()}" in line[0] \
            and "SLURM job 4242" in line[0] and os.path.join(ckpt, LOCK) in line[0], err
        assert sorted(os.listdir(ckpt)) == sorted(saved + [LOCK])  # nothing removed or written
        # --load of the held folder needs no lock.
        assert run_distributed(_main, 1, TINY + ["--train-iters", "1", "--load", ckpt,
                                                 "--save", str(tmp_path / "other")],
                               set())[0] == 0
    finally:
        holder.kill()  # SIGKILL: the lock stays behind, stale
        holder.wait()
    assert sorted(os.listdir(ckpt)) == sorted(saved + [LOCK])
    capfd.readouterr()
    assert run_distributed(_main, 1, flags, set())[0] == 0
    out = capfd.readouterr().out
    assert f"took over the stale lock {os.path.join(ckpt, LOCK)} of pid {holder.pid}" in out \
        and "no longer runs" in out, out
    assert LOCK not in os.listdir(ckpt)  # released at the end


def _write_lock(save_dir, age_s, job=None):
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, LOCK)
    with open(path, "w") as f:
        json.dump({"host": "node-elsewhere", "pid": 1, "slurm_job_id": job,
                   "started": "then", "token": "x"}, f)
    os.utime(path, (time.time() - age_s, time.time() - age_s))


@pytest.mark.parametrize("age_min,code", [(20, 2), (90, 0)])
def test_another_hosts_lock_is_stale_after_the_timeout(tmp_path, capfd, age_min, code):
    ckpt = str(tmp_path / "ckpt")
    _write_lock(ckpt, age_min * 60, job="77")
    flags = TINY + ["--train-iters", "1", "--save", ckpt, "--save-lock-timeout", "60"]
    assert run_distributed(_main, 1, flags, set())[0] == code
    captured = capfd.readouterr()
    if code == 2:
        assert "in use by another run: pid 1 on host node-elsewhere, SLURM job 77" in \
            captured.err
        # The same SLURM job requeued onto another node takes its own lock back at once.
        os.environ["SLURM_JOB_ID"] = "77"
        try:
            assert run_distributed(_main, 1, flags, set())[0] == 0
        finally:
            del os.environ["SLURM_JOB_ID"]
        assert "it was taken by this SLURM job (77) before it was requeued" in \
            capfd.readouterr().out
    else:
        assert re.search(r"took over the stale lock .* of pid 1 on host node-elsewhere, SLURM job "
                         r"77, started then: not refreshed for 9\d\.\d min, more than "
                         r"--save-lock-timeout 60",
                         captured.out), captured.out


def test_sigterm_releases_the_lock(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    holder = _holder(ckpt)
    holder.send_signal(signal.SIGTERM)
    assert holder.wait(timeout=30) == -signal.SIGTERM  # still dies of the signal
    assert os.listdir(ckpt) == []


def test_a_zombie_holder_is_taken_over(tmp_path):
    """A holder that has ended but was never reaped (a zombie: an orphan under an init that does
    not reap, or a child of a killed launcher) holds nothing; its lock is taken over. The zombie is
    made here by not waiting for an ended child, and told apart from a live one."""
    from megaloop import lockfile

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.time() + 60
        while time.time() < deadline:  # /proc reads Z once it has exited, before any wait()
            with open(f"/proc/{ended.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.05)
        assert lockfile.pid_alive(live.pid) and not lockfile.pid_alive(ended.pid)
        path = str(tmp_path / LOCK)
        for holder, taken in ((live, False), (ended, True)):
            with open(path, "w") as f:
                json.dump({"host": socket.gethostname(), "pid": holder.pid, "token": "x"}, f)
            got = lockfile.take(path, 60.0, "--save-lock-timeout 60")
            assert (got.token is not None) == taken, got
            if taken:
                assert len(got.notes) == 1 and f"process {ended.pid} no longer runs" in got.notes[0]
            os.remove(path)
    finally:
        live.kill()
        live.wait()
        ended.wait()


FAKE_SQUEUE = """#!/bin/sh
echo "$@" >> "$FAKE_SQUEUE_CALLS"
printf '%b' "$FAKE_SQUEUE_OUT"
printf '%b' "$FAKE_SQUEUE_ERR" >&2
exit "$FAKE_SQUEUE_RC"
"""


@pytest.mark.parametrize("out,err,rc,same,taken", [
    ("RUNNING\\n", "", 0, {}, None),
    ("COMPLETING\\n", "", 0, {}, None),  # its processes may still be there
    ("PENDING\\n", "", 0, {}, None),
    ("FAILED\\n", "", 0, {}, "its state is FAILED"),
    ("CANCELLED\\n", "", 0, {}, "its state is CANCELLED"),
    ("", "", 0, {}, "SLURM no longer lists it"),
    ("", "slurm_load_jobs error: Invalid job id specified\\n", 1, {},
     "SLURM no longer lists it"),
    ("", "slurm_load_jobs error: Unable to contact slurm controller\\n", 1, {}, None),
    ("", "", 0, {"uid": -1}, None),  # another user's job may be hidden (PrivateData)
    ("FAILED\\n", "", 0, {"uid": -1}, "its state is FAILED"),
    ("FAILED\\n", "", 0, {"slurm_cluster": "other"}, None),  # not this squeue's to tell
])
def test_a_lock_of_an_ended_slurm_job_is_stale_at_once(tmp_path, monkeypatch, out, err, rc, same,
                                                       taken):
    """A job cancelled with its launcher (scancel --full) leaves its rank 0's lock behind, on
    whichever node that rank ran: the next job's rank 0 may be on another host, where only the
    refresh timeout (an hour) would free it. The holder's SLURM job is asked after (squeue, here
    a script on PATH answering as SLURM 22.05 does): ended or forgotten, the lock is stale."""
    from megaloop import lockfile

    (tmp_path / "bin").mkdir()
    squeue = tmp_path / "bin" / "squeue"
    squeue.write_text(FAKE_SQUEUE)
    squeue.chmod(0o755)
    calls = tmp_path / "calls"
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    for key, value in (("OUT", out), ("ERR", err), ("RC", str(rc)), ("CALLS", str(calls))):
        monkeypatch.setenv(f"FAKE_SQUEUE_{key}", value)
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "here")
    holder = {"host": "node-elsewhere", "pid": 1, "slurm_job_id": "77", "slurm_cluster": "here",
              "uid": os.getuid(), **same}
    why = lockfile.stale_reason(holder, 0.0, 60.0, "--save-lock-timeout 60")
    if taken is None:
        assert why is None
    else:
        assert why == f"its SLURM job 77 has ended ({taken})"
    asked = calls.read_text().split() if calls.exists() else []
    assert asked == ([] if same.get("slurm_cluster") else
                     ["--noheader", "--jobs=77", "--format=%T"])
    monkeypatch.setenv("PATH", "/nonexistent")  # no squeue: nothing to conclude
    assert lockfile.stale_reason(holder, 0.0, 60.0, "--save-lock-timeout 60") is None
