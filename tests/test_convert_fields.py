"""No config.json field is silently ignored by import-hf (megaloop/convert/hf_families.py).

The walk: each supported family's config.json, as `transformers` writes it for a tiny model, key
by key (and inside the RoPE dict), each value changed in turn. A key import-hf calls *inert* must
leave `transformers`' own logits bit for bit unchanged (the same weights under the changed config:
an independent proof that it does not change the computation); a *checked* key's other value is
refused with a message naming it; an *honoured* key's other value changes the megaloop config or
is refused by name. An unknown key is refused. The configs of the small base models people
convert (as published) import with the megaloop config derived here by hand, and each refusal the
README lists is tested by name.
"""

import json

import pytest
import torch

from test_convert_families import _hf_config, _make_hf

FAMILIES = ["llama3", "qwen2", "mistral", "smollm", "qwen3"]


def _other(key, value):
    """A different value of the same kind."""
    if key in ("dtype", "torch_dtype"):
        return "bfloat16" if value != "bfloat16" else "float16"
    if key == "architectures":
        return ["GPT2LMHeadModel"]
    if key == "layer_types":
        return ["sliding_attention"] + value[1:]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, str):
        return value + "_other"
    if isinstance(value, list):
        return value + value[:1]
    assert value is None, (key, value)
    return 7


def _logits(config_dict, state, ids):
    import transformers

    cls = transformers.AutoConfig.for_model(config_dict["model_type"]).__class__
    model = transformers.AutoModelForCausalLM.from_config(cls.from_dict(config_dict))
    model = model.float().eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_every_config_field_is_honoured_checked_or_inert(family, tmp_path):
    from megaloop.convert.hf_families import field_role, model_config_from_hf

    hf = _make_hf(family, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    arch = cfg["architectures"][0]
    base = model_config_from_hf(cfg, 1)
    ids = torch.randint(0, cfg["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(0))
    expected = _logits(cfg, hf.state_dict(), ids)
    assert torch.equal(expected, hf(ids).logits.detach())  # the rebuild itself changes nothing
    roles = {}
    for key, value in cfg.items():
        roles[key] = role = field_role(arch, key)
        assert role != "unknown", (family, key)
        if isinstance(value, dict):  # the RoPE dict: walked below, key by key
            continue
        changed = {**cfg, key: _other(key, value)}
        if role == "inert":
            assert model_config_from_hf(changed, 1) == base, (family, key)
            assert torch.equal(_logits(changed, hf.state_dict(), ids), expected), (family, key)
        elif role == "checked":
            with pytest.raises(ValueError, match=key):
                model_config_from_hf(changed, 1)
        elif key == "vocab_size":  # the table's rows: import_hf's plan_vocab, not ModelConfig
            continue
        else:
            _assert_honoured(changed, base, key)
    for key, value in cfg["rope_parameters"].items():
        _assert_honoured({**cfg, "rope_parameters": {**cfg["rope_parameters"],
                                                     key: _other(key, value)}}, base, key)
    assert "checked" in roles.values() and "inert" in roles.values()
    with pytest.raises(ValueError, match="'frobnicate'.*delete them"):
        model_config_from_hf({**cfg, "frobnicate": 1}, 1)


def _assert_honoured(changed, base, key):
    from megaloop.convert.hf_families import model_config_from_hf

    try:
        assert model_config_from_hf(changed, 1) != base, key
    except ValueError as exc:
        assert key in str(exc), (key, str(exc))


# config.json of small base models as published (their Hugging Face repositories), trimmed of
# nothing: the keys a user's folder really has.
LLAMA_32_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256}
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False,
    "use_sliding_window": False, "vocab_size": 151936}
MISTRAL_7B_V03 = {
    "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": 32768}
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 576,
    "initializer_range": 0.041666666666666664, "intermediate_size": 1536,
    "is_llama_config": True, "max_position_embeddings": 8192, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30,
    "num_key_value_heads": 3, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.42.3",
    "use_cache": True, "vocab_size": 49152}


