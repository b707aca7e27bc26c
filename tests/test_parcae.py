"""Parcae ("Parcae", arXiv 2604.12946) from megaloop's flags (examples/recipes/parcae_from_scratch.sh):

(a) the recipe's flags build the published architecture: the smallest size built for real has
    the parameter count and shapes derived by hand below from Parcae's configuration, and every
    size's flags give Parcae's widths and layer counts;
(b) megaloop's tiny model equals an independent plain-torch Parcae forward
    (tests/parcae_reference.py, written from the published definition) fed the same weights,
    after every pass;
(c) a seeded bug in the reference (the decay without softplus, B applied to the state) breaks
    that equality, so (b) can fail;
(d) the recipe at SIZE=cpu trains end to end on CPU (its own flags, a few iterations).
"""

import json
import math
import os
import subprocess
import sys

import numpy
import pytest
import torch

from distributed import run_distributed, setup_parallel
import parcae_reference as ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "examples", "recipes", "parcae_from_scratch.sh")
VOCAB = 128
# Tolerance. megaloop runs in fp32; the reference runs in fp32 and in float64 (the exact value,
# to fp32's eyes). The log-probabilities reach |log p| ~ 25 here (random weights, 128 tokens),
# where one fp32 ulp is 2^-19 ~ 1.9e-6, and each fp32 computation lands a few ulp from the exact
# value because its sums run in another order (megatron-core's fused QKV GEMM and SDPA against
# separate projections and an explicit softmax) through 2 + 2 x 4 + 2 = 12 blocks. So: megaloop
# must be within twice the fp32 reference's own distance to float64 (plus 4 ulp) of float64. That
# is ~3e-5 here; a real mistake moves them by orders more (the seeded bugs by > 1e-2 = TOL x 1000).
TOL = 1e-5
IDS = torch.tensor([[5, 9, 17, 4, 30, 12, 7, 21, 90, 3, 64, 8],
                    [3, 3, 60, 101, 44, 8, 2, 90, 17, 17, 5, 127]])


def recipe_flags(size="cpu", parcae="small"):
    env = {**os.environ, "SIZE": size, "PARCAE": parcae, "PRINT_ARGS": "1"}
    out = subprocess.run(["bash", RECIPE, "/nonexistent/data", "/nonexistent/tok"], env=env,
                         check=True, capture_output=True, text=True).stdout
    return out.split()


def configs(size="cpu", parcae="small"):
    from megaloop.training.run_config import parse_args

    cfg = parse_args(recipe_flags(size, parcae))
    return cfg.model, cfg.loop


# --- (a) the architecture -------------------------------------------------------------------

# Parcae's configurations (parcae_lm/configs/parcae/*.py): layers in each of prelude, recurrent
# block and coda; width; heads (head dim 128); MLP 4x; vocab 32768; context 2048; tied.
PUBLISHED = {"small": (2, 768, 6), "medium": (4, 1024, 8), "large": (6, 1280, 10),
             "xlarge": (8, 1536, 12)}


def parcae_count(P, d, V=32768, heads=None):
    """Parameters of Parcae's model, by hand. Per block (pre-norm, no biases, a QK-norm without
    parameters): two norms (2d), q, k, v and output projections (4 d^2: heads x 128 = d), fc1
    and fc2 of the 4x MLP (2 x 4 d^2): 12 d^2 + 2d. 3P blocks; the tied embedding V d; the
    injection's A_log, dt_bias (d each) and B (d^2) and its source norm (d, Parcae's
    ln_prelude); C (d^2); the coda's final norm (d, Parcae's ln_f); the value embeddings: a
    [V, d] table and a [heads, 32] gate in every other of the 3P layers (3P / 2 of them)."""
    heads = heads or d // 128
    tables = sum(ref.has_ve(i, 3 * P) for i in range(3 * P))
    per_block = 12 * d * d + 2 * d
    return (3 * P * per_block + V * d + (d * d + 3 * d) + d * d + d
            + tables * (V * d + heads * 32))


def test_the_published_counts_follow_from_the_configs():
    """The hand count reproduces the sizes Parcae's configs are named after (140M, 370M, 770M,
    1.3B: value embeddings included)."""
    named = {"small": 140e6, "medium": 370e6, "large": 770e6, "xlarge": 1.3e9}
    for size, (P, d, heads) in PUBLISHED.items():
        count = parcae_count(P, d, heads=heads)
        assert abs(count / named[size] - 1) < 0.05, (size, count)
    assert parcae_count(2, 768, heads=6) == 144_323_136


