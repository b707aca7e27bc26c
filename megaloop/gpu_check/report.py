"""The GPU check's summary: one line per row as it finishes, a table at the end, and one JSON file
with every number (``summary.json`` in the output directory, next to the rows' logs).

Rows are correctness: a FAIL row makes the exit status 1. Goals (FP8 speed-up, looped/dense MFU)
are performance targets, reported in a section of their own as MET / NOT MET with the measured
figure and never touching the exit status: a healthy run that misses a speed goal (FP8 at hidden
2048 typically gains 1.1-1.25x, not 1.3x) is a finding about speed, not a broken GPU path."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

# PASS / FAIL: a check with a verdict. INFO: a measurement without a goal. SKIP: not run, with
# the reason. REHEARSED: without a GPU, the row's command lines ran with the GPU-only flags
# swapped for CPU ones and the row's own checks passed (the GPU verdict is still to come).
STATUSES = ("PASS", "FAIL", "INFO", "SKIP", "REHEARSED")
# A goal: MET / NOT MET on a GPU; NOT JUDGED without one (the CPU rehearsal's figure is not a
# GPU's) or when a run it needs is missing (that run's own row says why).
GOAL_STATUSES = ("MET", "NOT MET", "NOT JUDGED")


@dataclass
class Result:
    row: str
    status: str
    detail: str = ""
    seconds: float | None = None
    numbers: dict = field(default_factory=dict)
    log: str | None = None
    gpu_command: str | None = None
    """What the row runs on a GPU (printed when it is skipped or rehearsed)."""


@dataclass
class Report:
    out_dir: str
    header: dict = field(default_factory=dict)
    results: list = field(default_factory=list)
    goals: list = field(default_factory=list)
    on_fail: Optional[Callable[[], None]] = None
    """Called after every FAIL row (the check starts a fresh worker there)."""

    def add(self, result: Result) -> Result:
        assert result.status in STATUSES, result.status
        self.results.append(result)
        secs = "" if result.seconds is None else f" ({result.seconds:.0f} s)"
        print(f"[gpu_check] {result.status:9s} {result.row}: {result.detail}{secs}", flush=True)
        self.write()  # after every row: a run killed halfway still leaves its numbers
        if result.status == "FAIL" and self.on_fail is not None:
            self.on_fail()
        return result

    def add_goal(self, goal: Result) -> Result:
        assert goal.status in GOAL_STATUSES, goal.status
        self.goals.append(goal)
        print(f"[gpu_check] goal {goal.status}: {goal.row}: {goal.detail}", flush=True)
        self.write()
        return goal

    @property
    def failed(self) -> list:
        return [r for r in self.results if r.status == "FAIL"]

    def exit_status(self) -> int:
        """1 if a correctness row failed, else 0; goals do not count."""
        return 1 if self.failed else 0

    def table(self) -> str:
        lines = ["| row | status | detail | s |", "|---|---|---|---|"]
        for r in self.results:
            secs = "" if r.seconds is None else f"{r.seconds:.0f}"
            detail = r.detail.replace("|", "/").replace("\n", " ")
            lines.append(f"| {r.row} | {r.status} | {detail} | {secs} |")
        if self.goals:
            lines += ["", "Goals (performance; not part of the exit status):", "",
                      "| goal | status | measured |", "|---|---|---|"]
            lines += [f"| {g.row} | {g.status} | {g.detail.replace('|', '/')} |"
                      for g in self.goals]
        return "\n".join(lines)

    def write(self) -> None:
        with open(os.path.join(self.out_dir, "summary.json"), "w") as f:
            json.dump({"header": self.header, "rows": [asdict(r) for r in self.results],
                       "goals": [asdict(g) for g in self.goals]}, f, indent=1, default=str)
        with open(os.path.join(self.out_dir, "summary.md"), "w") as f:
            f.write(self.table() + "\n")


def say(text: str) -> None:
    print(f"[gpu_check] {text}", file=sys.stdout, flush=True)
