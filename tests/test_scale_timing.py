"""Start-up timing: one line on rank 0 and a ``startup_s`` field in the first JSONL record, with
phases that add up to the wall time from launch to the end of the first step, measured from
outside the process (this test's clock at launch, and the moment the first record appears)."""

import json
import os
import subprocess
import sys
import time

from flags import TEST_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ["imports", "process groups", "model", "optimizer", "checkpoint load", "data index",
          "first step"]


def test_startup_phases_sum_to_the_wall_time_to_the_first_step(tmp_path):
    log = tmp_path / "run.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_looplm.py"), *TEST_FLAGS,
           "--num-layers", "2", "--num-loops", "2", "--hidden-size", "32",
           "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
           "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "3",
           "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
           "--vocab-size", "128", "--log-interval", "1", "--eval-iters", "0",
           "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"),
           "--log-jsonl", str(log)]
    launched = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = None
    while proc.poll() is None and seen is None:  # when the first record lands, seen from here
        if log.exists() and log.read_text().endswith("\n"):
            seen = time.time()
        time.sleep(0.01)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert seen is not None
    first = json.loads(log.read_text().splitlines()[0])
    startup = first["startup_s"]
    assert [k for k in startup if k not in ("total", "from")] == PHASES
    assert startup["from"] == "process start"
    assert abs(sum(startup[k] for k in PHASES) - startup["total"]) < 0.01
    assert all(startup[k] >= 0 for k in PHASES)
    # The total against this process's clock: launch to first record, less polling and the
    # record's own formatting (tens of ms), within 1 s + 5% on a loaded 2-core machine.
    wall = seen - launched
    assert startup["total"] <= wall + 0.05 and wall - startup["total"] < 1.0 + 0.05 * wall, (
        startup, wall)
    assert startup["imports"] > 0.5  # torch and megatron-core: seconds, counted from exec
    lines = [line for line in out.splitlines() if line.startswith("> start-up (s): ")]
    assert len(lines) == 1 and all(f"{k} " in lines[0] for k in PHASES), out
    assert all("startup_s" not in json.loads(r) for r in log.read_text().splitlines()[1:])
