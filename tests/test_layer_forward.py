"""megaloop's inference forward of the layers (megaloop/model/layer_forward.py) against
megatron-core's own layer forward, through the batching engine.

The same model decodes the same staggered requests (different prompt lengths, chunked prefill,
so masked multi-token calls after a cache as well as single-token decode) once with each forward
(``EngineConfig.layer_forward``), for every layer form the fast forward claims: grouped-query
attention, query/key norms, biases, GELU and SwiGLU, LayerNorm and RMSNorm, learned and rotary
positions (halves and interleaved pairs, a partial rotary dimension), every norm scheme, an
injection and timestep conditioning, early exit (rows leave the batch mid-forward), the
one-slot KV policies, and tensor parallelism over two ranks. The model runs in float64, so the
two forwards' own rounding (about 1e-16 relative, reassociated sums over at most a few hundred
terms through a dozen layers) stays far below float32's: the engine's float32 log-probabilities
must then agree to within a few float32 ulps, ``ULPS`` units of 2**-23 times the magnitude,
which any real difference (a misplaced rotation, a wrong head split, a missing norm or bias,
changing logits at the 1e-3 level and more) exceeds by orders of magnitude. Each case also
checks that the engine did decode with megaloop's forward (``forward_impl``), so an unnoticed
fall back to megatron-core's would fail it; and models whose layers the fast forward does not
compute (stepwise LoRA, SpiralFormer) are decoded by megatron-core's layers, saying why.
"""

import pytest
import torch

from distributed import run_distributed, setup_parallel
from flags import llama_style

VOCAB = 256
V = VOCAB - 6
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24], [30, 31]]
ARRIVE = [0, 1, 1, 3]
MAX_TOKENS = [6, 5, 6, 4]
ULPS = 8  # float32 units in the last place the two forwards' float32 outputs may differ by

CASES = {
    "llama": ({}, {}),
    "gqa": ({"num_query_groups": 2, "group_query_attention": True}, {}),
    "gqa-qknorm": ({"num_query_groups": 2, "group_query_attention": True,
                    "qk_layernorm": True}, {}),
    "gpt-biases": ({"swiglu": False, "position_embedding_type": "learned_absolute",
                    "normalization": "LayerNorm", "disable_bias_linear": False,
                    "add_qkv_bias": True}, {}),
    "interleaved-partial-rope": ({"rotary_percent": 0.5}, {}, "interleaved"),
    "pre-norms": ({"norm_scheme": "pre"}, {}),
    "sandwich": ({"norm_scheme": "sandwich"}, {}),
    "post": ({"norm_scheme": "post"}, {}),
    "magic": ({"norm_scheme": "magic"}, {}),
    "injection-adaln": ({}, {"input_injection": "scalar-mix", "timestep_conditioning": "adaln"}),
}


def _model(model_kw, loop_kw, tp=1, interleaved=False):
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    model_cfg = llama_style(**{"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
                               "max_position_embeddings": 64, "transformer_impl": "local",
                               **model_kw})
    loop = LoopConfig(num_loops=3, num_prelude_layers=1, num_coda_layers=1, **loop_kw)
    torch.manual_seed(1)
    model = build_model(model_cfg, loop, VOCAB, tp_size=tp)
    with torch.no_grad():
        for p in model.parameters():  # away from init's symmetric values (unit norm scales)
            p.add_(0.05 * torch.randn_like(p))
        model.exit_gate.linear.weight.mul_(40.0)  # rows exit at their own step
    if interleaved:  # (no flag: megatron-core's option, set on every config copy and the table)
        for module in model.modules():
            if hasattr(getattr(module, "config", None), "rotary_interleaved"):
                module.config.rotary_interleaved = True
        model.rotary_pos_emb.rotary_interleaved = True
    return model.double().eval()


def _decode(model, layer_forward, policy="full", rule=None):
    """Every request's (tokens, [n, V] log-probabilities, depths), and the engine's forward."""
    from megaloop.inference.early_exit import parse_exit
    from megaloop.inference.engine import EngineConfig, InferenceEngine
    from megaloop.inference.generate import SamplingParams

    engine = InferenceEngine(model, V, kv_policy=policy, exit_rule=rule and parse_exit(rule),
                             config=EngineConfig(max_sequence_length=32, max_batch=8,
                                                 block_size=4, prefill_chunk=3,
                                                 layer_forward=layer_forward))
    requests, step = [], 0
    while len(requests) < len(PROMPTS) or engine.has_work():
        for i, prompt in enumerate(PROMPTS):
            if ARRIVE[i] == step:
                requests.append(engine.add(prompt, MAX_TOKENS[i], SamplingParams(seed=i + 1),
                                           record_logprobs=True, ignore_eos=True))
        engine.step()
        step += 1
    return [(r.out, torch.stack(r.logprobs), r.depths) for r in requests], engine.forward_impl


def _compare(fast, slow):
    (got, impl), (want, _) = fast, slow
    assert impl == "megaloop", impl
    for (tokens, logp, depths), (tokens0, logp0, depths0) in zip(got, want):
        assert tokens == tokens0 and depths == depths0
        bound = ULPS * 2.0 ** -23 * logp0.abs().clamp(min=1.0)
        assert ((logp - logp0).abs() <= bound).all(), (logp - logp0).abs().max()


def _pair(rank, world, name, policy="full", rule=None):
    setup_parallel(world)
    model_kw, loop_kw, *rest = CASES[name]
    model = _model(model_kw, loop_kw, tp=world, interleaved=bool(rest))
    fast = _decode(model, "auto", policy, rule)
    slow = _decode(model, "megatron-core", policy, rule)
    return fast, slow


@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_forward_equals_megatron_core(name):
    fast, slow = run_distributed(_pair, 1, name)[0]
    _compare(fast, slow)


@pytest.mark.parametrize("policy,rule", [("full", "q:0.5"), ("first-step", None),
                                         ("shared-mod-2", "kl:0.01")])
def test_layer_forward_under_kv_policies_and_early_exit(policy, rule):
    fast, slow = run_distributed(_pair, 1, "llama", policy, rule)[0]
    _compare(fast, slow)
    if rule == "q:0.5":  # rows did leave the loop early (the rotary angles follow them)
        assert any(d < 3 for _, _, depths in fast[0] for d in depths)


def test_layer_forward_tensor_parallel():
    """TP = 2 (row-parallel sums reduced over the group), grouped-query attention."""
    for fast, slow in run_distributed(_pair, 2, "gqa-qknorm"):
        _compare(fast, slow)


def _fallbacks(rank, world):
    from megaloop.model.layer_forward import unsupported

    setup_parallel(world)
    lora = _model({}, {"lora_rank": 2})
    spiral = _model({}, {})
    spiral.config.fp32_residual_connection = True
    return unsupported(lora), unsupported(spiral), unsupported(_model({}, {}))


def test_layers_it_cannot_compute_stay_on_megatron_core():
    lora, fp32_residual, plain = run_distributed(_fallbacks, 1)[0]
    assert plain is None
    assert "linear_qkv" in lora and "megatron-core" in lora
    assert "fp32 residual" in fp32_residual
