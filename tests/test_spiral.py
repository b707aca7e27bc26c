"""SpiralFormer multi-resolution recursion and the MeSH topology (megaloop/model/spiral.py).

Every check compares against an independent computation: causality by gradient (exact zeros
above the diagonal, and "SpiralFormer" (arXiv 2602.11698) Proposition 1's counterexample), the plain
loop, a loop-over-slots MeSH, a single rank, a hand FLOP count.
"""

import itertools
import math
import types

import pytest
import torch

from distributed import run_distributed, setup_parallel
from reference import full_grads, lm_batch

from megaloop.model import spiral, spiral_schedule
from flags import TEST_FLAGS, llama_style

VOCAB, SEQ, BATCH = 256, 24, 2


# --- operators: causality by gradient ------------------------------------------------------
def _spiral_map(h, g, omega, s, down, up, gen):
    """down -> a causal map on the latents -> up -> shift, with random operator weights."""
    L, b, d = h.shape
    scores = None
    if down == "self-aggregation":
        scores = h @ torch.randn(d, generator=gen, dtype=h.dtype)
    z = spiral.downscale(h, g, omega, scores)
    # Any causal map of the latents stands in for the core: latent j sees latents <= j only.
    z_hat = torch.tanh(torch.cumsum(z, 0) @ torch.randn(d, d, generator=gen, dtype=h.dtype))
    logits = z_hat @ torch.randn(d, g, generator=gen, dtype=h.dtype) if up == "allocation" else None
    return spiral.shift_right(spiral.upscale(z_hat, g, omega, L, logits), s)


