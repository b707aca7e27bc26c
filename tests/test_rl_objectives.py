"""GRPO and RLTT (megaloop.rl.objectives) against a hand computation in plain Python floats on a
tiny batch: advantages, clipped-ratio surrogate, k3 KL, both aggregations, and the gradients
written out by hand (d/d logp of each token's term); RLTT with weights (0, ..., 0, 1) is GRPO
bit for bit; a group whose rewards are all equal gets no policy gradient."""

import math

import pytest
import torch

from megaloop.rl.objectives import (aggregate_parts, group_advantages, grpo_loss,
                                    loop_weights, rltt_log_probs)

EPS_STD, CLIP, BETA = 1e-6, 0.2, 0.1
# 2 groups of 3 completions, 3 token positions; group 2's rewards are all 0.1 (their float mean
# is not 0.1: a naive (r - mean) / (std + eps) gives advantages of about 1e-11 there).
REWARDS = [[1.0, 0.0, 0.5], [0.1, 0.1, 0.1]]
MASK = [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]]
LOGP = [[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7], [-2.0, -0.1, -0.1],
        [-0.6, -0.9, -1.1], [-1.5, -0.2, -0.4], [-0.8, -0.8, -0.8]]
# The sampling policy: some ratios far outside [0.8, 1.2], so both clip branches are taken.
OLD = [[-1.0, -1.0, -2.0], [0.2, -1.2, -0.9], [-2.0, -0.1, -0.1],
       [-0.6, -0.5, -1.1], [-1.5, -0.2, -0.4], [-0.8, -0.8, -0.8]]
REF = [[-0.9, -0.6, -2.0], [-0.4, -1.0, -0.7], [-1.8, -0.1, -0.3],
       [-0.5, -1.0, -1.0], [-1.4, -0.3, -0.4], [-0.9, -0.7, -0.8]]


def hand_advantages(rewards):
    out = []
    for group in rewards:
        n, mean = len(group), sum(group) / len(group)
        if max(group) == min(group):
            out += [0.0] * n
            continue
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - 1))
        out += [(r - mean) / (std + EPS_STD) for r in group]
    return out


def hand_terms(adv, lp, old, ref, beta):
    """(loss term, d term / d lp) of one token."""
    ratio = math.exp(lp - old)
    clipped_ratio = min(max(ratio, 1 - CLIP), 1 + CLIP)
    unclipped, clipped = ratio * adv, clipped_ratio * adv
    surrogate = min(unclipped, clipped)
    # The min takes the unclipped term (gradient adv * ratio) unless clipping made it smaller,
    # which happens only outside [1 - clip, 1 + clip], where the clipped term is constant.
    d_surrogate = adv * ratio if unclipped <= clipped else 0.0
    kl = math.exp(ref - lp) - (ref - lp) - 1
    d_kl = -math.exp(ref - lp) + 1
    return -surrogate + beta * kl, -d_surrogate + beta * d_kl


def hand_loss(aggregation, beta, logp=LOGP, old=OLD, ref=REF, mask=MASK):
    adv = hand_advantages(REWARDS)
    terms = [[hand_terms(adv[b], logp[b][s], old[b][s], ref[b][s], beta) for s in range(3)]
             for b in range(6)]
    grad = [[0.0] * 3 for _ in range(6)]
    if aggregation == "token-mean":
        n = sum(map(sum, mask))
        loss = sum(terms[b][s][0] for b in range(6) for s in range(3) if mask[b][s]) / n
        for b in range(6):
            for s in range(3):
                grad[b][s] = terms[b][s][1] / n if mask[b][s] else 0.0
    else:
        loss = 0.0
        for b in range(6):
            n = sum(mask[b])
            loss += sum(terms[b][s][0] for s in range(3) if mask[b][s]) / n / 6
            for s in range(3):
                grad[b][s] = terms[b][s][1] / n / 6 if mask[b][s] else 0.0
    return loss, grad


def t(rows, grad=False):
    return torch.tensor(rows, dtype=torch.float64, requires_grad=grad)


