"""Trainer equivalences: TP=2 and DP=2 against one rank, for the same weights and global batch."""

import functools

import pytest
import torch

from distributed import run_distributed
from reference import full_grads, full_params
from run_helpers import build_trainer
from flags import TEST_FLAGS

BASE = [*TEST_FLAGS,
        "--num-layers", "2", "--num-loops", "3", "--hidden-size", "32", "--num-attention-heads",
        "4", "--seq-length", "32", "--max-position-embeddings", "32", "--global-batch-size", "4",
        "--train-iters", "2", "--lr", "1e-2", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "200", "--log-interval", "1", "--eval-iters", "0",
        # Adam's first step is lr * sign(g) for |g| >> eps: gradients equal to 1e-7 may still
        # differ in sign where they are ~0, so a larger eps keeps the update proportional to g.
        "--adam-eps", "1e-4"]


def _one_step(rank, world, extra):
    trainer = build_trainer(BASE + extra)
    stats, grad_norm, ok = trainer.train_step()
    assert ok
    grads = full_grads(trainer.model)
    params = full_params(trainer.model)
    second, _, _ = trainer.train_step()  # the updated weights on the next batch
    return stats, float(grad_norm), grads, params, second["loss"]


# BASE's --lr and --adam-eps, and megaloop's default --clip-grad (Megatron-LM's).
LR, ADAM_EPS, CLIP_GRAD = 1e-2, 1e-4, 1.0
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-4


def _adam_first_step(grad, grad_norm):
    """Adam's first update of a weight, in units of the LR: the gradient clipped to --clip-grad,
    then m_hat / (sqrt(v_hat) + eps) = g / (|g| + eps) (both moments bias-corrected). Weight decay
    scales the weight alike on both sides and cancels from a comparison."""
    g = grad * min(1.0, CLIP_GRAD / grad_norm)
    return g / (g.abs() + ADAM_EPS)


def _update_slack(g1, gn1, g2, gn2):
    """How far two layouts' weights may be apart after one Adam step because their gradients
    are (see _adam_first_step: g / (|g| + eps) has slope eps / (|g| + eps)^2, up to 1 / eps near
    g = 0, so gradients equal to rounding can move a weight by up to LR x their difference / eps).
    With both gradients, the update difference itself; with one (the distributed optimizer keeps
    only its shard), the slope times the gradient tolerance. Rounding differs between CPUs
    (vector kernels, summation order), so a fixed tolerance on the weights holds on one CPU only."""
    if g2 is not None:
        return LR * (_adam_first_step(g1, gn1) - _adam_first_step(g2, gn2)).abs()
    clipped = g1 * min(1.0, CLIP_GRAD / gn1)
    slope = ADAM_EPS / (clipped.abs() + ADAM_EPS) ** 2
    return LR * slope * (GRAD_ATOL + GRAD_RTOL * g1.abs())


ADAM_BETA1, ADAM_BETA2 = 0.9, 0.999  # megaloop's (Megatron-LM's) defaults, which BASE keeps


def second_step_slack(grad):
    """How far two layouts' weights may be apart after Adam's *second* step from one restored
    checkpoint (the same moments m1 = (1 - b1) g1, v1 = (1 - b2) g1^2 of a first step on both sides)
    because their second gradients ``grad`` differ by rounding (GRAD_ATOL, GRAD_RTOL).

    The update is u(g) = m_hat / (s + eps), with m_hat = (b1 g1 + g) / (1 + b1) and
    s = sqrt((b2 g1^2 + g^2) / (1 + b2)) after bias correction. Its slope is
    1 / ((1 + b1)(s + eps)) - m_hat g / ((1 + b2) s (s + eps)^2); Cauchy-Schwarz gives
    |m_hat| <= sqrt(b1^2 / b2 + 1) sqrt(1 + b2) / (1 + b1) s and |g| <= sqrt(1 + b2) s, so the
    slope is at most C / (s + eps) with C below, and s >= |g| / sqrt(1 + b2) whatever g1 was.
    Along the way from one gradient to the other |g| stays above |grad| - tolerance."""
    b1, b2 = ADAM_BETA1, ADAM_BETA2
    m_over_s = (b1 * b1 / b2 + 1) ** 0.5 * (1 + b2) ** 0.5 / (1 + b1)
    c = 1 / (1 + b1) + m_over_s * (1 + b2) ** 0.5 / (1 + b2)
    tol = GRAD_ATOL + GRAD_RTOL * grad.abs()
    s_min = (grad.abs() - tol).clamp(min=0) / (1 + b2) ** 0.5
    return LR * c / (s_min + ADAM_EPS) * tol


