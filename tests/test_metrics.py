"""The training and validation log lines and records (megaloop/training/metrics.py): what they
leave out when there is nothing to say, how an unscored loop step reads, and the elapsed time and
ETA, against a fake clock and through a real tiny run."""

import contextlib
import io
import json
import math

from distributed import run_distributed
from test_training import BASE


def _train_record(**over):
    record = {"iteration": 10, "train_iters": 100, "consumed_samples": 40, "ms_per_iter": 12.0,
              "tokens_per_sec": 1e4, "tflops_per_gpu": 0.1, "lr": 1e-3, "loss": 3.2,
              "step_losses": [3.4, 3.3, 3.2], "exit_probs": [0.2, 0.3, 0.5], "p0": 0.2,
              "grad_norm": 0.5, "skipped_iters": 0, "mem_gib": 1.0, "loss_spikes": 0,
              "p0_collapse_iters": 0}
    record.update(over)
    return record


def test_p0_high_count_shows_only_while_an_episode_builds_up():
    from megaloop.training.metrics import format_train_line

    assert "p0 high" not in format_train_line(_train_record(p0_collapse_iters=0))
    assert "p0 high" not in format_train_line(_train_record(p0_collapse_iters=None))  # no gate
    assert " | p0 high for 7 it" in format_train_line(_train_record(p0_collapse_iters=7))


def test_unscored_steps_print_as_dash_and_stay_null_in_the_jsonl(tmp_path):
    """SpiralFormer's --exit-loss last scores only the final step; the others are NaN."""
    from megaloop.training.config import LoggingConfig
    from megaloop.training.metrics import MetricsLogger, format_train_line, format_valid_line

    nan = float("nan")
    valid = {"iteration": 100, "split": "valid", "loss": 3.84, "step_losses": [nan, nan, 3.84],
             "exit_probs": None}
    line = format_valid_line(valid)
    assert "step losses [- - 3.8400]" in line and "nan" not in line, line
    assert "step losses [- - 3.2000]" in format_train_line(_train_record(step_losses=[nan, nan,
                                                                                      3.2]))
    path = tmp_path / "run.jsonl"
    logger = MetricsLogger(LoggingConfig(log_jsonl=str(path)), {}, is_writer=True)
    logger.log(valid)
    logger.close()
    assert json.loads(path.read_text())["step_losses"] == [None, None, 3.84]


class _FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_elapsed_and_eta_from_the_iterations_after_the_first():
    from megaloop.training.metrics import RunClock, format_duration

    clock = _FakeClock()
    run = RunClock(train_iters=50, clock=clock)
    # A resumed run: this process starts at iteration 20. Its first step is slow (compilation).
    durations = {21: 30.0, 22: 2.0, 23: 3.0, 24: 1.0, 25: 4.0}
    assert run.eta_s() is None
    for it, dt in durations.items():
        clock.now += dt
        run.step_done(it)
        if it == 21:
            assert run.eta_s() is None  # one iteration says nothing about the steady pace
    clock.now += 0.5  # logging after the step
    later = [durations[i] for i in range(22, 26)]
    assert run.elapsed_s() == sum(durations.values()) + 0.5
    assert math.isclose(run.eta_s(), sum(later) / len(later) * (50 - 25))
    assert format_duration(run.elapsed_s()) == "0:00:40"
    assert format_duration(run.eta_s()) == "0:01:02"  # 2.5 s x 25
    assert format_duration(3 * 3600 + 62.4) == "3:01:02" and format_duration(None) == "-"
    line_record = _train_record(elapsed_s=run.elapsed_s(), eta_s=run.eta_s())
    from megaloop.training.metrics import format_train_line

    assert " iteration     10/   100 | elapsed 0:00:40 | eta 0:01:02 | consumed" in \
        format_train_line(line_record)


def _logged_run(rank, world, path, extra):
    from run_helpers import build_trainer

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        build_trainer(BASE + ["--train-iters", "4", "--log-jsonl", path] + extra).train()
    return out.getvalue()


def test_a_run_logs_elapsed_and_eta_and_dashes_for_unscored_steps(tmp_path):
    path = str(tmp_path / "run.jsonl")
    text = run_distributed(_logged_run, 1, path, [
        "--exit-loss", "last", "--eval-iters", "1", "--eval-interval", "2"])[0]
    records = [json.loads(line) for line in open(path)]
    train = [r for r in records if r["split"] == "train"]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4]
    # Elapsed grows; no ETA after this process's first iteration; none left at the end.
    assert all(a["elapsed_s"] < b["elapsed_s"] for a, b in zip(train, train[1:]))
    assert train[0]["eta_s"] is None and train[-1]["eta_s"] == 0
    # The ETA is the mean time of this process's iterations after the first, times those left:
    # derived here from the logged per-iteration times (--log-interval 1: ms_per_iter is one
    # iteration, the validation after it included). The clock also counts the logging between
    # two iterations, which ms_per_iter leaves out: under 20 ms per iteration.
    for k, r in enumerate(train[1:], start=2):
        mean = sum(t["ms_per_iter"] for t in train[1:k]) / (k - 1) / 1000
        assert abs(r["eta_s"] - mean * (4 - k)) <= 0.02 * (4 - k), (k, r["eta_s"], mean)
    lines = [line for line in text.splitlines() if line.startswith(" iteration")]
    assert len(lines) == 4 and all(" | elapsed 0:00:" in line for line in lines)
    assert "| eta - |" in lines[0] and "| eta 0:00:00 |" in lines[-1], lines
    assert not any("p0 high" in line for line in lines)  # no exit gate in `last` mode
    valid = [line for line in text.splitlines() if line.startswith(" validation")]
    assert valid and all("step losses [- - " in line and "nan" not in line for line in valid)
    assert all(r["step_losses"][:2] == [None, None] for r in records if r["split"] == "valid")