def test_advantages_by_hand():
    adv = group_advantages(t(REWARDS)).flatten().tolist()
    assert adv == pytest.approx(hand_advantages(REWARDS), abs=1e-12)
    assert adv[3:] == [0.0, 0.0, 0.0]  # exactly, not about 1e-11
    assert group_advantages(t([[2.0], [3.0]])).tolist() == [[0.0], [0.0]]


@pytest.mark.parametrize("aggregation", ["token-mean", "sequence-mean"])
@pytest.mark.parametrize("beta", [0.0, BETA])
def test_grpo_loss_and_gradient_by_hand(aggregation, beta):
    logp = t(LOGP, grad=True)
    adv = group_advantages(t(REWARDS)).flatten()
    loss, stats = grpo_loss(logp, t(OLD), t(REF), adv, t(MASK), clip_eps=CLIP, kl_beta=beta,
                            aggregation=aggregation)
    loss.backward()
    want_loss, want_grad = hand_loss(aggregation, beta)
    assert loss.item() == pytest.approx(want_loss, abs=1e-12)
    assert logp.grad.tolist() == [pytest.approx(row, abs=1e-12) for row in want_grad]
    n = sum(map(sum, MASK))
    kl = sum(math.exp(REF[b][s] - LOGP[b][s]) - (REF[b][s] - LOGP[b][s]) - 1
             for b in range(6) for s in range(3) if MASK[b][s]) / n
    assert stats["kl"] == pytest.approx(kl, abs=1e-12)
    clipped = sum(not (1 - CLIP <= math.exp(LOGP[b][s] - OLD[b][s]) <= 1 + CLIP)
                  for b in range(6) for s in range(3) if MASK[b][s])
    assert clipped > 0 and stats["clip_fraction"] == pytest.approx(clipped / n)


def test_the_two_aggregations_differ_when_lengths_differ():
    adv = group_advantages(t(REWARDS)).flatten()
    a, _ = grpo_loss(t(LOGP), t(OLD), None, adv, t(MASK), aggregation="token-mean")
    b, _ = grpo_loss(t(LOGP), t(OLD), None, adv, t(MASK), aggregation="sequence-mean")
    assert abs(a.item() - b.item()) > 1e-3


@pytest.mark.parametrize("parts", [[6], [1] * 6, [2, 3, 1]], ids=["whole", "rows", "uneven"])
@pytest.mark.parametrize("aggregation", ["token-mean", "sequence-mean"])
def test_aggregate_parts_of_micro_batches_give_the_batch_mean_by_hand(aggregation, parts):
    """The trainer sums aggregate_parts' numerators and denominators over micro-batches and
    ranks (megaloop/rl/trainer.py); the ratio must be the whole batch's mean, by hand."""
    values = [[LOGP[b][s] * (b + 1) for s in range(3)] for b in range(6)]
    if aggregation == "token-mean":  # every response token weighs the same
        tokens = [values[b][s] for b in range(6) for s in range(3) if MASK[b][s]]
        want = sum(tokens) / len(tokens)
    else:  # each completion's mean, then the mean over completions
        means = [sum(v for v, m in zip(values[b], MASK[b]) if m) / sum(MASK[b]) for b in range(6)]
        want = sum(means) / 6
    numerator = denominator = 0.0
    start = 0
    for size in parts:
        num, den = aggregate_parts(t(values[start:start + size]), t(MASK[start:start + size]),
                                   aggregation)
        numerator, denominator = numerator + num.item(), denominator + den.item()
        start += size
    assert numerator / denominator == pytest.approx(want, abs=1e-12)


def test_a_group_with_equal_rewards_gets_no_policy_gradient():
    for beta in (0.0, BETA):
        logp = t(LOGP, grad=True)
        loss, _ = grpo_loss(logp, t(OLD), t(REF), group_advantages(t(REWARDS)).flatten(),
                            t(MASK), kl_beta=beta)
        loss.backward()
        n = sum(map(sum, MASK))
        for b in range(3, 6):  # group 2: only the KL term's gradient, zero at beta 0
            for s in range(3):
                kl_grad = BETA * (1 - math.exp(REF[b][s] - LOGP[b][s])) / n if beta else 0.0
                want = kl_grad if MASK[b][s] else 0.0
                assert logp.grad[b, s].item() == pytest.approx(want, abs=1e-15), (beta, b, s)
        if beta == 0.0:
            assert torch.all(logp.grad[3:] == 0)
            assert logp.grad[:3].abs().sum() > 0.1  # group 1 does learn


