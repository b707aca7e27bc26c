"""Ouro stage II (--exit-loss adaptive-gate): the BCE objective against a hand computation; in
the trainer the LM stays frozen while the gate learns; TP=2 == TP=1."""

import math

import pytest
import torch

from distributed import run_distributed
from reference import full_params
from test_training import BASE, _compare, _one_step

STAGE2 = ["--exit-loss", "adaptive-gate"]


def test_adaptive_gate_objective_matches_hand_computation():
    from megaloop.model.objective import ExitObjective

    T, N = 4, 7
    g = torch.Generator().manual_seed(3)
    losses = torch.rand(T, N, generator=g) * 3
    logits = torch.randn(T, N, generator=g, requires_grad=True)
    obj = ExitObjective(T, "adaptive-gate")
    for t in range(T):
        obj.add_step(losses[t], logits[t])
    got = obj.per_token()
    for n in range(N):
        total = 0.0
        for t in range(1, T):
            improvement = max(0.0, float(losses[t - 1, n] - losses[t, n]))
            w = 1 / (1 + math.exp(-50 * (improvement - 0.005)))
            lam = 1 / (1 + math.exp(-float(logits[t, n])))
            total += -(w * math.log(1 - lam) + (1 - w) * math.log(lam))
        assert abs(got[n].item() - total / (T - 1)) < 1e-5
    got.sum().backward()
    assert logits.grad[0].abs().max() == 0 and logits.grad[1:].abs().min() > 0
    probs = torch.stack(obj.exit_probs)
    assert torch.allclose(probs.sum(0), torch.ones(N), atol=1e-6)


def _frozen_lm(rank, world):
    from megaloop.parallel.initialize import initialize
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer

    cfg = parse_args(BASE + STAGE2 + ["--micro-batch-size", "2"])
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    trainer = Trainer(cfg)
    before = full_params(trainer.model)
    for _ in range(2):
        stats, _, ok = trainer.train_step()
        assert ok and math.isfinite(stats["loss"])
    after = full_params(trainer.model)
    return {k: torch.equal(before[k], after[k]) for k in before}


def test_adaptive_gate_trains_only_the_gate():
    unchanged = run_distributed(_frozen_lm, 1)[0]
    gate = [k for k in unchanged if k.startswith("exit_gate")]
    assert gate and not any(unchanged[k] for k in gate)
    assert all(v for k, v in unchanged.items() if k not in gate)


def test_adaptive_gate_tp2_equals_tp1():
    # The gate's gradient has entries near 0 (grads agree to 2e-7): a larger Adam eps keeps
    # the first update proportional to the gradient instead of ~sign(g) (see BASE).
    flags = STAGE2 + ["--micro-batch-size", "2", "--adam-eps", "1e-2"]
    ref = run_distributed(_one_step, 1, flags)[0]
    for result in run_distributed(_one_step, 2, flags + ["--tensor-model-parallel-size", "2"]):
        _compare(ref, result)


def test_adaptive_gate_flag_errors():
    from megaloop.training.run_config import parse_args

    with pytest.raises(ValueError, match="--num-loops"):
        parse_args(BASE + STAGE2 + ["--num-loops", "1"]).validate(world_size=1)



def test_adaptive_gate_pp2_equals_pp1():
    """Stage II under PP: the previous step's loss travels with the carry; the first stage has
    nothing to train (the LM is frozen) and still runs the schedule's backward."""
    flags = STAGE2 + ["--micro-batch-size", "2", "--adam-eps", "1e-2"]
    ref = run_distributed(_one_step, 1, flags)[0]
    for result in run_distributed(_one_step, 2, flags + ["--pipeline-model-parallel-size", "2"]):
        _compare(ref, result)
