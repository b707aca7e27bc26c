"""Norm schemes ("Closing the Loop" (arXiv 2610.00673) App. A) against a plain-torch
re-implementation of one layer; step norms against a hand-unrolled recurrence; every scheme and step
norm TP=2 == TP=1."""

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed, setup_parallel
from reference import full_grads, lm_batch
from flags import llama_style

VOCAB, SEQ, BATCH, HIDDEN, HEADS = 256, 16, 2, 32, 4
EPS = 1e-5
SCHEMES = ["ouro", "pre", "post", "sandwich", "magic"]


def _rms(x, w=None):
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


def _reference_layer(x, p, scheme, cond=None):
    """One decoder layer in plain torch: causal MHA (qkv laid out per head as [q k v]) + SwiGLU
    MLP, norms placed as Closing the Loop App. A describes each scheme. x: [s, b, h]. ``cond``: per
    branch (g, s) of the timestep conditioning of "What Makes Recurrence Effective in Looped
    Language Models?" (arXiv 2609.36636): the branch reads (1 + s) N(u), its update is g B."""
    s, b, h = x.shape
    d = h // HEADS

    def attn(u):
        qkv = (u @ p["qkv"].t()).view(s, b, HEADS, 3 * d)
        q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.split(d, dim=-1))  # [b, n, s, d]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.permute(2, 0, 1, 3).reshape(s, b, h) @ p["proj"].t()

    def mlp(u):
        gate, up = (u @ p["fc1"].t()).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ p["fc2"].t()

    for i, (f, n_in, n_out) in enumerate(((attn, "in1", "out1"), (mlp, "in2", "out2"))):
        g, s_ = cond[i] if cond else (1.0, 0.0)

        def branch(u):
            return g * f((1 + s_) * u)

        if scheme == "pre":
            x = x + branch(_rms(x, p[n_in]))
        elif scheme == "magic":
            x = x + branch(_rms(x))
        elif scheme == "ouro":  # the gate scales the normalized update
            x = x + g * _rms(f((1 + s_) * _rms(x, p[n_in])), p[n_out])
        elif scheme == "post":
            x = _rms(x + branch(x), p[n_out])
        elif scheme == "sandwich":
            x = _rms(x + branch(_rms(x, p[n_in])), p[n_out])
    return x


# megatron-core parameter names of one layer -> reference names
NAMES = {
    "self_attention.linear_qkv.weight": "qkv", "self_attention.linear_proj.weight": "proj",
    "mlp.linear_fc1.weight": "fc1", "mlp.linear_fc2.weight": "fc2",
    "input_layernorm.weight": "in1", "pre_mlp_layernorm.weight": "in2",
    "self_attn_bda.norm.weight": "out1", "mlp_bda.norm.weight": "out2",
}
EXPECTED_NORMS = {"pre": {"in1", "in2"}, "magic": set(), "ouro": {"in1", "in2", "out1", "out2"},
                  "post": {"out1", "out2"}, "sandwich": {"in1", "in2", "out1", "out2"}}


def _one_layer(rank, world, scheme):
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megaloop.model.config import transformer_config
    from megaloop.model.specs import layer_spec

    setup_parallel(world)
    cfg = transformer_config(llama_style(num_layers=1, hidden_size=HIDDEN,
                                         num_attention_heads=HEADS, norm_epsilon=EPS), 1)
    block = TransformerBlock(config=cfg, spec=layer_spec(cfg, scheme, use_te=False),
                             post_layer_norm=False)
    params = {}
    g = torch.Generator().manual_seed(1)
    for name, t in block.named_parameters():
        key = NAMES[name.removeprefix("layers.0.")]  # KeyError: an unexpected parameter
        if key.startswith(("in", "out")):  # norm scales start at 1: make misplacement visible
            with torch.no_grad():
                t.copy_(1 + 0.5 * torch.randn(t.shape, generator=g))
        params[key] = t.detach().clone()
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    out = block(hidden_states=x, attention_mask=None)
    ref = _reference_layer(x, params, scheme)
    return set(k for k in params if k.startswith(("in", "out"))), (out - ref).abs().max().item()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_norm_scheme_equals_functional_layer(scheme):
    (norms, err), = run_distributed(_one_layer, 1, scheme)
    assert norms == EXPECTED_NORMS[scheme]
    assert err < 1e-5, err