@pytest.mark.parametrize("parcae", list(PUBLISHED))
def test_every_size_s_flags_are_parcae_s(parcae):
    model, loop = configs("full", parcae)
    P, d, heads = PUBLISHED[parcae]
    assert (loop.num_prelude_layers, loop.num_core_layers(model.num_layers),
            loop.num_coda_layers) == (P, P, P)
    assert (model.hidden_size, model.num_attention_heads, model.ffn_hidden_size) == \
        (d, heads, 4 * d)
    assert (model.kv_channels or d // heads) == 128
    assert (model.rotary_base, model.rotary_interleaved, model.position_embedding_type) == \
        (50000, True, "rope")
    assert (model.squared_relu, model.swiglu, model.qk_layernorm, model.norm_scheme) == \
        (True, False, True, "pre")
    assert model.value_embeddings and model.qk_layernorm_scale_free
    assert not model.untie_embeddings_and_output_weights
    assert model.max_position_embeddings == 2048
    assert math.isclose(model.init_method_std, math.sqrt(2 / (5 * d)), rel_tol=1e-4)
    assert (loop.input_injection, loop.injection_source, loop.injection_source_norm,
            loop.state_init, loop.readout_projection, loop.step_norm,
            loop.step_norm_placement) == ("parcae", "prelude", True, "noise", True,
                                          "identity", "readout")
    assert (loop.num_loops, loop.exit_loss, loop.backprop_last_steps) == (8, "last", 4)
    # depth 1 + Poisson(7) per step: mean 8, as Parcae's max(1, Poisson(8))
    assert (loop.random_depth_mean, loop.random_depth_sigma) == (7, 0)
    assert loop.supports(export="hf", model=model) is not None  # export-hf refuses it


def _small_shapes(rank, world):
    setup_parallel(1)
    from megaloop.model.looped_gpt import build_model

    model_cfg, loop = configs("full", "small")
    model_cfg.transformer_impl = "local"
    model = build_model(model_cfg, loop, 32768)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_the_smallest_size_built_has_the_hand_count_and_shapes():
    shapes, = run_distributed(_small_shapes, 1, timeout=300)
    d, f = 768, 3072
    assert sum(math.prod(s) for s in shapes.values()) == parcae_count(2, d) == 144_323_136
    assert shapes["embedding.word_embeddings.weight"] == (32768, d)
    assert not any(n.startswith("output_layer") for n in shapes)  # tied head
    assert (shapes["injection.A_log"], shapes["injection.dt_bias"], shapes["injection.B"],
            shapes["injection.source_norm.weight"], shapes["step_norm.weight"],
            shapes["coda.final_layernorm.weight"]) == ((d,), (d,), (d, d), (d,), (d, d), (d,))
    for part in ("prelude", "core", "coda"):
        assert sum(n.startswith(part + ".layers.") and n.endswith("linear_qkv.weight")
                   for n in shapes) == 2
        p = f"{part}.layers.1."
        assert shapes[p + "self_attention.linear_qkv.weight"] == (3 * d, d)
        assert shapes[p + "self_attention.linear_proj.weight"] == (d, d)
        assert not any("layernorm" in n and "self_attention" in n for n in shapes)
        # value embeddings in layer 1 of each block (layers 1, 3, 5 of 6), not in layer 0
        assert shapes[p + "self_attention.linear_qkv.value_embedding"] == (32768, d)
        assert shapes[p + "self_attention.linear_qkv.value_gate"] == (6, 32)
        assert f"{part}.layers.0.self_attention.linear_qkv.value_embedding" not in shapes
        assert shapes[p + "mlp.linear_fc1.weight"] == (f, d)  # not gated: relu^2, 4x
        assert shapes[p + "mlp.linear_fc2.weight"] == (d, f)


# --- (b), (c) against the reference ---------------------------------------------------------

def _reference_cfg(model, loop):
    return {"d": model.hidden_size, "heads": model.num_attention_heads,
            "ffn": model.ffn_hidden_size, "vocab": VOCAB, "prelude": loop.num_prelude_layers,
            "core": loop.num_core_layers(model.num_layers), "coda": loop.num_coda_layers,
            "mean_recurrence": loop.num_loops, "backprop_depth": loop.backprop_last_steps,
            "norm_eps": model.norm_epsilon, "rope_base": model.rotary_base}


def to_megaloop(w, cfg) -> dict:
    """Parcae's tensors under megaloop's names: what an import would do. q, k, v are fused per
    head ([q_h; k_h; v_h], megatron-core's layout without GQA); fc2 takes Parcae's proj halved
    (its MLP is relu^2 / 2, megatron-core's relu^2); each value-embedding table and gate goes
    to the linear_qkv of its layer."""
    d, heads = cfg["d"], cfg["heads"]
    hd = d // heads
    out = {"embedding.word_embeddings.weight": w["wte"],
           "injection.A_log": w["adapter.A_log"], "injection.dt_bias": w["adapter.dt_bias"],
           "injection.B": w["adapter.B"], "injection.source_norm.weight": w["ln_prelude"],
           "step_norm.weight": w["C"], "coda.final_layernorm.weight": w["ln_f"]}
    names = {"prelude": "prelude", "core_block": "core", "coda": "coda"}
    for (part, i) in ref.layer_ids(cfg):
        p, m = f"{part}.{i}.", f"{names[part]}.layers.{i}."
        qkv = torch.stack([w[p + "attn.c_q"].view(heads, hd, d), w[p + "attn.c_k"].view(heads, hd, d),
                           w[p + "attn.c_v"].view(heads, hd, d)], dim=1)
        out.update({m + "input_layernorm.weight": w[p + "norm_1"],
                    m + "self_attention.linear_qkv.weight": qkv.reshape(3 * d, d),
                    m + "self_attention.linear_proj.weight": w[p + "attn.c_proj"],
                    m + "pre_mlp_layernorm.weight": w[p + "norm_2"],
                    m + "mlp.linear_fc1.weight": w[p + "mlp.fc"],
                    m + "mlp.linear_fc2.weight": 0.5 * w[p + "mlp.proj"]})
        lid, idx = ref.layer_ids(cfg)[part, i]
        if f"value_embeds.{idx}" in w:
            out[m + "self_attention.linear_qkv.value_embedding"] = w[f"value_embeds.{idx}"]
            out[m + "self_attention.linear_qkv.value_gate"] = w[p + "attn.ve_gate"]
    return out


def _megaloop_per_step(rank, world, weights, x0):
    """megaloop's tiny Parcae (the recipe's SIZE=cpu flags, vocabulary 128) with ``weights``
    (Parcae's names), started from ``x0``: log-probs after every pass."""
    setup_parallel(1)
    from megaloop.model import recurrence
    from megaloop.model.looped_gpt import build_model

    model_cfg, loop = configs("cpu")
    model = build_model(model_cfg, loop, VOCAB)
    cfg = _reference_cfg(model_cfg, loop)
    state = to_megaloop(weights, cfg)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state.pop(name))
    assert not state, sorted(state)
    # the noise the loop starts from: the same x0 as the reference's ([s, b, d] here)
    model.initial_state.noise = lambda like: x0.transpose(0, 1).to(like)
    model.eval()
    pos = torch.arange(IDS.size(1))[None].expand_as(IDS)
    steps = []
    with torch.no_grad():
        ctx = recurrence.context(model, IDS, None, None, num_loops=loop.num_loops,
                                 read_every_step=True)
        carry = recurrence.begin(model, IDS, pos, ctx)
        recurrence.fold(model, carry, ctx, on_step=lambda t, c, out: steps.append(
            torch.log_softmax(out.logits.transpose(0, 1).float(), -1)))
    return torch.stack(steps), cfg


