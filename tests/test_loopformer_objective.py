"""--loopformer-objective: LoopFormer's training objective (megaloop/model/shortcut_objective.py).

- the shorter routes follow LoopFormer's sampler: for T = 3 its three routes come with
  probabilities 1/2, 1/4, 1/4 (derived by hand below); for T = 8 every route sums to 1 in
  multiples of 1/8, has 1..7 steps, and the step count is uniform;
- the per-token objective of a tiny LoopFormer, given a route of unequal steps, equals
  CE(full) + 0.1 CE(short) + 0.1 MSE(sg(y_full), y_short) computed with the independent
  reference of tests/loopformer_reference.py, at TP=1 and TP=2;
- its gradient equals the reference objective's (autograd through the reference fed the
  model's own parameters), and without the stop-gradient it would not (the seeded bug);
- the trainer draws the routes from (seed, iteration, micro-batch) and refuses the flag where
  it cannot apply.
"""

import collections
import math

import pytest
import torch

import loopformer_reference as ref
from distributed import run_distributed, setup_parallel
from reference import full_params, lm_batch
from test_loopformer import (EPS, FREQ, HEADS, HIDDEN, LAYERS, SEQ, TOL, VOCAB, _model,
                             _reference_weights)

ROUTE = (0.5, 0.25, 0.25)  # a shorter route of unequal steps (T = 4: multiples of 1/4)
CFG = {"hidden": HIDDEN, "heads": HEADS, "layers": LAYERS, "eps": EPS, "freq": FREQ}


def test_routes_of_three_follow_loopformer_s_sampler():
    """T = 3: one step (L = 1, probability 1/2), or two (L = 2, 1/2) whose first is 1/3 or 2/3
    (each allowed: it leaves at least 1/3 for the last), the last filling to 1: (1/3, 2/3) and
    (2/3, 1/3) at 1/4 each. 4000 draws: each count within 5 binomial sigmas."""
    from megaloop.model.shortcut_objective import draw_route, route_generator

    n = 4000
    counts = collections.Counter(draw_route(3, route_generator(1, i, 0)) for i in range(n))
    want = {(1.0,): 0.5, (1 / 3, 2 / 3): 0.25, (2 / 3, 1 / 3): 0.25}
    assert set(counts) == set(want), counts
    for route, p in want.items():
        assert abs(counts[route] - n * p) < 5 * math.sqrt(n * p * (1 - p)), counts


def test_routes_of_eight_are_shorter_and_sum_to_one():
    from megaloop.model.shortcut_objective import draw_route, route_generator

    n = 3000
    lengths = collections.Counter()
    for i in range(n):
        route = draw_route(8, route_generator(7, i, 1))
        units = [r * 8 for r in route]
        assert all(u == round(u) and u >= 1 for u in units), route
        assert sum(round(u) for u in units) == 8 and 1 <= len(route) <= 7, route
        lengths[len(route)] += 1
    p = 1 / 7
    for L in range(1, 8):
        assert abs(lengths[L] - n * p) < 5 * math.sqrt(n * p * (1 - p)), lengths
    # the same (seed, iteration, micro-batch) gives the same route; another micro-batch may not
    assert draw_route(8, route_generator(7, 3, 1)) == draw_route(8, route_generator(7, 3, 1))
    assert len({draw_route(8, route_generator(7, 3, m)) for m in range(20)}) > 1


def _reference_objective(w, ids, labels, detach=True):
    """[b, s]: CE(4 x 1/4) + 0.1 CE(ROUTE) + 0.1 mean_d (sg(y_full) - y_short)^2."""
    return ref.objective(w, CFG, ids, labels, [0.25] * 4, ROUTE, stop=detach)


def _objective(rank, world):
    setup_parallel(world)
    model = _model()
    ids, pos, labels = lm_batch(VOCAB, SEQ, 2)
    got = model(ids, pos, None, labels=labels, short_route=ROUTE).objective
    with torch.no_grad():
        want = _reference_objective(_reference_weights(full_params(model)), ids, labels)
        plain = model(ids, pos, None, labels=labels).objective
    return got.detach(), want, plain