@pytest.mark.parametrize("cfg,expected", [
    (LLAMA_32_1B, dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192,
                       num_attention_heads=32, num_query_groups=8, kv_channels=64,
                       rotary_base=500000, use_rope_scaling=True, rope_scaling_factor=32.0,
                       add_qkv_bias=False, qk_layernorm=False,
                       untie_embeddings_and_output_weights=False, norm_epsilon=1e-5)),
    (QWEN25_05B, dict(num_layers=24, hidden_size=896, ffn_hidden_size=4864,
                      num_attention_heads=14, num_query_groups=2, kv_channels=64,
                      rotary_base=1000000, use_rope_scaling=False, add_qkv_bias=True,
                      qk_layernorm=False, untie_embeddings_and_output_weights=False,
                      norm_epsilon=1e-6)),
    (MISTRAL_7B_V03, dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                          num_attention_heads=32, num_query_groups=8, kv_channels=128,
                          rotary_base=1000000, use_rope_scaling=False, add_qkv_bias=False,
                          untie_embeddings_and_output_weights=True)),
    (SMOLLM2_135M, dict(num_layers=30, hidden_size=576, num_attention_heads=9,
                        num_query_groups=3, kv_channels=64, rotary_base=100000,
                        use_rope_scaling=False, init_method_std=0.041666666666666664,
                        untie_embeddings_and_output_weights=False)),
], ids=["llama-3.2-1b", "qwen2.5-0.5b", "mistral-7b-v0.3", "smollm2-135m"])
def test_published_configs_import(cfg, expected):
    from megaloop.convert.hf_families import model_config_from_hf

    model_cfg = model_config_from_hf(cfg, 128)
    model_cfg.validate()
    for name, value in expected.items():
        assert getattr(model_cfg, name) == value, name
    assert model_cfg.norm_scheme == "pre" and model_cfg.disable_bias_linear


def _llama3(**rope):
    return {**LLAMA_32_1B, "rope_scaling": {**LLAMA_32_1B["rope_scaling"], **rope}}


@pytest.mark.parametrize("cfg,message", [
    ({**MISTRAL_7B_V03, "sliding_window": 4096}, "sliding_window=4096"),  # Mistral 7B v0.1
    ({**QWEN25_05B, "use_sliding_window": True}, "use_sliding_window=True"),
    ({**QWEN25_05B, "layer_types": ["sliding_attention"] * 24}, "layer_types"),
    (_llama3(low_freq_factor=2.0), "low_freq_factor=2.0"),
    (_llama3(high_freq_factor=8.0), "high_freq_factor=8.0"),
    (_llama3(original_max_position_embeddings=4096), "original_max_position_embeddings=4096"),
    ({**LLAMA_32_1B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ({**LLAMA_32_1B, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
    ({**LLAMA_32_1B, "rope_theta": 10000.5}, "rope_theta 10000.5"),
    ({**LLAMA_32_1B, "attention_bias": True}, "attention_bias=True"),
    ({**LLAMA_32_1B, "mlp_bias": True}, "mlp_bias=True"),
    ({**LLAMA_32_1B, "hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({**LLAMA_32_1B, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({**SMOLLM2_135M, "rope_interleaved": True}, "rope_interleaved=True"),
    ({**QWEN25_05B, "use_mrope": True}, "use_mrope=True"),
    ({**QWEN25_05B, "architectures": ["Qwen2MoeForCausalLM"]}, "'Qwen2MoeForCausalLM'"),
    ({**QWEN25_05B, "quantization_config": {"bits": 4}}, "'quantization_config'"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_refusals_name_the_field(cfg, message):
    from megaloop.convert.hf_families import model_config_from_hf

    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        model_config_from_hf(cfg, 128)


def test_rope_settings_read_both_forms():
    """transformers 4.x writes rope_theta + rope_scaling, 5.x one rope_parameters dict; a
    llama3 dict without original_max_position_embeddings takes max_position_embeddings, as
    transformers does (refused here unless that is 8192)."""
    from megaloop.convert.hf_families import rope_settings

    new = {"rope_parameters": {"rope_theta": 500000.0, **_llama3()["rope_scaling"]}}
    assert rope_settings(LLAMA_32_1B) == rope_settings(new) == (500000, 32.0)
    assert rope_settings({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}) == \
        (1000000, None)
    missing = {k: v for k, v in LLAMA_32_1B["rope_scaling"].items()
               if k != "original_max_position_embeddings"}
    assert rope_settings({"max_position_embeddings": 8192, "rope_scaling": missing,
                          "rope_theta": 5e5}) == (500000, 32.0)
    with pytest.raises(ValueError, match="original_max_position_embeddings=131072"):
        rope_settings({"max_position_embeddings": 131072, "rope_scaling": missing})
    assert _hf_config("llama3").rope_parameters["factor"] == 32.0
