"""Huginn random depth (--random-depth-mean / --random-depth-sigma) and truncated backpropagation
(--truncated-backprop-steps): the draw follows the Poisson-lognormal, is the same on every rank,
truncated steps carry no gradient, TP=2 == TP=1."""

import json
import math

import pytest
import torch

from distributed import run_distributed
from reference import full_grads
from test_training import BASE, _compare, _one_step, one_rank_step

RANDOM = ["--random-depth-mean", "2", "--truncated-backprop-steps", "1",
          "--micro-batch-size", "2"]


def test_draw_distribution_matches_poisson_lognormal():
    from megaloop.training.random_depth import draw_depth

    mean, sigma, n = 4.0, 0.5, 4000
    draws = torch.tensor([draw_depth(mean, sigma, 7, i) for i in range(1, n + 1)],
                         dtype=torch.float64)
    # r = 1 + Poisson(lambda), lambda = e^tau, tau ~ N(mu, sigma^2) with mu = log(mean) - sigma^2/2:
    # E[r] = 1 + E[e^tau] = 1 + e^(mu + sigma^2/2); Var[r] = E[lambda] + Var[lambda] (a Poisson
    # mixture) with Var[lambda] = (e^(sigma^2) - 1) e^(2 mu + sigma^2).
    mu = math.log(mean) - sigma ** 2 / 2
    expected = 1 + math.exp(mu + sigma ** 2 / 2)
    variance = math.exp(mu + sigma ** 2 / 2) + (math.exp(sigma ** 2) - 1) * math.exp(2 * mu + sigma ** 2)
    stderr = math.sqrt(variance / n)
    assert abs(draws.mean().item() - expected) < 4 * stderr
    assert abs(draws.var().item() - variance) < 0.15 * variance
    assert draws.min().item() >= 1
    # A function of (seed, iteration) only, and it leaves the global RNG alone.
    state = torch.get_rng_state()
    assert draw_depth(mean, sigma, 7, 11) == draws[10].item()
    assert torch.equal(state, torch.get_rng_state())
    assert [draw_depth(mean, sigma, 8, i) for i in range(1, 50)] != draws[:49].tolist()
    assert max(draw_depth(mean, sigma, 7, i, max_depth=3) for i in range(1, 200)) == 3


def _depths(rank, world, extra, jsonl):
    from megaloop.parallel.initialize import initialize
    from megaloop.training.random_depth import draw_depth
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer

    cfg = parse_args(BASE + RANDOM + ["--train-iters", "4", "--log-jsonl", jsonl] + extra)
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    trainer = Trainer(cfg)
    trainer.train()
    return ([trainer.depth(i) for i in range(1, 30)],
            [draw_depth(2.0, 0.5, cfg.training.seed, i) for i in range(1, 30)])


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"], []],
                         ids=["tp2", "dp2"])
def test_every_rank_draws_the_same_depth(layout, tmp_path):
    jsonl = str(tmp_path / "log.jsonl")
    results = run_distributed(_depths, 2, layout, jsonl)
    assert results[0] == results[1]
    assert results[0][0] == results[0][1]
    records = [json.loads(line) for line in open(jsonl)]
    train = [r for r in records if r["split"] == "train"]
    assert [r["depth"] for r in train] == results[0][0][:4]
    assert all(len(r["step_losses"]) == r["depth"] for r in train)
    assert len(set(r["depth"] for r in train)) > 1  # the draws do vary (seed 1234)


def _truncated_grads(rank, world, n):
    from megaloop.model.looped_gpt import build_model
    from megaloop.parallel.initialize import initialize
    from megaloop.training.run_config import parse_args

    cfg = parse_args(BASE + ["--exit-loss", "last", "--input-injection", "channel-wise"])
    initialize(cfg.parallel, cfg.training.seed)
    model = build_model(cfg.model, cfg.loop, 200)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 200, (2, 32), generator=g)
    labels = torch.randint(0, 200, (2, 32), generator=g)
    pos = torch.arange(32).unsqueeze(0).expand(2, -1)
    mask = torch.ones(1, 1, 32, 32, dtype=torch.bool).triu(1)

    def grads(**kw):
        model.zero_grad()
        out = model(tokens, pos, mask, labels=labels, num_loops=4, **kw)
        out.objective.sum().backward()
        return {k: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                for k, p in model.named_parameters()}

    truncated = grads(no_grad_steps=n)
    # Reference, by another route: full backprop, but the state leaving step n is detached (a
    # hook on the step norm, whose output is the next step's input), so nothing before it can
    # receive gradient.
    calls = []

    def detach_nth(module, args, output):
        calls.append(1)
        return output.detach() if len(calls) == n else output

    handle = model.step_norm.register_forward_hook(detach_nth)
    reference = grads()
    handle.remove()
    full = grads()
    return truncated, reference, full


def test_truncated_steps_carry_no_gradient():
    truncated, reference, full = run_distributed(_truncated_grads, 1, 2)[0]
    for k in truncated:
        assert torch.allclose(truncated[k], reference[k], atol=1e-7, rtol=1e-5), k
    core = [k for k in truncated if k.startswith("core.")]
    assert core and all(truncated[k].abs().sum() > 0 for k in core)
    # The truncation changes the gradient (it is not a no-op) ...
    assert any(not torch.allclose(truncated[k], full[k]) for k in core)
    # ... and the embedding is reached only through the injection of the steps with gradient.
    emb = [k for k in truncated if k.startswith("embedding.")]
    assert emb and all(truncated[k].abs().sum() > 0 for k in emb)


def test_random_depth_tp2_equals_tp1():
    ref = one_rank_step(tuple(RANDOM))  # also tests/test_pipeline.py's reference
    assert ref[0]["depth"] > 1  # seed 1234 draws T = 4 at iteration 1
    for result in run_distributed(_one_step, 2, RANDOM + ["--tensor-model-parallel-size", "2"]):
        assert result[0]["depth"] == ref[0]["depth"]
        _compare(ref, result)


def test_random_depth_flag_errors():
    from megaloop.training.run_config import parse_args

    # Under PP a drawn T > 1 runs the interleaved schedule: micro-batches in groups of P.
    # (--num-loops 1: the pipeline's own check, made for the trained T, would not see it.)
    with pytest.raises(ValueError, match="drawn T > 1 .* multiple of 2"):
        parse_args(BASE + RANDOM + ["--pipeline-model-parallel-size", "2", "--global-batch-size",
                                    "6", "--num-loops", "1", "--exit-loss", "last"]
                   ).validate(world_size=2)
    parse_args(BASE + RANDOM + ["--pipeline-model-parallel-size", "2"]).validate(world_size=2)
    with pytest.raises(ValueError, match="--log-grad-norm-per-step"):
        parse_args(BASE + RANDOM + ["--log-grad-norm-per-step"]).validate(world_size=1)
    with pytest.raises(ValueError, match="--exit-loss last"):
        parse_args(BASE + RANDOM + ["--num-loops", "1"]).validate(world_size=1)
    parse_args(BASE + RANDOM + ["--num-loops", "1", "--exit-loss", "last"]).validate(world_size=1)
