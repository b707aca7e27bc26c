"""The looped model against independent computations: unrolled copies, TP=1, plain GPTModel."""

import pytest
import torch

from distributed import run_distributed, setup_parallel
from reference import full_grads, gather_tp, lm_batch, reference_objective
from flags import llama_style

VOCAB, SEQ, BATCH = 256, 16, 2


def _model(T, norm_scheme="ouro", prelude=0, coda=0, exit_loss="expected", beta=0.15,
           num_layers=2, **model_kw):
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    model_cfg = llama_style(num_layers=num_layers, hidden_size=32, num_attention_heads=4,
                            max_position_embeddings=SEQ, norm_scheme=norm_scheme, **model_kw)
    loop = LoopConfig(num_loops=T, num_prelude_layers=prelude, num_coda_layers=coda,
                      exit_loss=exit_loss, exit_kl_beta=beta)
    tp = torch.distributed.get_world_size()
    return build_model(model_cfg, loop, VOCAB, tp_size=tp)


def _unrolled_vs_looped(rank, world, T, norm_scheme, prelude, coda):
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megaloop.model.config import with_layers
    from megaloop.model.specs import build_norm, layer_spec

    setup_parallel(world)
    model = _model(T, norm_scheme, prelude, coda, num_layers=2 + prelude + coda)
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    out = model(ids, pos, None, labels=labels)
    out.objective.mean().backward()
    looped = full_grads(model)
    looped_obj = out.objective.detach()
    model.zero_grad()

    # T independent copies of the core block and the step norm, with the core's weights.
    spec = layer_spec(model.config, norm_scheme, use_te=False)
    K = len(model.core.layers)
    blocks = [TransformerBlock(config=with_layers(model.config, K), spec=spec,
                               post_layer_norm=False) for _ in range(T)]
    norms = [build_norm(model.config, False) for _ in range(T)]
    for b, n in zip(blocks, norms):
        b.load_state_dict(model.core.state_dict())
        n.load_state_dict(model.step_norm.state_dict())
    rope = model.rotary_pos_emb(SEQ)
    h = model.embedding(input_ids=ids, position_ids=pos)
    if model.prelude is not None:
        h = model.prelude(hidden_states=h, attention_mask=None, rotary_pos_emb=rope)
    losses, lambdas = [], []
    weight = model.shared_embedding_or_output_weight()
    for t in range(T):
        h = norms[t](blocks[t](hidden_states=h, attention_mask=None, rotary_pos_emb=rope))
        r = h if model.coda is None else model.coda(hidden_states=h, attention_mask=None,
                                                    rotary_pos_emb=rope)
        logits, _ = model.output_layer(r, weight=weight)
        losses.append(model.compute_language_model_loss(labels, logits))
        if t < T - 1:
            lambdas.append(torch.sigmoid(model.exit_gate.linear(r).squeeze(-1).float()).t())
    ref_obj, _ = reference_objective(torch.stack(losses), torch.stack(lambdas), beta=0.15)
    ref_obj.mean().backward()
    unrolled = full_grads(model)
    for i in range(T):
        for name, p in blocks[i].named_parameters():
            g = gather_tp(p.grad, p)
            key = "core." + name
            unrolled[key] = unrolled[key] + g if key in unrolled else g
        for name, p in norms[i].named_parameters():
            key = "step_norm." + name
            unrolled[key] = unrolled[key] + p.grad if key in unrolled else p.grad.clone()
    assert looped.keys() == unrolled.keys()
    grad_err = max((looped[k] - unrolled[k]).abs().max().item() for k in looped)
    return (looped_obj - ref_obj.detach()).abs().max().item(), grad_err


@pytest.mark.parametrize("tp", [1, 2])
def test_looped_equals_unrolled(tp):
    for obj_err, grad_err in run_distributed(_unrolled_vs_looped, tp, 3, "ouro", 0, 0):
        assert obj_err < 1e-5 and grad_err < 1e-5, (obj_err, grad_err)


def test_looped_equals_unrolled_with_prelude_coda_pre_norm():
    for obj_err, grad_err in run_distributed(_unrolled_vs_looped, 1, 2, "pre", 1, 1):
        assert obj_err < 1e-5 and grad_err < 1e-5, (obj_err, grad_err)


def _loss_and_grads(rank, world, T, untie):
    setup_parallel(world)
    model = _model(T, untie_embeddings_and_output_weights=untie, num_query_groups=2)
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    out = model(ids, pos, None, labels=labels)
    out.objective.mean().backward()
    return out.objective.detach(), full_grads(model)


@pytest.mark.parametrize("untie", [False, True])
def test_tp2_equals_tp1(untie):
    (obj1, g1), = run_distributed(_loss_and_grads, 1, 4, untie)
    for obj2, g2 in run_distributed(_loss_and_grads, 2, 4, untie):
        assert (obj1 - obj2).abs().max().item() < 1e-5
        assert g1.keys() == g2.keys()
        for k in g1:
            assert torch.allclose(g1[k], g2[k], atol=1e-5, rtol=1e-4), k


def _vs_gpt_model(rank, world):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    setup_parallel(world)
    model = _model(1, "pre", beta=0.0)
    gpt = GPTModel(config=model.config, transformer_layer_spec=get_gpt_layer_local_spec(
        normalization="RMSNorm"), vocab_size=VOCAB, max_sequence_length=SEQ,
        position_embedding_type="rope", share_embeddings_and_output_weights=True)
    # Same weights: megaloop names the decoder `core` and its final norm `step_norm`.
    state = {}
    for k, v in gpt.state_dict().items():
        k = k.replace("decoder.final_layernorm", "step_norm").replace("decoder.", "core.")
        state[k] = v
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not [m for m in missing if not m.endswith("_extra_state")], missing
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    ours = model(ids, pos, None, labels=labels).objective
    theirs = gpt(ids, pos, None, labels=labels)
    logits_ours = model(ids, pos, None)
    logits_theirs = gpt(ids, pos, None)
    return (ours - theirs).abs().max().item(), (logits_ours - logits_theirs).abs().max().item()


def test_dense_t1_equals_megatron_gpt_model():
    for loss_err, logit_err in run_distributed(_vs_gpt_model, 2):
        assert loss_err < 1e-6 and logit_err < 1e-5, (loss_err, logit_err)


def _last_mode(rank, world):
    setup_parallel(world)
    model = _model(3, exit_loss="last")
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    out = model(ids, pos, None, labels=labels)
    assert model.exit_gate is None and out.exit_probs is None
    assert torch.isnan(out.step_losses[:2]).all()
    assert torch.equal(out.objective, out.step_losses[2])
    return True


def test_last_mode_reads_out_final_step_only():
    run_distributed(_last_mode, 1)