def test_schemes_differ():
    # The reference itself must tell the schemes apart (else the test above could not fail).
    torch.manual_seed(0)
    p = {"qkv": torch.randn(3 * HIDDEN, HIDDEN) * 0.1, "proj": torch.randn(HIDDEN, HIDDEN) * 0.1,
         "fc1": torch.randn(8 * HIDDEN, HIDDEN) * 0.1, "fc2": torch.randn(HIDDEN, 4 * HIDDEN) * 0.1}
    p.update({k: 1 + 0.5 * torch.randn(HIDDEN) for k in ("in1", "in2", "out1", "out2")})
    x = torch.randn(SEQ, BATCH, HIDDEN)
    outs = [_reference_layer(x, p, s) for s in SCHEMES]
    for i in range(len(outs)):
        for j in range(i):
            assert (outs[i] - outs[j]).abs().max() > 1e-3


def _model(T, scheme="ouro", step_norm="rms", coda=0, exit_loss="expected"):
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    model_cfg = llama_style(num_layers=2 + coda, hidden_size=HIDDEN, num_attention_heads=HEADS,
                            max_position_embeddings=SEQ, norm_scheme=scheme, norm_epsilon=EPS)
    loop = LoopConfig(num_loops=T, num_coda_layers=coda, step_norm=step_norm,
                      exit_loss=exit_loss)
    return build_model(model_cfg, loop, VOCAB, tp_size=torch.distributed.get_world_size())


def _step_norm_manual(rank, world, step_norm, coda):
    setup_parallel(world)
    model = _model(3, step_norm=step_norm, coda=coda, exit_loss="last")
    names = {n for n, _ in model.named_parameters()}
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    out = model(ids, pos, None, labels=labels)
    with torch.no_grad():
        if step_norm == "rms":  # a learnable scale: make it visible
            model.step_norm.weight.mul_(2.0)
            if coda:
                model.coda.final_layernorm.weight.mul_(2.0)
        out = model(ids, pos, None, labels=labels)
        w = getattr(model.step_norm, "weight", None)
        norm = {"rms": lambda v, w: _rms(v, w), "frms": lambda v, w: _rms(v),
                "identity": lambda v, w: v}[step_norm]
        rope = model.rotary_pos_emb(SEQ)
        h = model.embedding(input_ids=ids, position_ids=pos)
        for _ in range(3):
            h = norm(model.core(hidden_states=h, attention_mask=None, rotary_pos_emb=rope), w)
        r = h
        if coda:
            for layer in model.coda.layers:
                r, _ = layer(hidden_states=r, attention_mask=None, rotary_pos_emb=rope)
            r = norm(r, getattr(model.coda.final_layernorm, "weight", None))
        logits, _ = model.output_layer(r, weight=model.shared_embedding_or_output_weight())
        ref = model.compute_language_model_loss(labels, logits)
    return names, (out.objective - ref).abs().max().item()


@pytest.mark.parametrize("step_norm,coda", [("rms", 0), ("frms", 0), ("identity", 0),
                                            ("frms", 1), ("identity", 1), ("rms", 1)])
def test_step_norm_equals_manual_recurrence(step_norm, coda):
    (names, err), = run_distributed(_step_norm_manual, 1, step_norm, coda)
    assert err < 1e-5, err
    assert ("step_norm.weight" in names) == (step_norm == "rms")
    if coda:
        assert ("coda.final_layernorm.weight" in names) == (step_norm == "rms")


def _loss_and_grads(rank, world, scheme, step_norm):
    setup_parallel(world)
    model = _model(3, scheme, step_norm, coda=1)
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    out = model(ids, pos, None, labels=labels)
    out.objective.mean().backward()
    return out.objective.detach(), full_grads(model)


@pytest.mark.parametrize("scheme,step_norm", [("post", "rms"), ("sandwich", "frms"),
                                              ("magic", "identity")])
def test_norm_scheme_tp2_equals_tp1(scheme, step_norm):
    (obj1, g1), = run_distributed(_loss_and_grads, 1, scheme, step_norm)
    for obj2, g2 in run_distributed(_loss_and_grads, 2, scheme, step_norm):
        assert (obj1 - obj2).abs().max().item() < 1e-5
        assert g1.keys() == g2.keys()
        for k in g1:
            assert torch.allclose(g1[k], g2[k], atol=1e-5, rtol=1e-4), k
