"""From "What Makes Recurrence Effective in Looped Language Models?" (arXiv 2609.36636):
initial-state injection forms, Huginn's concat-linear and What Makes Recurrence Effective's
history-state injection: against a hand-unrolled recurrence written from the papers' formulas (same
blocks, non-zero parameters), equal to the plain model at initialisation, every new parameter
learns, TP2 == TP1."""

import pytest
import torch

from distributed import run_distributed, setup_parallel
from reference import against_plain, embed_by_hand, full_grads, lm_batch, reference_objective
from flags import llama_style

VOCAB, SEQ, BATCH, HIDDEN = 256, 16, 2, 32
T = 4  # history window 2 needs T >= 4 to read both lags

FORMS = ["scalar", "channel-wise", "residual-channel-wise", "dense", "concat-linear"]
HISTORY = ["scalar", "channel-wise", "dense"]
# (input injection, history injection): every form alone, every history kind alone, combined
VARIANTS = [(f, "none") for f in FORMS] + [("none", h) for h in HISTORY] + \
    [("channel-wise", "channel-wise"), ("dense", "scalar")]


def _model(injection="none", history="none", source="embedding", prelude=0, window=2):
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    model_cfg = llama_style(num_layers=2 + prelude, hidden_size=HIDDEN, num_attention_heads=4,
                            num_query_groups=2, max_position_embeddings=SEQ)
    loop = LoopConfig(num_loops=T, num_prelude_layers=prelude, input_injection=injection,
                      injection_source=source, history_injection=history, history_window=window,
                      exit_kl_beta=0.1)
    loop.validate(model_cfg.num_layers)
    return build_model(model_cfg, loop, VOCAB, tp_size=torch.distributed.get_world_size())


def _new_params(model):
    return {n: p for n, p in model.named_parameters()
            if n.startswith(("injection.", "history_injection."))}


def _inject(form, p, h, src):
    """The papers' formulas, written out (p: the module's parameters by short name)."""
    if form == "scalar":
        return h + p["b"] * src
    if form == "channel-wise":
        return p["a"] * h + p["b"] * src
    if form == "residual-channel-wise":
        return (1 + p["a"]) * h + p["b"] * src
    d = h.shape[-1]
    return h @ p["weight"][:, :d].t() + src @ p["weight"][:, d:].t()


def _history(kind, B, h, past, window):
    z = h
    for j in range(1, min(window, len(past)) + 1):
        diff = past[-j] - h
        z = z + (diff @ B[j - 1].t() if kind == "dense" else B[j - 1] * diff)
    return z


def _against_manual(rank, world, injection, history, source, prelude):
    setup_parallel(world)
    model = _model(injection, history, source, prelude)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # move every new parameter away from its identity initialisation
        for p in _new_params(model).values():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    out = model(ids, pos, None, labels=labels)

    params = {n.split(".")[-1]: p.detach() for n, p in _new_params(model).items()
              if n.startswith("injection.")}
    B = model.history_injection.weight.detach() if history != "none" else None
    with torch.no_grad():
        rope, e, h = embed_by_hand(model, ids, pos)
        src = e if source == "embedding" else h
        states, losses, lambdas = [h], [], []  # states: h_0, h_1, ...
        weight = model.shared_embedding_or_output_weight()
        for t in range(1, T + 1):
            z = h
            if history != "none":  # window of completed states h_1 .. h_{t-2}, h_0 excluded
                z = _history(history, B, z, states[1:t - 1], 2)
            if injection != "none":  # both: before every core pass, the first included
                z = _inject(injection, params, z, src)
            h = model.step_norm(model.core(hidden_states=z, attention_mask=None,
                                           rotary_pos_emb=rope))
            states.append(h)
            logits, _ = model.output_layer(h, weight=weight)
            losses.append(model.compute_language_model_loss(labels, logits))
            if t < T:
                lambdas.append(torch.sigmoid(model.exit_gate.linear(h).squeeze(-1).float()).t())
        ref, _ = reference_objective(torch.stack(losses), torch.stack(lambdas), beta=0.1)
    return (out.objective.detach() - ref).abs().max().item()


