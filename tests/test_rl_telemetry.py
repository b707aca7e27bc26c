"""megaloop.rl.telemetry: a step's record against hand computations on a tiny rollout batch, and
the record written by the trainer's MetricsLogger reads back through the plot tool's reader."""

import math

import pytest
import torch

from megaloop.rl.telemetry import format_line, step_record

# 3 groups of 2 completions: group 2 all solved, group 3 all failed (both carry no signal).
REWARDS = [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
MASK = [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]


def _tensor(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_step_record_by_hand():
    g = torch.Generator().manual_seed(0)
    step_logp = -torch.rand(3, 6, 4, generator=g, dtype=torch.float64)
    logp, ref = step_logp[-1], -torch.rand(6, 4, generator=g, dtype=torch.float64)
    r = step_record(7, _tensor(REWARDS), _tensor(MASK), step_logp, logp, ref,
                    grad_norm=torch.tensor(0.5), lr=1e-5)
    tokens = [(b, s) for b in range(6) for s in range(4) if MASK[b][s]]
    assert r["iteration"] == 7 and r["split"] == "train"
    assert r["reward_mean"] == pytest.approx(3 / 6)
    assert r["solve_rate"] == pytest.approx(3 / 6)
    assert r["uniform_reward_groups"] == pytest.approx(2 / 3)
    assert r["response_length"] == pytest.approx((2 + 4 + 1 + 3 + 2 + 4) / 6)
    for t in range(3):
        want = sum(step_logp[t, b, s].item() for b, s in tokens) / len(tokens)
        assert r["step_log_probs"][t] == pytest.approx(want, abs=1e-12)
    kl = sum(math.exp(ref[b, s].item() - logp[b, s].item()) - (ref[b, s].item() - logp[b, s].item())
             - 1 for b, s in tokens) / len(tokens)
    assert r["kl"] == pytest.approx(kl, abs=1e-12) and r["kl"] > 0
    assert r["grad_norm"] == 0.5 and r["lr"] == 1e-5
    assert "solve rate 0.500" in format_line(r) and "uniform groups 0.667" in format_line(r)
    # A partial reward below the threshold is not a solve.
    partial = step_record(1, _tensor([[0.5, 1.0]]), _tensor(MASK[:2]), step_logp[:, :2])
    assert partial["solve_rate"] == 0.5 and partial["uniform_reward_groups"] == 0.0
    assert "kl" not in partial


def test_records_go_through_the_trainer_logger_to_the_plot_reader(tmp_path):
    from megaloop.eval.run_plot import read_run
    from megaloop.training.config import LoggingConfig
    from megaloop.training.metrics import MetricsLogger

    path = tmp_path / "rl.jsonl"
    logger = MetricsLogger(LoggingConfig(log_jsonl=str(path)), {}, is_writer=True)
    step_logp = torch.full((2, 2, 3), -0.5, dtype=torch.float64)
    records = [step_record(i, _tensor([[1.0, 0.0]]), _tensor(MASK[:2])[:, :3], step_logp,
                           step_logp[-1], step_logp[-1] - 0.1 * i, grad_norm=0.1 * i)
               for i in (1, 2)]
    for r in records:
        logger.log(r, format_line(r))
    logger.close()
    back = read_run(str(path))
    assert back == records
