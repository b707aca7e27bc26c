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
            assert torch.allclose(g1[k], g2[k], atol=1e-6, rtol=1e-4), k
    assert p1.keys() == p2.keys()
    for k in p1:
        assert torch.allclose(p1[k], p2[k], atol=1e-6, rtol=1e-4), k
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