@pytest.mark.parametrize("world", [1, 2])
def test_the_objective_is_loopformer_s(world):
    for got, want, plain in run_distributed(_objective, world):
        assert (got - want).abs().max() < TOL, (got - want).abs().max()
        assert (got - plain).abs().max() > 100 * TOL  # the extra terms do something


def _gradients(rank, world):
    """The model's gradient of the summed objective, and the reference's, the reference fed
    the model's own parameters (TP=1: the names are whole), with and without the stop."""
    setup_parallel(world)
    model = _model()
    ids, pos, labels = lm_batch(VOCAB, SEQ, 2)
    model(ids, pos, None, labels=labels, short_route=ROUTE).objective.sum().backward()
    params = dict(model.named_parameters())
    got = {n: p.grad.clone() for n, p in params.items()}
    out = {}
    for detach in (True, False):
        grads = torch.autograd.grad(
            _reference_objective(_reference_weights(params), ids, labels, detach).sum(),
            list(params.values()), allow_unused=True)
        out[detach] = max((g - (r if r is not None else torch.zeros_like(g))).abs().max().item()
                          for g, r in zip(got.values(), grads))
    return out, max(g.abs().max().item() for g in got.values())


def test_the_gradient_stops_at_the_full_route_s_state():
    diffs, scale = run_distributed(_gradients, 1)[0]
    assert scale > 1e-2
    assert diffs[True] < TOL, diffs
    assert diffs[False] > 100 * TOL, diffs  # the seeded bug: no stop-gradient


@pytest.mark.parametrize("extra,named", [
    (["--exit-loss", "expected"], "--exit-loss last"),
    (["--random-depth-mean", "4"], "--random-depth-mean"),
    (["--timestep-conditioning", "adaln"], "--timestep-conditioning loopformer"),
])
def test_refusals_name_the_flag(extra, named):
    from megaloop.model.config import LoopConfig

    kw = {"num_loops": 4, "loopformer_objective": True, "timestep_conditioning": "loopformer",
          "exit_loss": "last", "step_norm_placement": "readout"}
    kw.update({"--exit-loss": {"exit_loss": "expected"},
               "--random-depth-mean": {"random_depth_mean": 4.0},
               "--timestep-conditioning": {"timestep_conditioning": "adaln"}}[extra[0]])
    with pytest.raises(ValueError, match=named):
        LoopConfig(**kw).validate(3)


LOOPFORMER_RUN = ["--timestep-conditioning", "loopformer", "--loopformer-objective",
                  "--exit-loss", "last", "--step-norm", "rms", "--step-norm-placement", "readout",
                  "--norm-scheme", "magic", "--num-loops", "4", "--timestep-frequency-dim", "16",
                  "--global-batch-size", "4", "--micro-batch-size", "2"]


def _routes_the_trainer_passes(rank, world):
    from run_helpers import build_trainer
    from test_training import BASE

    from megaloop.training import trainer as trainer_module

    seen = []
    plain = trainer_module.forward_step

    def recording(data_iterator, model, num_loops, no_grad_steps=0, routes=None):
        def tee():
            for route in routes:
                seen.append((num_loops, route))
                yield route
        return plain(data_iterator, model, num_loops, no_grad_steps,
                     None if routes is None else tee())

    trainer_module.forward_step = recording
    trainer = build_trainer(BASE + LOOPFORMER_RUN)
    for _ in range(2):
        trainer.train_step()
        trainer.iteration += 1
    trainer.evaluate()  # the full route only
    return seen, trainer.cfg.training.seed


def test_the_trainer_draws_each_micro_batch_s_route_from_seed_iteration_and_index():
    from megaloop.model.shortcut_objective import draw_route, route_generator

    seen, seed = run_distributed(_routes_the_trainer_passes, 1)[0]
    want = [(4, draw_route(4, route_generator(seed, it, m))) for it in (1, 2) for m in (0, 1)]
    assert seen == want