@pytest.mark.parametrize("injection,history", VARIANTS)
def test_equals_manual_recurrence(injection, history):
    err, = run_distributed(_against_manual, 1, injection, history, "embedding", 0)
    assert err < 1e-5, err


@pytest.mark.parametrize("injection,history", [("channel-wise", "none"), ("dense", "dense")])
def test_prelude_source_equals_manual_recurrence(injection, history):
    err, = run_distributed(_against_manual, 1, injection, history, "prelude", 1)
    assert err < 1e-5, err


def _init_equals_plain(rank, world, injection, history):
    setup_parallel(world)
    model = _model(injection, history)
    plain = _model()
    return against_plain(model, plain, lm_batch(VOCAB, SEQ, BATCH), _new_params(model))


@pytest.mark.parametrize("injection,history", [v for v in VARIANTS if v[0] != "concat-linear"])
def test_identity_at_init_and_new_params_learn(injection, history):
    err, grads = run_distributed(_init_equals_plain, 1, injection, history)[0]
    assert err < 1e-6, err  # the paper initialises every one of these forms to the identity on h
    assert grads and all(g > 0 for g in grads.values()), grads


def test_concat_linear_is_not_identity_and_learns():
    # Huginn's adapter starts random: the model differs from the plain one, and W learns.
    err, grads = run_distributed(_init_equals_plain, 1, "concat-linear", "none")[0]
    assert err > 1e-3
    assert grads["injection.weight"] > 0


def _history_lags_learn(rank, world):
    setup_parallel(world)
    model = _model("none", "channel-wise")
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    model(ids, pos, None, labels=labels).objective.mean().backward()
    return model.history_injection.weight.grad.abs().amax(dim=1)


def test_every_history_lag_learns():
    lag_grads, = run_distributed(_history_lags_learn, 1)
    assert (lag_grads > 0).all(), lag_grads  # both lags of window 2 are read at T = 4


def _loss_and_grads(rank, world, injection, history):
    setup_parallel(world)
    model = _model(injection, history, "prelude", 1)
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    out = model(ids, pos, None, labels=labels)
    out.objective.mean().backward()
    return out.objective.detach(), full_grads(model)


@pytest.mark.parametrize("injection,history", VARIANTS)
def test_tp2_equals_tp1(injection, history):
    (obj1, g1), = run_distributed(_loss_and_grads, 1, injection, history)
    for obj2, g2 in run_distributed(_loss_and_grads, 2, injection, history):
        assert (obj1 - obj2).abs().max().item() < 1e-5
        assert g1.keys() == g2.keys()
        assert any(k.startswith(("injection.", "history_injection.")) for k in g1)
        for k in g1:
            assert torch.allclose(g1[k], g2[k], atol=1e-5, rtol=1e-4), k


@pytest.mark.parametrize("flags,match", [
    ({"history_injection": "scalar", "num_loops": 2}, "--history-injection"),
    ({"history_injection": "scalar", "num_loops": 4, "history_window": 0}, "--history-window"),
])
def test_validation_names_the_flag(flags, match):
    from megaloop.model.config import LoopConfig

    with pytest.raises(ValueError, match=match):
        LoopConfig(**flags).validate(2)


@pytest.mark.parametrize("model_kw,loop_kw,flag", [
    ({"norm_scheme": "post"}, {}, "--norm-scheme"),
    ({"norm_scheme": "magic"}, {}, "--norm-scheme"),
    ({}, {"step_norm": "frms"}, "--step-norm"),
    ({}, {"input_injection": "dense"}, "--input-injection"),
    ({}, {"history_injection": "channel-wise"}, "--history-injection"),
    ({}, {"timestep_conditioning": "loop-gating"}, "--timestep-conditioning"),
])
def test_hf_export_refuses_what_its_modeling_file_lacks(model_kw, loop_kw, flag):
    from megaloop.convert.hf_export import check_exportable
    from megaloop.model.config import LoopConfig

    check_exportable(llama_style(), LoopConfig(num_loops=4, input_injection="scalar-mix"))
    with pytest.raises(ValueError, match=flag):
        check_exportable(llama_style(**model_kw), LoopConfig(num_loops=4, **loop_kw))