def _steps(seed, grad=False):
    g = torch.Generator().manual_seed(seed)
    x = -torch.rand(4, 6, 3, generator=g, dtype=torch.float64) * 2
    return x.requires_grad_(grad)


def test_rltt_with_last_step_weights_is_grpo_exactly():
    adv = group_advantages(t(REWARDS)).flatten()
    steps, old, ref = _steps(0, grad=True), _steps(1), _steps(2)
    w = loop_weights("last", 4)
    assert w.tolist() == [0.0, 0.0, 0.0, 1.0]
    rltt, _ = grpo_loss(rltt_log_probs(steps, w), rltt_log_probs(old, w),
                        rltt_log_probs(ref, w), adv, t(MASK), kl_beta=BETA)
    rltt.backward()
    grad_rltt = steps.grad.clone()
    steps.grad = None
    grpo, _ = grpo_loss(steps[-1], old[-1], ref[-1], adv, t(MASK), kl_beta=BETA)
    grpo.backward()
    assert rltt.item() == grpo.item()  # bitwise
    assert torch.equal(grad_rltt, steps.grad)
    assert torch.all(grad_rltt[:3] == 0)


def test_rltt_weights_and_gradient_by_hand():
    T = 4
    assert loop_weights("uniform", T).tolist() == [0.25] * 4
    assert loop_weights("progressive", 3, alpha=2.0).tolist() == pytest.approx(
        [1 / 14, 4 / 14, 9 / 14])
    assert loop_weights("progressive", 3, alpha=1.0).tolist() == pytest.approx(
        [1 / 6, 2 / 6, 3 / 6])
    exit_probs = torch.softmax(_steps(3), dim=0).requires_grad_(True)
    adv = group_advantages(t(REWARDS)).flatten()
    for kind in ("uniform", "progressive", "exit_pdf"):
        steps = _steps(0, grad=True)
        w = loop_weights(kind, T, alpha=2.0, exit_probs=exit_probs)
        # w_t per token, as plain floats
        wf = [[[float(w[k] if w.dim() == 1 else w[k, b, s]) for s in range(3)] for b in range(6)]
              for k in range(T)]
        agg = [[sum(wf[k][b][s] * steps[k, b, s].item() for k in range(T)) for s in range(3)]
               for b in range(6)]
        old = [[sum(wf[k][b][s] * _steps(1)[k, b, s].item() for k in range(T)) for s in range(3)]
               for b in range(6)]
        ref = [[sum(wf[k][b][s] * _steps(2)[k, b, s].item() for k in range(T)) for s in range(3)]
               for b in range(6)]
        loss, _ = grpo_loss(rltt_log_probs(steps, w), rltt_log_probs(_steps(1), w),
                            rltt_log_probs(_steps(2), w), adv, t(MASK), kl_beta=BETA)
        loss.backward()
        want_loss, want_grad = hand_loss("token-mean", BETA, logp=agg, old=old, ref=ref)
        assert loss.item() == pytest.approx(want_loss, abs=1e-12), kind
        for k in range(T):  # d loss / d log P^(t) = w_t * d loss / d aggregated log-prob
            want = [[wf[k][b][s] * want_grad[b][s] for s in range(3)] for b in range(6)]
            assert steps.grad[k].tolist() == [pytest.approx(r, abs=1e-12) for r in want], kind
    assert exit_probs.grad is None  # exit_pdf weights are detached


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="loop weighting 'learned'"):
        loop_weights("learned", 4)
    with pytest.raises(ValueError, match="exit_pdf weights need"):
        loop_weights("exit_pdf", 4)
    with pytest.raises(ValueError, match="aggregation 'mean'"):
        grpo_loss(t(LOGP), t(OLD), None, torch.zeros(6), t(MASK), aggregation="mean")
    with pytest.raises(ValueError, match="kl_beta > 0 needs ref_logp"):
        grpo_loss(t(LOGP), t(OLD), None, torch.zeros(6), t(MASK), kl_beta=0.1)
