"""The exit objective against a plain hand computation on small tensors."""

import math

import pytest
import torch

from megaloop.model.objective import ExitObjective
from reference import kl_uniform, reference_objective


def _fold(losses, lambdas, mode, beta=0.0, eps=0.0):
    T = losses.shape[0]
    obj = ExitObjective(T, mode, beta, eps)
    for t in range(T):
        gate = torch.logit(lambdas[t]) if t < T - 1 else None
        obj.add_step(losses[t], gate)
    return obj


def _inputs(T=4, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(T, n, generator=g, dtype=torch.float64) * 5,
            torch.rand(T - 1, n, generator=g, dtype=torch.float64) * 0.9 + 0.05)


def test_hand_computed_single_token():
    # T=3, lambdas 0.5 and 0.25: p = (0.5, 0.5*0.25, 0.5*0.75) = (0.5, 0.125, 0.375).
    losses = torch.tensor([[2.0], [1.0], [0.5]], dtype=torch.float64)
    lambdas = torch.tensor([[0.5], [0.25]], dtype=torch.float64)
    p = [0.5, 0.125, 0.375]
    expected = sum(pi * li for pi, li in zip(p, [2.0, 1.0, 0.5], strict=True))
    obj = _fold(losses, lambdas, "expected", beta=0.15)
    assert obj.per_token().item() == pytest.approx(expected + 0.15 * kl_uniform(p), abs=1e-12)
    assert [x.item() for x in obj.exit_probs] == pytest.approx(p)
    eps = 0.05
    smooth = _fold(losses, lambdas, "smoothed", beta=0.15, eps=eps)
    want = (1 - eps) * expected + eps / 3 * 3.5 + 0.15 * kl_uniform(p)  # KL on unsmoothed p
    assert smooth.per_token().item() == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("mode", ["expected", "smoothed", "last"])
@pytest.mark.parametrize("T", [1, 2, 4])
def test_matches_reference(mode, T):
    losses, lambdas = _inputs(T)
    obj = _fold(losses, lambdas, mode, beta=0.3, eps=0.1)
    ref, p = reference_objective(losses, lambdas, mode, beta=0.3, eps=0.1)
    assert torch.allclose(obj.per_token(), ref, atol=1e-12)
    if mode != "last":
        probs = torch.stack(obj.exit_probs)
        assert torch.allclose(probs.sum(0), torch.ones(losses.shape[1], dtype=torch.float64))
        assert torch.allclose(probs, p, atol=1e-12)


def test_kl_is_zero_at_uniform_and_beta_scales_it():
    T = 4
    losses = torch.ones(T, 1, dtype=torch.float64)
    # Survival construction gives p uniform when lambda_t = 1 / (T - t + 1).
    lambdas = torch.tensor([[1 / 4], [1 / 3], [1 / 2]], dtype=torch.float64)
    obj = _fold(losses, lambdas, "expected", beta=10.0)
    assert obj.per_token().item() == pytest.approx(1.0, abs=1e-12)
    assert obj.kl().item() == pytest.approx(0.0, abs=1e-12)


def test_saturated_gate_stays_finite():
    losses = torch.ones(3, 2)
    gate_logits = torch.tensor([[80.0, -80.0], [80.0, -80.0]])
    obj = ExitObjective(3, "expected", 0.15)
    obj.add_step(losses[0], gate_logits[0])
    obj.add_step(losses[1], gate_logits[1])
    obj.add_step(losses[2], None)
    out = obj.per_token()
    assert torch.isfinite(out).all()
    assert out[0].item() == pytest.approx(1 + 0.15 * math.log(3), abs=1e-5)  # p = (1, 0, 0)


def test_gradients_match_reference():
    losses, lambdas = _inputs(3)
    losses.requires_grad_(True)
    logits = torch.logit(lambdas).clone().requires_grad_(True)
    obj = ExitObjective(3, "smoothed", 0.2, 0.05)
    for t in range(3):
        obj.add_step(losses[t], logits[t] if t < 2 else None)
    obj.per_token().sum().backward()
    l2 = losses.detach().clone().requires_grad_(True)
    g2 = torch.logit(lambdas).clone().requires_grad_(True)
    ref, _ = reference_objective(l2, torch.sigmoid(g2), "smoothed", 0.2, 0.05)
    ref.sum().backward()
    assert torch.allclose(losses.grad, l2.grad, atol=1e-10)
    assert torch.allclose(logits.grad, g2.grad, atol=1e-10)


def test_reading_early_is_an_error():
    obj = ExitObjective(2, "expected")
    obj.add_step(torch.ones(1), torch.zeros(1))
    with pytest.raises(RuntimeError, match="after 1 of 2"):
        obj.per_token()


@pytest.mark.parametrize("mode", ["expected", "smoothed", "last"])
def test_resumed_shares_add_up_to_one_fold(mode):
    """A pipeline chunk folds one step from the carried log-survival: the shares of the T steps
    sum to the uninterrupted objective, in value and in gradient."""
    T = 4
    losses, lambdas = _inputs(T)
    gates = torch.logit(lambdas).requires_grad_()
    whole = ExitObjective(T, mode, 0.15, 0.05)
    for t in range(T):
        whole.add_step(losses[t], gates[t] if t < T - 1 and mode != "last" else None)
    total = 0.0
    log_survival = None
    for t in range(T):
        part = ExitObjective.resume(T, mode, 0.15, 0.05, steps_done=t, log_survival=log_survival)
        part.add_step(losses[t], gates[t] if t < T - 1 and mode != "last" else None)
        if part.share() is not None:
            total = total + part.share()
        log_survival = part.log_survival
    assert torch.allclose(total, whole.per_token(), atol=1e-12)
    if mode != "last":
        g_whole, = torch.autograd.grad(whole.per_token().sum(), gates)
        g_parts, = torch.autograd.grad(total.sum(), gates)
        assert torch.allclose(g_whole, g_parts, atol=1e-12)
