"""Start-up timing: one line on rank 0 and a ``startup_s`` field in the first JSONL record, with
phases that add up to the wall time from launch to the end of the first step, measured from
outside the process (this test's clock at launch, and the moment the first record appears): the
plain launch of tests/conftest.py's ``plain_launch``."""

import json

PHASES = ["imports", "process groups", "model", "optimizer", "checkpoint load", "data index",
          "first step"]


def test_startup_phases_sum_to_the_wall_time_to_the_first_step(plain_launch):
    proc, log, seen = plain_launch["proc"], plain_launch["log"], plain_launch["seen"]
    launched, out, err = plain_launch["launched"], proc.stdout, proc.stderr
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
