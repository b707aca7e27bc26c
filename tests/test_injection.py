"""Scalar-mix input injection ("Closing the Loop" (arXiv 2610.00673) Eq. 1) against a hand-unrolled
recurrence, same blocks."""

import math

import pytest
import torch

from distributed import run_distributed, setup_parallel
from reference import embed_by_hand, full_grads, lm_batch, reference_objective
from flags import llama_style

VOCAB, SEQ, BATCH = 256, 16, 2


def _model(T, source="embedding", prelude=0, init_weight=0.7, placement="recurrent"):
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    model_cfg = llama_style(num_layers=2 + prelude, hidden_size=32, num_attention_heads=4,
                            num_query_groups=2, max_position_embeddings=SEQ)
    loop = LoopConfig(num_loops=T, num_prelude_layers=prelude, input_injection="scalar-mix",
                      injection_source=source, injection_init_weight=init_weight,
                      step_norm_placement=placement, exit_kl_beta=0.1)
    return build_model(model_cfg, loop, VOCAB, tp_size=torch.distributed.get_world_size())


def _against_manual(rank, world, T, source, prelude, placement):
    setup_parallel(world)
    model = _model(T, source, prelude, placement=placement)
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    out = model(ids, pos, None, labels=labels)
    out.objective.mean().backward()
    grad_a = model.injection.logit.grad.clone()

    # Independent recurrence: the same blocks, called by hand, mixing by the paper's formula.
    w = 1.0 / (1.0 + math.exp(-model.injection.logit.item()))
    assert abs(w - 0.7) < 1e-6
    with torch.no_grad():
        rope, e, h = embed_by_hand(model, ids, pos)
        src = e if source == "embedding" else h
        losses, lambdas = [], []
        weight = model.shared_embedding_or_output_weight()
        for t in range(1, T + 1):
            z = h if t == 1 else w * src + (1 - w) * h  # Eq. 1, after the first step
            out_t = model.core(hidden_states=z, attention_mask=None, rotary_pos_emb=rope)
            y = model.step_norm(out_t)
            h = y if placement == "recurrent" else out_t
            logits, _ = model.output_layer(y, weight=weight)
            losses.append(model.compute_language_model_loss(labels, logits))
            if t < T:
                lambdas.append(torch.sigmoid(model.exit_gate.linear(y).squeeze(-1).float()).t())
        ref, _ = reference_objective(torch.stack(losses), torch.stack(lambdas), beta=0.1)
    return (out.objective.detach() - ref).abs().max().item(), grad_a.abs().item()


@pytest.mark.parametrize("source,prelude,placement", [("embedding", 0, "recurrent"),
                                                      ("embedding", 1, "readout"),
                                                      ("prelude", 1, "recurrent")])
def test_scalar_mix_equals_manual_recurrence(source, prelude, placement):
    (err, grad_a), = run_distributed(_against_manual, 1, 3, source, prelude, placement)
    assert err < 1e-5, err
    assert grad_a > 0.0  # the mixing scalar learns


def _weight_one(rank, world):
    setup_parallel(world)
    model = _model(3)
    with torch.no_grad():
        model.injection.logit.fill_(float("inf"))  # w = sigmoid(inf) = 1 exactly
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    out = model(ids, pos, None, labels=labels)
    return out.step_losses


def test_weight_one_feeds_the_embedding_to_every_step():
    # With w = 1 every step's core input is the embedding itself, so all steps are identical.
    step_losses, = run_distributed(_weight_one, 1)
    assert torch.equal(step_losses[0], step_losses[1]) and torch.equal(step_losses[0],
                                                                       step_losses[2])


def _loss_and_grads(rank, world):
    setup_parallel(world)
    model = _model(3, "prelude", 1)
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    out = model(ids, pos, None, labels=labels)
    out.objective.mean().backward()
    return out.objective.detach(), full_grads(model)


def test_injection_tp2_equals_tp1():
    (obj1, g1), = run_distributed(_loss_and_grads, 1)
    for obj2, g2 in run_distributed(_loss_and_grads, 2):
        assert (obj1 - obj2).abs().max().item() < 1e-5
        assert g1.keys() == g2.keys() and "injection.logit" in g1
        for k in g1:
            assert torch.allclose(g1[k], g2[k], atol=1e-5, rtol=1e-4), k


@pytest.mark.parametrize("bad", [0.0, 1.0, 1.5])
def test_init_weight_validated(bad):
    from megaloop.model.config import LoopConfig

    with pytest.raises(ValueError, match="--injection-init-weight"):
        LoopConfig(num_loops=2, input_injection="scalar-mix", injection_init_weight=bad).validate(2)