def _jacobian(g, omega, s, down, up, L=19, d=3):
    h = torch.randn(L, 1, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    fn = lambda x: _spiral_map(x, g, omega, s, down, up,  # noqa: E731
                               torch.Generator().manual_seed(2))
    jac = torch.autograd.functional.jacobian(fn, h)  # [L, 1, d, L, 1, d]
    return jac.squeeze(4).squeeze(1).abs().sum((1, 3))  # [i, j]


OPS = list(itertools.product(["mean", "self-aggregation"], ["broadcast", "allocation"]))


@pytest.mark.parametrize("down,up", OPS)
def test_causal_for_every_offset_and_shift(down, up):
    for g in (2, 3, 4, 8):
        for omega in sorted({0, g // 2, g - 1}):
            for s in (g - 1, g, g + 2):
                jac = _jacobian(g, omega, s, down, up)
                future = torch.triu(jac, diagonal=1)  # d out_i / d in_j for j > i
                assert future.max().item() == 0.0, (g, omega, s, down, up)
                assert jac.sum() > 0


@pytest.mark.parametrize("down,up", OPS)
def test_shift_g_minus_2_is_not_causal(down, up):
    """SpiralFormer Proposition 1: s_t <= g_t - 2 lets a token see the end of its own chunk."""
    for g in (2, 4, 8):
        for omega in sorted({0, g // 2}):
            jac = _jacobian(g, omega, g - 2, down, up)
            assert torch.triu(jac, diagonal=1).max().item() > 0, (g, omega)


def test_chunk_map_matches_paper():
    """pi(i) = floor((i + omega) / g); a chunk is kept iff all its tokens are in the sequence
    (its last token i = (j + 1) g - omega - 1 < L): L_t = floor((L + omega) / g)."""
    L, g, omega = 11, 4, 2
    h = torch.arange(L, dtype=torch.float64).view(L, 1, 1) + 1.0
    z = spiral.downscale(h, g, omega)
    kept = [j for j in range(L) if (j + 1) * g - omega - 1 < L]  # 3 chunks: ends at 1, 5, 9
    assert len(kept) == 3
    expected = torch.zeros(len(kept), dtype=torch.float64)
    for i in range(L):
        j = (i + omega) // g
        if j in kept:
            expected[j] += (i + 1.0) / g
    assert torch.equal(z.view(-1), expected)
    # upscale with a broadcast puts lambda/g * z_hat[pi(i)] on token i; dropped tokens get 0
    u = spiral.upscale(z, g, omega, L).view(-1)
    for i in range(L):
        j = (i + omega) // g
        want = math.sqrt(g) / g * expected[j] if j in kept else 0.0
        assert abs(u[i].item() - float(want)) < 1e-12


def test_schedule_parsing_and_errors():
    from megaloop.model.config import LoopConfig

    assert spiral_schedule.parse_resolutions("1/8,1/4,1/2,1", 4) == [8, 4, 2, 1]
    assert spiral_schedule.parse_resolutions("coarse-to-fine", 4) == [8, 4, 2, 1]
    assert spiral_schedule.parse_resolutions("", 3) == []
    with pytest.raises(ValueError, match="1/g"):
        spiral_schedule.parse_resolutions("2/3", 1)
    with pytest.raises(ValueError, match="--num-loops"):
        LoopConfig(num_loops=3, loop_resolutions="1/2,1", loop_topology="mesh").validate(2)
    LoopConfig(num_loops=2, loop_resolutions="1,1").validate(2)


def test_feature_rules():
    from megaloop.training.run_config import parse_args

    base = [*TEST_FLAGS, "--num-loops", "2", "--num-layers", "2", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "100"]
    with pytest.raises(ValueError, match="--loop-topology"):
        parse_args(base + ["--loop-resolutions", "1/2,1"]).validate(world_size=1)
    with pytest.raises(ValueError, match="--random-depth-mean"):
        parse_args(base + ["--loop-topology", "mesh", "--exit-loss", "last",
                           "--random-depth-mean", "2"]).validate(world_size=1)


def test_parallel_refusals():
    from megaloop.training.run_config import parse_args

    base = [*TEST_FLAGS,
            "--num-loops", "4", "--loop-resolutions", "coarse-to-fine", "--loop-topology", "mesh",
            "--num-layers", "4", "--tensor-model-parallel-size", "2", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    with pytest.raises(ValueError, match="--sequence-parallel"):
        parse_args(base + ["--sequence-parallel"]).validate(world_size=2)
    with pytest.raises(ValueError, match="--seq-length 4 is shorter"):
        parse_args(base + ["--seq-length", "4", "--max-position-embeddings", "4"]).validate(
            world_size=2)
    # Pipeline parallelism is supported (tests/test_pipeline.py checks P = 2 == P = 1).
    parse_args(base + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "2",
                       "--micro-batch-size", "1"]).validate(world_size=4)


# --- MeSH against a loop over slots ----------------------------------------------------------
def test_mesh_matches_plain_reimplementation():
    config = types.SimpleNamespace(hidden_size=5, params_dtype=torch.float64,
                                   init_method_std=0.5, sequence_parallel=False)
    T, B, L, b, d = 3, 4, 6, 2, 5
    mesh = spiral.MeSH(config, T, B, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(L, b, d, generator=gen, dtype=torch.float64)
    updates = [torch.randn(L, b, d, generator=gen, dtype=torch.float64) for _ in range(T)]

    def route(lin, v, pos, batch):
        logits = [sum(lin.weight[k, c].item() * v[pos, batch, c].item() for c in range(d))
                  + lin.bias[k].item() for k in range(B)]
        top = max(logits)
        e = [math.exp(q - top) for q in logits]
        return [q / sum(e) for q in e]

    # Reference: slot by slot, token by token, in plain Python numbers.
    ref_out = torch.zeros(L, b, d, dtype=torch.float64)
    for pos, batch in itertools.product(range(L), range(b)):
        xv = x[pos, batch].tolist()
        m = [xv] + [[0.0] * d for _ in range(B - 1)]
        w, r = route(mesh.write[0], x, pos, batch), route(mesh.read[0], x, pos, batch)
        m = [[m[k][c] + w[k] * xv[c] for c in range(d)] for k in range(B)]
        hv = [sum(r[k] * m[k][c] for k in range(B)) for c in range(d)]
        for t in range(1, T + 1):
            hcur = torch.tensor(hv, dtype=torch.float64).view(1, 1, d)
            w = route(mesh.write[t], hcur, 0, 0)
            r = route(mesh.read[t], hcur, 0, 0)
            uv = updates[t - 1][pos, batch].tolist()
            m = [[m[k][c] + w[k] * uv[c] for c in range(d)] for k in range(B)]
            hv = [sum(r[k] * m[k][c] for k in range(B)) for c in range(d)]
        f = route(mesh.final_read, torch.tensor(hv, dtype=torch.float64).view(1, 1, d), 0, 0)
        ref_out[pos, batch] = torch.tensor([sum(f[k] * m[k][c] for k in range(B))
                                            for c in range(d)], dtype=torch.float64)
    with torch.no_grad():
        h, memory = mesh.begin(x)
        for t in range(1, T + 1):
            h, memory = mesh.step(updates[t - 1], h, memory, t)
        out = mesh.finish(h, memory)
    assert (out - ref_out).abs().max().item() < 1e-12


# --- the model --------------------------------------------------------------------------------
def _model(T=4, resolutions="1/8,1/4,1/2,1", topology="mesh", down="self-aggregation",
           up="allocation", shift="overlap", offset="half", exit_loss="expected", prelude=1,
           coda=1):
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    model_cfg = llama_style(num_layers=2 + prelude + coda, hidden_size=32, num_attention_heads=4,
                            max_position_embeddings=SEQ, num_query_groups=2)
    loop = LoopConfig(num_loops=T, num_prelude_layers=prelude, num_coda_layers=coda,
                      exit_loss=exit_loss, loop_resolutions=resolutions, loop_topology=topology,
                      resolution_down=down, resolution_up=up, resolution_shift=shift,
                      resolution_offset=offset)
    loop.validate(model_cfg.num_layers)
    return build_model(model_cfg, loop, VOCAB, tp_size=torch.distributed.get_world_size())


def _model_causality(rank, world, cases):
    setup_parallel(world)
    results = []
    for kw in cases:
        model = _model(**kw)
        ids, pos, _ = lm_batch(VOCAB, SEQ, 1)
        captured = {}

        def hook(module, args, output):
            output.retain_grad()
            captured["emb"] = output
            return output

        handle = model.embedding.register_forward_hook(hook)
        logits = model(ids, pos, None)  # [1, s, v]
        handle.remove()
        worst_future, some_past = 0.0, 0.0
        for i in range(0, SEQ, 5):
            captured["emb"].grad = None
            logits[0, i].sum().backward(retain_graph=True)
            grad = captured["emb"].grad[:, 0].abs().sum(-1)  # [s]
            worst_future = max(worst_future, grad[i + 1:].max().item() if i + 1 < SEQ else 0.0)
            some_past = max(some_past, grad[: i + 1].max().item())
        results.append((worst_future, some_past))
    return results


def test_model_is_causal_by_gradient():
    cases = [dict(topology="mesh"), dict(topology="anchor", down="mean", up="broadcast"),
             dict(topology="mesh", shift="parallel", offset="zero", down="mean"),
             dict(topology="anchor", resolutions="1/3,1/5,1", T=3, up="broadcast")]
    for worst_future, some_past in run_distributed(_model_causality, 1, cases)[0]:
        assert worst_future == 0.0 and some_past > 0.0


def test_model_shift_g_minus_2_leaks_the_future(monkeypatch):
    monkeypatch.setattr(spiral, "shift", lambda g, kind: max(g - 2, 0))
    (res,) = run_distributed(_model_causality, 1, [dict(topology="anchor")])[0]
    assert res[0] > 0.0


def _full_res_vs_plain(rank, world):
    from megaloop.parallel.initialize import set_seed

    setup_parallel(world)
    out = []
    for kw in (dict(resolutions="1,1,1", topology="plain"), dict(resolutions="", topology="plain")):
        set_seed(11)  # the same initial weights for both
        model = _model(T=3, **kw)
        ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
        res = model(ids, pos, None, labels=labels)
        res.objective.mean().backward()
        out.append((res.objective.detach(), full_grads(model), model.spiral is None))
    return out


def test_full_resolution_schedule_equals_plain_loop():
    (spiral_run, plain_run), = run_distributed(_full_res_vs_plain, 1)
    assert not spiral_run[2] and plain_run[2]  # the first went through the spiral path
    assert torch.equal(spiral_run[0], plain_run[0])
    assert spiral_run[1].keys() == plain_run[1].keys()
    for k in spiral_run[1]:
        assert torch.equal(spiral_run[1][k], plain_run[1][k]), k


def _loss_and_grads(rank, world, kw):
    setup_parallel(world)
    model = _model(**kw)
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    out = model(ids, pos, None, labels=labels)
    out.objective.mean().backward()
    return out.objective.detach(), full_grads(model)


@pytest.mark.parametrize("kw", [dict(topology="mesh"),
                                dict(topology="anchor", down="mean", up="broadcast")])
def test_tp2_equals_tp1(kw):
    (obj1, g1), = run_distributed(_loss_and_grads, 1, kw)
    for obj2, g2 in run_distributed(_loss_and_grads, 2, kw):
        assert (obj1 - obj2).abs().max().item() < 1e-5
        assert g1.keys() == g2.keys()
        assert any("spiral.mesh" in k for k in g1) == (kw["topology"] == "mesh")
        for k in g1:
            assert torch.allclose(g1[k], g2[k], atol=1e-5, rtol=1e-4), k


# --- FLOPs --------------------------------------------------------------------------------------
def test_flops_against_hand_count():
    from megaloop.model.config import LoopConfig
    from megaloop.training.metrics import flops_per_iteration

    # h=8, 2 heads (head dim 4, no GQA), ffn 16, SwiGLU; 1 + 1 x {1/4, 1} + 1, MeSH B=3, L=16.
    model = llama_style(num_layers=3, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16)
    loop = LoopConfig(num_loops=2, num_prelude_layers=1, num_coda_layers=1, exit_loss="last",
                      loop_resolutions="1/4,1", loop_topology="mesh", mesh_slots=3)
    L, V = 16, 10
    dense = 2 * 8 * 24 + 2 * 8 * 8 + 3 * 2 * 8 * 16          # QKV, out proj, SwiGLU: 1280 / token
    full_layer = L * (dense + 4 * L * 8)                       # attention 4 L (heads*head_dim)
    coarse_layer = 4 * (dense + 4 * 4 * 8)                     # L_1 = 4 latents
    operators = L * 2 * 8 + 4 * 2 * 8 * 4                      # scorer per token, allocation/latent
    routers = L * (2 * 2 + 2 + 1) * 2 * 8 * 3                  # write+read x2 steps, transit., final
    head = L * 2 * 8 * V                                        # `last`: one readout, no gate
    forward = 2 * full_layer + full_layer + coarse_layer + operators + routers + head
    got = flops_per_iteration(model, loop, V, L, global_batch=1)
    assert abs(got - 3 * forward) < 1e-6 * got, (got, 3 * forward)


def test_hf_export_refuses_spiral_and_mesh():
    from megaloop.convert.hf_export import check_exportable
    from megaloop.model.config import LoopConfig

    for kw in (dict(loop_resolutions="1/2,1", loop_topology="anchor"), dict(loop_topology="mesh")):
        with pytest.raises(ValueError, match="SpiralFormer"):
            check_exportable(llama_style(), LoopConfig(num_loops=2, exit_loss="last", **kw))


# --- attention probes -----------------------------------------------------------------------
def test_probe_metrics_by_hand():
    from megaloop.eval.probes import key_marginal_entropy, local_attention_mass

    # Uniform causal attention over 4 positions: rows 1, 1/2, 1/3, 1/4.
    A = torch.tril(torch.ones(4, 4))
    A = (A / A.sum(-1, keepdim=True)).view(1, 1, 4, 4)
    p = [(1 + 1 / 2 + 1 / 3 + 1 / 4) / 4, (1 / 2 + 1 / 3 + 1 / 4) / 4, (1 / 3 + 1 / 4) / 4,
         (1 / 4) / 4]
    H = -sum(x * math.log(x) for x in p)
    assert abs(key_marginal_entropy(A).item() - H) < 1e-6
    # window 2: the key itself and the one before: 1, 1, 2/3, 1/2
    assert abs(local_attention_mass(A, 2).item() - (1 + 1 + 2 / 3 + 1 / 2) / 4) < 1e-6


def _probe_run(rank, world):
    from megaloop.eval.probes import AttentionProbe, attention_probs

    setup_parallel(world)
    model = _model(topology="anchor")
    # The recomputed probabilities reproduce what core attention returned.
    attn = model.core.layers[0].self_attention.core_attention
    errs = []

    def check(module, args, kwargs, out):
        q, k, v = args[:3]
        probs = attention_probs(q, k, 1.0 / math.sqrt(q.size(-1)))
        v = v.repeat_interleave(q.size(2) // v.size(2), dim=2)
        ctx = torch.einsum("bhqk,kbhd->qbhd", probs, v).reshape(out.shape)
        errs.append((ctx - out).abs().max().item())

    h = attn.register_forward_hook(check, with_kwargs=True)
    probe = AttentionProbe(model)
    ids, pos, _ = lm_batch(VOCAB, SEQ, BATCH)
    with torch.no_grad():
        model(ids, pos, None)
    h.remove()
    probe.close()
    return max(errs), probe.results()


def test_attention_probe_rows_per_step_layer_head():
    err, rows = run_distributed(_probe_run, 1)[0]
    assert err < 1e-5
    # 4 steps x 2 core layers x 4 heads; at 1/8 a 24-token sequence has 3 latents.
    assert len(rows) == 4 * 2 * 4
    assert {r["resolution"] for r in rows} == {"1/8", "1/4", "1/2", "1"}
    for r in rows:
        L_t = SEQ // {"1/8": 8, "1/4": 4, "1/2": 2, "1": 1}[r["resolution"]]
        assert 0.0 <= r["entropy"] <= math.log(L_t) + 1e-6 and 0.0 < r["lam"] <= 1.0 + 1e-6
        assert abs(r["entropy_norm"] - r["entropy"] / math.log(L_t)) < 1e-6


def _prefix_logits(rank, world, flags):
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    setup_parallel(world)
    loop = LoopConfig(num_loops=3, **flags)
    model = build_model(llama_style(num_layers=2, hidden_size=32, num_attention_heads=4,
                                    max_position_embeddings=24), loop, VOCAB)
    model.eval()
    ids, pos, _ = lm_batch(VOCAB, 24, 2)
    with torch.no_grad():
        full = model(ids, pos, None)
        return max((model(ids[:, :n], pos[:, :n], None) - full[:, :n]).abs().max().item()
                   for n in range(1, 24))


@pytest.mark.parametrize("flags", [
    {"loop_resolutions": "1/4,1/2,1", "loop_topology": "anchor"},
    {"loop_resolutions": "1/8,1/4,1", "loop_topology": "mesh", "resolution_offset": "zero",
     "resolution_shift": "parallel"},
])
def test_outputs_do_not_depend_on_later_tokens(flags):
    """Prefix consistency, which causality by gradient does not cover: a token's output must
    not change with the number of tokens after it. (With L_t = floor(L / g) a chunk whose tokens
    had all arrived was dropped at some lengths, changing earlier tokens' outputs by ~0.5.)"""
    assert run_distributed(_prefix_logits, 1, flags)[0] < 1e-5
