"""megaloop.launch is torchrun with quieter harmless endings: the same launch and exit codes, one
line instead of a traceback when it is signalled, the rendezvous-shutdown race as one line, and the
ranks' environment untouched (its own C++ log level is not theirs)."""

import logging
import os
import signal
import subprocess
import sys
import time

from distributed import free_port

from megaloop.launch import SHUTDOWN_RACE, _ShutdownRace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RANK = """
import os, signal, sys, time
# one write of the whole line: under PYTHONUNBUFFERED print() writes each piece on its own and
# the two ranks' pieces interleave on the shared pipe (a line under PIPE_BUF is written whole)
line = "rank %s cpp %s\\n" % (os.environ["RANK"], os.environ.get("TORCH_CPP_LOG_LEVEL"))
os.write(1, line.encode())
if len(sys.argv) > 1:  # wait for SIGTERM, then leave cleanly as a rank that saved would
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    open(sys.argv[1], "w").close()
    time.sleep(60)
"""


def _launch(tmp_path, *args, env=None):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    cmd = [sys.executable, "-m", "megaloop.launch", "--nnodes", "1", "--nproc_per_node", "2",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}",
           "--monitor_interval", "0.1", str(script), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env or dict(os.environ), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_launches_like_torchrun_and_leaves_the_ranks_log_level_alone(tmp_path):
    env = dict(os.environ)
    env.pop("TORCH_CPP_LOG_LEVEL", None)
    proc = _launch(tmp_path, env=env)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert sorted(line for line in out.splitlines() if line.startswith("rank")) == [
        "rank 0 cpp None", "rank 1 cpp None"], out
    proc = _launch(tmp_path, env=dict(env, TORCH_CPP_LOG_LEVEL="INFO"))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "rank 1 cpp INFO" in out, out


def test_a_signalled_launcher_says_so_in_one_line_and_exits_1(tmp_path):
    ready = tmp_path / "ready"
    proc = _launch(tmp_path, str(ready))
    deadline = time.time() + 120
    while not ready.exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # both ranks are waiting
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    assert "SIGTERM received and passed on to its ranks" in out, out
    assert "Traceback" not in out and "SignalException" not in out, out


def test_the_rendezvous_shutdown_race_is_one_harmless_line(caplog):
    log = logging.getLogger("test_launch.rendezvous")
    log.addFilter(_ShutdownRace())
    with caplog.at_level(logging.WARNING):
        log.warning("The node 'n2_1_0' has %s 'job' due to an error of type "
                    "RendezvousConnectionError.", SHUTDOWN_RACE)
        log.warning("another rendezvous message")
    assert [r.getMessage() for r in caplog.records] == [
        "rendezvous closed: the first node's launcher, which hosted it, had already left "
        "(harmless: every rank had finished)", "another rendezvous message"]
