"""End to end: SIGTERM to a torchrun job, restart with --load, identical losses (issue 5)."""

import json
import os
import signal
import subprocess
import sys
import time

from distributed import console_of, free_port, run_distributed, run_main
from test_checkpoint import _records, _train
from flags import TEST_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Enough iterations after the signal (sent once iteration 3 is logged) for the stop to land well
# before the end on a loaded machine, with evaluations (every 5) on both sides of it.
ITERS = 20
FLAGS = [*TEST_FLAGS, "--tensor-model-parallel-size", "2", "--num-layers", "2", "--num-loops", "3",
         "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", str(ITERS), "--lr", "3e-3", "--hidden-dropout", "0.1", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--log-interval", "1",
         "--eval-iters", "1", "--eval-interval", "5"]


def _torchrun(extra, log):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), os.path.join(ROOT, "pretrain_looplm.py"),
           *FLAGS, *extra, "--log-jsonl", str(log)]
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _iterations(log):
    if not log.exists():
        return 0
    return max([json.loads(l)["iteration"] for l in log.read_text().splitlines()] or [0])


def test_sigterm_to_torchrun_then_load_continues_with_identical_losses(tmp_path):
    ckpt = tmp_path / "ckpt"
    log = tmp_path / "run.jsonl"
    run = ["--save", str(ckpt), "--load", str(ckpt), "--exit-signal-handler"]
    proc = _torchrun(run, log)
    deadline = time.time() + 240
    while _iterations(log) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    # What SLURM does before a time limit or preemption (sbatch --signal=TERM@...): torchrun
    # gets SIGTERM and forwards it to the ranks, which finish the step, save and exit 0.
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert "SIGTERM received" in out, out[-3000:]
    stopped = int(open(ckpt / "latest_checkpointed_iteration.txt").read())
    assert 3 <= stopped < ITERS, out[-3000:]
    assert _iterations(log) == stopped

    # The restart: pretrain_looplm.main on two forked ranks (the launch is not under test here;
    # the load is, and it is the same code under torchrun).
    console = tmp_path / "resumed"
    console.mkdir()
    codes = run_distributed(run_main, 2, FLAGS + run + ["--log-jsonl", str(log)], str(console),
                            timeout=300)
    out = console_of(console, 2)[0]
    assert codes == [0, 0], "".join(console_of(console, 2))[-3000:]
    assert f"loaded {ckpt}/iter_{stopped:07d}" in out

    straight = run_distributed(_train, 2, FLAGS + ["--log-jsonl", str(tmp_path / "a.jsonl")])[0][1]
    key = lambda r: (r["split"], r["iteration"], r["loss"], tuple(r["step_losses"]))  # noqa: E731
    assert [key(r) for r in _records(log)] == [key(r) for r in straight]