def assert_after_second_step_close(p1: dict, p2: dict, grads: dict):
    """The weights two layouts reach with Adam's second step from one checkpoint, as close as the
    rounding of their gradients (one side's, ``grads``) lets them be (second_step_slack), plus
    rounding of the update itself."""
    assert p1.keys() == p2.keys()
    for k in p1:
        gap = (p1[k] - p2[k]).abs()
        bound = 1e-6 + 1e-4 * p1[k].abs() + 1.01 * second_step_slack(grads[k])
        assert (gap <= bound).all(), (k, float((gap - bound).max()))


def _compare(ref, other, tol=2e-5):
    stats1, gn1, g1, p1, next1 = ref
    stats2, gn2, g2, p2, next2 = other
    assert abs(stats1["loss"] - stats2["loss"]) < tol
    for key in ("step_losses", "exit_probs"):  # strict: a missing step fails, not passes
        for a, b in zip(stats1[key], stats2[key], strict=True):
            assert abs(a - b) < tol, key
    assert abs(gn1 - gn2) < 1e-4 * max(1.0, gn1)
    if g1 is not None and g2 is not None:
        assert g1.keys() == g2.keys()
        for k in g1:
            assert torch.allclose(g1[k], g2[k], atol=GRAD_ATOL, rtol=GRAD_RTOL), k
    assert p1.keys() == p2.keys()
    for k in p1:
        # The weights after the step: as close as their gradients make them (the update's own
        # difference), plus rounding of the update itself.
        slack = 0.0
        if g1 is not None and k in g1:
            slack = _update_slack(g1[k], gn1, None if g2 is None else g2[k], gn2)
        gap = (p1[k] - p2[k]).abs()
        bound = 1e-6 + 1e-4 * p1[k].abs() + 1.01 * slack
        assert (gap <= bound).all(), (k, float((gap - bound).max()))
    assert abs(next1 - next2) < tol


@functools.lru_cache(maxsize=None)
def one_rank_step(extra: tuple):
    """``_one_step`` on one rank, run once per session for each ``extra``: the reference of the
    layouts compared with it here and in tests/test_pipeline.py (callers only read it)."""
    return run_distributed(_one_step, 1, list(extra))[0]


@pytest.fixture(scope="module")
def single_rank():
    return one_rank_step(("--micro-batch-size", "2"))


def test_tp2_equals_tp1_after_optimizer_step(single_rank):
    for result in run_distributed(_one_step, 2, ["--micro-batch-size", "2",
                                                 "--tensor-model-parallel-size", "2"]):
        _compare(single_rank, result)


def test_dp2_equals_dp1_after_optimizer_step(single_rank):
    for result in run_distributed(_one_step, 2, ["--micro-batch-size", "1"]):
        _compare(single_rank, result)


def test_dp2_distributed_optimizer_equals_dp1(single_rank):
    results = run_distributed(_one_step, 2, ["--micro-batch-size", "1",
                                             "--use-distributed-optimizer"])
    for stats, gn, _grads, params, nxt in results:
        # The distributed optimizer keeps only its shard of gradients; compare the rest.
        _compare(single_rank, (stats, gn, None, params, nxt))


def _loss_mask_weighting(rank, world):
    """Masked tokens carry no weight: the logged loss is the per-token mean over kept tokens."""
    from megaloop.model.loss import LoopOutput, loss_func

    T, b, s = 2, 2, 3
    obj = torch.arange(b * s, dtype=torch.float32).view(b, s)
    step = torch.stack([obj + 1, obj + 2])
    probs = torch.full((T, b, s), 0.5)
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    total, tokens, report = loss_func(mask, T, LoopOutput(obj, step, probs))
    kept = [0.0, 2.0, 5.0]
    assert tokens.item() == 3 and total.item() == sum(kept)
    assert report["stats"]["step_losses"][0].item() == sum(k + 1 for k in kept)
    assert report["stats"]["step_losses"][1].item() == sum(k + 2 for k in kept)
    assert report["stats"]["exit_probs"].tolist() == [0.5 * len(kept)] * T
    return True


