""""What Makes Recurrence Effective in Looped Language Models?" (arXiv 2609.36636) timestep
conditioning (loop gating, branch gating, AdaLN): against a plain-torch recurrence (the one-layer
reference of test_norms, features written out from What Makes Recurrence Effective), `rescaled` and
`prefix` inference, identity at initialisation, every parameter learns, recompute-safe, TP2 ==
TP1."""

import math

import pytest
import torch

from distributed import run_distributed, setup_parallel
from reference import against_plain, full_grads, lm_batch
from test_norms import NAMES, _reference_layer, _rms
from flags import llama_style

VOCAB, SEQ, BATCH, HIDDEN = 256, 16, 2, 32
FORMS = ["loop-gating", "branch-gating", "adaln"]


def _model(form="none", scheme="ouro", T=3, inference="rescaled", recompute=None, **model_kw):
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    model_cfg = llama_style(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4,
                            max_position_embeddings=SEQ, norm_scheme=scheme, **model_kw)
    loop = LoopConfig(num_loops=T, timestep_conditioning=form, timestep_inference=inference)
    return build_model(model_cfg, loop, VOCAB, tp_size=torch.distributed.get_world_size(),
                       recompute=recompute)


def _cond_params(model):
    return {n: p for n, p in model.named_parameters() if "timestep" in n}


def _psi(l, T):
    t, dt = l / T, 1 / T
    return torch.tensor([t, dt, t ** 2, dt ** 2, t * dt, math.sin(math.pi * t),
                         math.cos(math.pi * t) - 1, math.sin(2 * math.pi * t)])


def _against_manual(rank, world, form, scheme, run_loops, inference):
    setup_parallel(world)
    model = _model(form, scheme, T=3, inference=inference, position_embedding_type="none")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in _cond_params(model).values():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    ids, pos, _ = lm_batch(VOCAB, SEQ, BATCH)
    logits = model(ids, pos, None, num_loops=run_loops)

    with torch.no_grad():
        layers = []
        for layer in model.core.layers:
            params = {NAMES[n]: p for n, p in layer.named_parameters() if "timestep" not in n}
            layers.append((params, layer))
        T_feat = run_loops if inference == "rescaled" else 3
        h = model.embedding(input_ids=ids, position_ids=pos)
        for t in range(run_loops):
            psi = _psi(t, T_feat)
            x = h
            for params, cond in layers:  # cond: the layer, holding the conditioning
                c = None
                bdas = (cond.self_attn_bda, cond.mlp_bda)
                if form == "branch-gating":
                    c = [(1 + bda.timestep_gate @ psi, 0.0) for bda in bdas]
                elif form == "adaln":
                    norms = (cond.input_layernorm, cond.pre_mlp_layernorm)
                    c = [(1 + bda.timestep_gate @ psi, norm.timestep_scale @ psi)
                         for bda, norm in zip(bdas, norms, strict=True)]
                x = _reference_layer(x, params, scheme, c)
            if form == "loop-gating":
                x = h + (1 + model.timestep.loop_gate @ psi) * (x - h)
            h = _rms(x, model.step_norm.weight)
        ref, _ = model.output_layer(h, weight=model.shared_embedding_or_output_weight())
    return (logits - ref.transpose(0, 1)).abs().max().item()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("scheme", ["ouro", "pre", "sandwich"])
def test_equals_manual_recurrence(form, scheme):
    err, = run_distributed(_against_manual, 1, form, scheme, 3, "rescaled")
    assert err < 1e-4, err


@pytest.mark.parametrize("inference", ["rescaled", "prefix"])
@pytest.mark.parametrize("run_loops", [2, 5])
def test_inference_at_other_loop_counts(inference, run_loops):
    # Under- and over-unrolling: features at t = l / T_run (rescaled) or l / T_train (prefix).
    err, = run_distributed(_against_manual, 1, "adaln", "pre", run_loops, inference)
    assert err < 1e-4, err


def _init_equals_plain(rank, world, form, scheme):
    setup_parallel(world)
    model = _model(form, scheme)
    plain = _model("none", scheme)
    return against_plain(model, plain, lm_batch(VOCAB, SEQ, BATCH), _cond_params(model))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("scheme", ["ouro", "post"])
def test_identity_at_init_and_every_parameter_learns(form, scheme):
    err, grads = run_distributed(_init_equals_plain, 1, form, scheme)[0]
    assert err == 0.0, err  # all parameters start at 0: g = 1 and s = 0 exactly
    assert grads and all(g > 0 for g in grads.values()), grads


def _grads(rank, world, form, recompute):
    setup_parallel(world)
    rc = {"recompute_granularity": "full", "recompute_method": "uniform",
          "recompute_num_layers": 1} if recompute else None
    model = _model(form, recompute=rc)
    with torch.no_grad():
        for p in _cond_params(model).values():
            p.add_(0.3)
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    out = model(ids, pos, None, labels=labels)
    out.objective.mean().backward()
    return out.objective.detach(), full_grads(model)


@pytest.mark.parametrize("form", ["branch-gating", "adaln"])
def test_full_recompute_gives_the_same_gradients(form):
    # Recomputation re-runs the core in the backward pass, after the forward moved on to later
    # steps: the conditioning must re-select each step's features (else grads differ).
    (obj1, g1), = run_distributed(_grads, 1, form, False)
    (obj2, g2), = run_distributed(_grads, 1, form, True)
    assert (obj1 - obj2).abs().max().item() < 1e-6
    for k in g1:
        assert torch.allclose(g1[k], g2[k], atol=1e-6, rtol=1e-5), k


def _loss_and_grads(rank, world, form):
    setup_parallel(world)
    model = _model(form)
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    out = model(ids, pos, None, labels=labels)
    out.objective.mean().backward()
    return out.objective.detach(), full_grads(model)


@pytest.mark.parametrize("form", FORMS)
def test_tp2_equals_tp1(form):
    (obj1, g1), = run_distributed(_loss_and_grads, 1, form)
    for obj2, g2 in run_distributed(_loss_and_grads, 2, form):
        assert (obj1 - obj2).abs().max().item() < 1e-5
        assert g1.keys() == g2.keys()
        assert any("timestep" in k for k in g1)
        for k in g1:
            assert torch.allclose(g1[k], g2[k], atol=1e-5, rtol=1e-4), k


def _hooks_in_core(rank, world, form):
    setup_parallel(world)
    model = _model(form)
    return [name for name, m in model.core.named_modules()
            if m._forward_hooks or m._forward_pre_hooks]


@pytest.mark.parametrize("form", ["branch-gating", "adaln"])
def test_conditioning_is_built_from_the_spec_not_hooks(form):
    # The gates and scales are modules of the core's layer spec: no forward hook reaches into
    # megatron-core's submodules.
    assert run_distributed(_hooks_in_core, 1, form)[0] == []
