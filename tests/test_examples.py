"""The CPU examples the README points to (examples/demo_cpu.sh, examples/spiral_cpu.sh) pass the
trainer flags that parse and validate, at every size their knobs allow. Each script runs for real
with PYTHON set to a recorder: a stand-in interpreter that writes its arguments down and does
nothing else (``-c`` snippets, such as the free-port lookup, run in the real one), so a script's
own shell logic (ITERS arithmetic, intervals that follow it) is what is checked, in milliseconds."""

import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORDER = """#!/usr/bin/env bash
printf '%s\\0' "$@" >> "$RECORDED"
printf '\\n' >> "$RECORDED"
if [ "$1" = "-c" ]; then exec "$REAL_PYTHON" "$@"; fi
"""


def _dataset(out: Path) -> None:
    """What make_demo_data.sh leaves in the output folder: a (tiny) dataset and a tokenizer."""
    from megaloop.data.indexed_format import IndexedWriter

    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.model").write_text("")  # validate() checks the path, not the contents
    writer = IndexedWriter(str(out / "corpus_text_document.bin"), numpy.uint16)
    writer.add_documents(numpy.arange(6), numpy.array([2, 4]))
    writer.finalize(str(out / "corpus_text_document.idx"))


def _run(tmp_path, script: str, out: Path, **env) -> tuple[subprocess.CompletedProcess, list]:
    recorder = tmp_path / "python"
    recorder.write_text(RECORDER)
    recorder.chmod(0o755)
    log = tmp_path / "recorded"
    log.write_bytes(b"")
    done = subprocess.run(["bash", str(ROOT / script), str(out)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHON": str(recorder),
                                            "REAL_PYTHON": sys.executable, "RECORDED": str(log),
                                            **env})
    calls = [line.rstrip(b"\0").split(b"\0") for line in log.read_bytes().split(b"\n") if line]
    return done, [[a.decode() for a in call] for call in calls]


def _trainer_flags(calls) -> list[str]:
    """pretrain_looplm.py's own flags in the one torchrun call."""
    runs = [c for c in calls if "pretrain_looplm.py" in c]
    assert len(runs) == 1, calls
    return runs[0][runs[0].index("pretrain_looplm.py") + 1:]


def _validate(flags: list[str], world: int):
    from megaloop.training.run_config import parse_args

    cfg = parse_args(flags)
    cfg.validate(world_size=world)
    return cfg


def test_the_demo_passes_flags_that_validate(tmp_path):
    out = tmp_path / "demo"
    _dataset(out)  # the recorder stands in for make_demo_data.sh's tools
    done, calls = _run(tmp_path, "examples/demo_cpu.sh", out)
    assert done.returncode == 0, done.stderr
    cfg = _validate(_trainer_flags(calls), world=2)
    assert cfg.training.train_iters == 300 and cfg.parallel.tensor_model_parallel_size == 2
    # Then it generates from the checkpoint it saved.
    generate = [c for c in calls if any(a.endswith("tools/generate.py") for a in c)]
    assert len(generate) == 1 and str(out / "checkpoint") in generate[0]


@pytest.mark.parametrize("iters", [1, 20, 300])
def test_spiral_iters_knob_gives_flags_that_validate(tmp_path, iters):
    """ITERS=25 used to fail (its warm-up of 30 iterations is longer than the run), after
    imports, in a torchrun traceback: the warm-up, log and evaluation intervals follow ITERS."""
    out = tmp_path / "demo"
    _dataset(out)
    done, calls = _run(tmp_path, "examples/spiral_cpu.sh", out, ITERS=str(iters))
    assert done.returncode == 0, done.stderr
    cfg = _validate(_trainer_flags(calls), world=1)
    assert cfg.training.train_iters == iters
    assert f"{iters} iterations" in done.stdout  # and it says how long that takes
    probes = [c for c in calls if any(a.endswith("tools/attention_probes.py") for a in c)]
    assert len(probes) == 1 and str(out / "spiral_ckpt") in probes[0]


@pytest.mark.parametrize("iters", ["abc", "0", ""])
def test_spiral_refuses_a_bad_iters_in_one_line(tmp_path, iters):
    out = tmp_path / "demo"
    _dataset(out)
    done, calls = _run(tmp_path, "examples/spiral_cpu.sh", out, ITERS=iters)
    if iters == "":  # empty: the default
        assert done.returncode == 0, done.stderr
        return
    assert done.returncode == 2 and calls == []
    assert done.stderr.strip() == (f"error: ITERS={iters}: the number of training iterations, a "
                                   "whole number > 0")
