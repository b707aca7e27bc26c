"""--tensorboard-dir and --wandb-project: the optional logging backends.

TensorBoard is installed by tools/setup_venv.sh, so a run with --tensorboard-dir (the SLURM
example's default) works on first use; what it writes is read back with TensorBoard's own reader
and compared with the run's JSONL records. Where a backend's package is missing, the run refuses
before training with one line naming the pip install (checked by making its import fail, whether
or not it is installed here). wandb itself is not installed by the setup (large, with a service
binary of its own); what megaloop hands it is checked through a recording stand-in.
"""

import importlib.util
import json
import os
import sys
import types

import pytest

from distributed import console_of, run_distributed, run_main
from flags import TEST_FLAGS

TINY = [*TEST_FLAGS, "--num-layers", "2", "--num-loops", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "4",
        "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
        "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "1"]

no_tensorboard = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="tensorboard is not installed (bash tools/setup_venv.sh installs it)")


def _event_scalars(folder) -> dict:
    """{tag: {step: value}} of every TensorBoard event file under ``folder``, read with
    TensorBoard's reader (not torch's writer, which wrote them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@no_tensorboard
def test_tensorboard_dir_writes_the_logged_scalars(tmp_path):
    tb, log = tmp_path / "tb", tmp_path / "run.jsonl"
    argv = [*TINY, "--tensorboard-dir", str(tb), "--log-jsonl", str(log)]
    assert run_distributed(run_main, 1, argv, str(tmp_path), timeout=300) == [0]
    out, err = console_of(tmp_path, 1)
    assert "error" not in err and "Warning" not in err, err  # nothing for the user to read
    assert any(name.startswith("events.out.tfevents.") for name in os.listdir(tb)), \
        os.listdir(tb)
    scalars = _event_scalars(tb)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    valid = [r for r in records if r["split"] == "valid"]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4] and valid, records
    # Every logged iteration, with the values the JSONL record holds (float32 in the events).
    assert scalars["train/loss"] == pytest.approx({r["iteration"]: r["loss"] for r in train},
                                                  rel=1e-6)
    assert scalars["train/lr"] == pytest.approx({r["iteration"]: r["lr"] for r in train},
                                                rel=1e-6)
    for t in (1, 2):  # the per-loop-step losses, one tag per step
        assert scalars[f"train/step_losses/step{t}"] == pytest.approx(
            {r["iteration"]: r["step_losses"][t - 1] for r in train}, rel=1e-6)
    assert scalars["valid/loss"] == pytest.approx({r["iteration"]: r["loss"] for r in valid},
                                                  rel=1e-6)


def _main_without(rank, world, package, argv, out_dir):
    """run_main as on a machine without ``package``: None in sys.modules makes its import raise
    ModuleNotFoundError, as a missing package does. Modules already imported from it (in this
    forked rank, whatever the parent imported), and torch's wrapper around tensorboard, are
    dropped so that they are imported afresh and reach the missing package."""
    for name in list(sys.modules):
        if name.startswith((package + ".", "torch.utils.tensorboard")):
            del sys.modules[name]
    sys.modules[package] = None
    return run_main(rank, world, argv, out_dir)


@pytest.mark.parametrize("flag,value,package", [
    ("--wandb-project", "looplm", "wandb"),
    ("--tensorboard-dir", "tb", "tensorboard"),
])
def test_a_missing_backend_is_refused_in_one_line(tmp_path, flag, value, package):
    log = tmp_path / "run.jsonl"
    argv = [*TINY, flag, str(tmp_path / value) if package == "tensorboard" else value,
            "--log-jsonl", str(log)]
    assert run_distributed(_main_without, 1, package, argv, str(tmp_path), timeout=300) == [2]
    out, err = console_of(tmp_path, 1)
    assert err.count("\n") == 1 and err.startswith(f"error: {flag} needs the {package} package"), \
        err
    assert err.rstrip().endswith(f"pip install {package}"), err
    assert " iteration " not in out and not log.exists(), out  # refused before training


class _RecordingRun:
    """What wandb.init returns, reduced to what megaloop calls: log and finish."""

    def __init__(self, calls):
        self.calls = calls

    def log(self, scalars, step=None):
        self.calls.append(("log", dict(scalars), step))

    def finish(self):
        self.calls.append(("finish",))


def _main_with_recording_wandb(rank, world, argv, out_dir):
    """run_main with a stand-in ``wandb`` module that records every call; returns (exit code,
    the calls)."""
    calls = []
    fake = types.ModuleType("wandb")

    def init(**kwargs):
        calls.append(("init", {k: v for k, v in kwargs.items() if k != "config"},
                      sorted(kwargs.get("config") or {})))
        return _RecordingRun(calls)

    fake.init = init
    sys.modules["wandb"] = fake
    return run_main(rank, world, argv, out_dir), calls


def test_wandb_project_logs_every_record(tmp_path):
    """--wandb-project: one run named by the flags, the run config with it, the same scalars as
    the JSONL records at their iterations, and finish() at the end. (A real wandb 0.31 in
    offline mode was run with the same flags by hand: it trains and writes its run folder.)"""
    log = tmp_path / "run.jsonl"
    argv = [*TINY, "--wandb-project", "looplm", "--wandb-exp-name", "tiny",
            "--wandb-save-dir", str(tmp_path / "wandb"), "--log-jsonl", str(log)]
    [(code, calls)] = run_distributed(_main_with_recording_wandb, 1, argv, str(tmp_path),
                                      timeout=300)
    assert code == 0, console_of(tmp_path, 1)
    init, *logged, finish = calls
    assert init[0] == "init" and finish == ("finish",), calls
    assert init[1] == {"project": "looplm", "name": "tiny", "dir": str(tmp_path / "wandb")}
    assert "model" in init[2] and "loop" in init[2], init[2]  # the run config's sections
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [step for _, _, step in logged] == [r["iteration"] for r in records]
    for (_, scalars, _), r in zip(logged, records):
        split = r["split"]
        assert scalars[f"{split}/loss"] == r["loss"]
        assert [scalars[f"{split}/step_losses/step{t}"] for t in (1, 2)] == r["step_losses"]