@pytest.fixture(scope="module")
def megaloop_and_weights():
    model_cfg, loop = configs("cpu")
    cfg = {"d": model_cfg.hidden_size, "heads": model_cfg.num_attention_heads,
           "ffn": model_cfg.ffn_hidden_size, "vocab": VOCAB, "prelude": loop.num_prelude_layers,
           "core": loop.num_core_layers(model_cfg.num_layers), "coda": loop.num_coda_layers,
           "mean_recurrence": loop.num_loops, "backprop_depth": loop.backprop_last_steps}
    weights = ref.random_weights(cfg, seed=3)
    x0 = torch.randn(*IDS.shape, cfg["d"], generator=torch.Generator().manual_seed(4)) * 0.1
    got, cfg = run_distributed(_megaloop_per_step, 1, weights, x0)[0]
    return got, weights, cfg, x0


def test_every_pass_equals_the_reference(megaloop_and_weights):
    """Log-probs after passes 1..4 (the CPU recipe's depth), value embeddings included, with
    Parcae's own QK-norm epsilon (torch's default: float32's machine epsilon in fp32, which the
    float64 run is given explicitly)."""
    got, weights, cfg, x0 = megaloop_and_weights
    want = torch.stack(ref.forward(weights, cfg, IDS, x0, got.size(0)))
    assert got.shape == want.shape == (4, *IDS.shape, VOCAB)
    exact = torch.stack(ref.forward({k: v.double() for k, v in weights.items()}, cfg, IDS,
                                    x0.double(), got.size(0),
                                    qk_eps=torch.finfo(torch.float32).eps))
    ulp = torch.finfo(torch.float32).eps * 2 ** math.floor(math.log2(exact.abs().max().item()))
    bound = 2 * (want.double() - exact).abs().max().item() + 4 * ulp
    err = (got.double() - exact).abs().amax(dim=(1, 2, 3))
    assert bound < 5 * TOL and (err < bound).all(), (err, bound)
    # the passes differ from one another (the loop does something at every step)
    assert (got[1:] - got[:-1]).abs().amax() > 1e-2