def test_loss_func_masks_tokens():
    run_distributed(_loss_mask_weighting, 1)


def test_compare_allows_what_adams_first_step_makes_of_gradient_rounding():
    """The case another CPU produced: one gradient element -9.09e-6 here, 1.4e-3 relative more
    there (well within the gradient tolerance) moves its weight by about 1.05e-6 more, past a fixed
    1e-6 tolerance on the weights. _compare derives the weights' bound from the update rule: it
    passes that case, and still fails weights that differ by more than their gradients explain."""
    g1 = {"w": torch.tensor([-9.09e-6, 3e-2, 0.0])}
    g2 = {"w": torch.tensor([-9.09e-6 * 1.0014, 3e-2, 0.0])}
    p0 = torch.tensor([-8.3e-4, -1e-2, 5e-3])  # the first weight ends near 0
    gn = 0.5  # under --clip-grad: no clipping

    def after(g):
        return {"w": p0 - LR * _adam_first_step(g["w"], gn)}

    stats = {"loss": 1.0, "step_losses": [1.0], "exit_probs": [1.0]}
    ref = (stats, gn, g1, after(g1), 1.0)
    _compare(ref, (stats, gn, g2, after(g2), 1.0))
    old_bound = 1e-6 + 1e-4 * after(g1)["w"].abs()  # a fixed tolerance on the weights
    assert ((after(g1)["w"] - after(g2)["w"]).abs() > old_bound).any()
    _compare(ref, (stats, gn, None, after(g2), 1.0))  # one side's gradients unknown
    wrong = {"w": after(g2)["w"] + torch.tensor([0.0, 5e-6, 0.0])}
    with pytest.raises(AssertionError):
        _compare(ref, (stats, gn, g2, wrong, 1.0))
    with pytest.raises(AssertionError):
        _compare(ref, (stats, gn, None, wrong, 1.0))


def test_second_step_bound_allows_gradient_rounding_and_catches_lost_moments():
    """torch's Adam (the update megatron-core's optimizer makes on CPU) takes a first step, then a
    second from the same state with two gradients that differ by the full gradient tolerance,
    with elements from 0 to 1e-1 (near 0 the update is most sensitive): the weights pass
    assert_after_second_step_close. A second step whose moments were lost (a fresh optimizer, as
    a checkpoint that did not restore them) fails it, as does one weight with a large gradient off
    by a thousandth of the LR."""
    gen = torch.Generator().manual_seed(0)
    scale = 10 ** (-6 * torch.rand(4096, generator=gen) - 1)  # magnitudes 1e-7 .. 1e-1
    g1 = torch.randn(4096, generator=gen) * scale
    g2 = torch.randn(4096, generator=gen) * scale
    g2[:8] = 0.0
    sign = torch.randint(0, 2, (4096,), generator=gen) * 2 - 1
    g2_other = g2 + sign * (GRAD_ATOL + GRAD_RTOL * g2.abs())
    p0 = torch.randn(4096, generator=gen) * 0.02

    def second_step(grad, restored=True):
        p = torch.nn.Parameter(p0.clone())
        opt = torch.optim.Adam([p], lr=LR, betas=(ADAM_BETA1, ADAM_BETA2), eps=ADAM_EPS)
        if restored:
            p.grad = g1.clone()
            opt.step()
            p.data.copy_(p0)  # both sides start the second step from one restored checkpoint
        p.grad = grad.clone()
        opt.step()
        return {"w": p.detach().clone()}

    ref = second_step(g2)
    assert_after_second_step_close(ref, second_step(g2_other), {"w": g2})
    with pytest.raises(AssertionError):
        assert_after_second_step_close(ref, second_step(g2, restored=False), {"w": g2})
    off = {"w": ref["w"] + LR * 1e-3 * (torch.arange(4096) == g2.abs().argmax())}
    with pytest.raises(AssertionError):
        assert_after_second_step_close(ref, off, {"w": g2})