@pytest.mark.parametrize("bug", ["decay-without-softplus", "B-on-state",
                                 "value-gate-without-2"])
def test_a_seeded_bug_fails_the_comparison(megaloop_and_weights, bug):
    got, weights, cfg, x0 = megaloop_and_weights
    want = torch.stack(ref.forward(weights, cfg, IDS, x0, got.size(0), bug=bug))
    assert (got - want).abs().amax() > 1000 * TOL


def test_without_value_embeddings_the_comparison_fails(megaloop_and_weights):
    """The tables matter: the reference with them removed misses megaloop by far more than
    the tolerance."""
    got, weights, cfg, x0 = megaloop_and_weights
    bare = {k: v for k, v in weights.items() if not k.startswith("value_embeds.")}
    want = torch.stack(ref.forward(bare, cfg, IDS, x0, got.size(0)))
    assert (got - want).abs().amax() > 1000 * TOL


def test_the_injection_starts_as_parcae_s():
    """Parcae's initialisation: A = 1, decay sqrt(1/5) on every channel, B = I."""
    from types import SimpleNamespace

    from megaloop.model.injection import ParcaeInjection

    module = ParcaeInjection(SimpleNamespace(hidden_size=8, params_dtype=torch.float32,
                                             sequence_parallel=False))
    decay, dt = module.rates()
    assert torch.allclose(decay, torch.full((8,), math.sqrt(0.2)), atol=1e-6)
    assert torch.allclose(dt, torch.full((8,), 0.5 * math.log(5)), atol=1e-6)
    assert torch.equal(module.B, torch.eye(8)) and torch.equal(module.A_log, torch.zeros(8))


@pytest.mark.parametrize("loop_kw,flag", [
    ({"injection_source_norm": True}, "--injection-source-norm"),
    ({"readout_projection": True}, "--step-norm-placement readout"),
    ({"readout_projection": True, "step_norm_placement": "readout", "share_final_norm": True,
      "num_coda_layers": 1}, "--share-final-norm"),
])
def test_validation_names_the_flag(loop_kw, flag):
    from megaloop.model.config import LoopConfig

    with pytest.raises(ValueError, match=flag):
        LoopConfig(num_loops=2, **loop_kw).validate(3)


def test_squared_relu_refuses_swiglu():
    from megaloop.model.config import ModelConfig

    with pytest.raises(ValueError, match="--squared-relu"):
        ModelConfig(squared_relu=True, swiglu=True).validate()


# --- (d) the recipe on CPU ------------------------------------------------------------------

def test_the_cpu_recipe_trains(tmp_path):
    """examples/recipes/parcae_from_scratch.sh at SIZE=cpu, its own flags, on a corpus with
    structure (counting sequences), 24 iterations: the run ends cleanly and its loss falls."""
    from megaloop.data.indexed_format import IndexedWriter
    from ouro_reference import write_tokenizer

    write_tokenizer(str(tmp_path), VOCAB)  # a word-level tokenizer.json of 128 entries
    g = numpy.random.default_rng(0)
    docs = [(numpy.arange(s, s + 80) * step) % VOCAB
            for s, step in zip(g.integers(0, VOCAB, 200), g.integers(1, 4, 200))]
    writer = IndexedWriter(str(tmp_path / "corpus_text_document.bin"), numpy.uint16)
    writer.add_documents(numpy.concatenate(docs).astype(numpy.uint16),
                         numpy.array([len(d) for d in docs]))
    writer.finalize(str(tmp_path / "corpus_text_document.idx"))
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "SIZE": "cpu", "PYTHON": sys.executable,
           "TOKENIZER_TYPE": "HuggingFaceTokenizer", "SAVE_DIR": str(tmp_path / "run"),
           "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        ["bash", RECIPE, str(tmp_path / "corpus_text_document"), str(tmp_path),
         "--train-iters", "24", "--lr-wsd-decay-iters", "8",
         "--log-interval", "1", "--log-jsonl", str(log), "--save-interval", "1000",
         "--eval-interval", "1000", "--eval-iters", "1", "--transformer-impl", "local",
         "--distributed-backend", "auto"],
        env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-8000:])
    losses = [r["loss"] for r in map(json.loads, log.read_text().splitlines())
              if r["split"] == "train"]
    assert len(losses) >= 20, losses
    assert numpy.mean(losses[-4:]) < numpy.mean(losses[:4]) - 0.5, losses
