"""Which Hugging Face decoders import-hf reads, and what every field of their config.json does.

Four architectures share one computation (pre-norm RMSNorm decoder, SwiGLU MLP, rotary
embeddings, grouped-query attention, tied or untied head) and differ in a few switches:

    LlamaForCausalLM    Llama 2 / 3.x, SmolLM / SmolLM2   Llama 3.x RoPE scaling ("llama3")
    MistralForCausalLM  Mistral without sliding window    (with one: refused)
    Qwen2ForCausalLM    Qwen2 / Qwen2.5                   bias on q, k, v (--add-qkv-bias)
    Qwen3ForCausalLM    Qwen3                             per-head RMSNorm of q, k (--qk-layernorm)

Every key of config.json falls in exactly one of three sets, per architecture: HONOURED (becomes
a megaloop flag), CHECKED (megaloop implements one value; any other is refused by name) and
INERT (does not change the logits; the reason is written next to it). A key in none of them is
refused: import-hf cannot tell whether it changes the computation, so it never guesses.
"""

from __future__ import annotations

from megaloop.model.config import ModelConfig

# megatron-core's RotaryEmbedding._apply_scaling (0.16.1) fixes these three of Llama 3.x's four
# scaling constants; every published Llama 3.1 / 3.2 / 3.3 checkpoint uses exactly them. Another
# value is refused rather than approximated.
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# key -> the megaloop flag it becomes (rope_* are read by ``rope_settings``).
HONOURED = {
    "architectures": "the architecture (one of FAMILY_SWITCHES)",
    "vocab_size": "the embedding table's rows (--make-vocab-size-divisible-by)",
    "hidden_size": "--hidden-size",
    "intermediate_size": "--ffn-hidden-size",
    "num_hidden_layers": "--num-layers",
    "num_attention_heads": "--num-attention-heads",
    "num_key_value_heads": "--num-query-groups",
    "head_dim": "--kv-channels",
    "max_position_embeddings": "--max-position-embeddings",
    "rms_norm_eps": "--norm-epsilon",
    "tie_word_embeddings": "--untie-embeddings-and-output-weights",
    "initializer_range": "--init-method-std (the fresh exit gate and LoRA)",
    "attention_dropout": "--attention-dropout",
    "rope_theta": "--rotary-base",
    "rope_parameters": "--rotary-base, --use-rope-scaling, --rope-scaling-factor",
    "rope_scaling": "--use-rope-scaling, --rope-scaling-factor",
}

# key -> (accepted values or a test of the value, what megaloop implements / what to do instead).
CHECKED_COMMON = {
    "hidden_act": (("silu",), "only SwiGLU (silu) MLPs are supported"),
    "partial_rotary_factor": ((1.0,), "RoPE on every head dimension only"),
}
FALSE = (False, None)  # false, or null


def _all_full_attention(layer_types) -> bool:
    return all(kind == "full_attention" for kind in layer_types or [])


SLIDING_LAYERS = (_all_full_attention, "sliding-window layers are not supported (every layer "
                                       "must be 'full_attention')")
CHECKED_BY_FAMILY = {
    "LlamaForCausalLM": {
        "model_type": (("llama",), "a LlamaForCausalLM has model_type 'llama'"),
        "attention_bias": (FALSE, "a bias on q, k, v and o is not supported (Qwen2's bias on "
                                  "q, k, v is)"),
        "mlp_bias": (FALSE, "MLP biases are not supported"),
        # nanotron's key in SmolLM configs; transformers does not read it, and a true value
        # would say the weights expect interleaved RoPE, which transformers does not apply.
        "rope_interleaved": (FALSE, "interleaved RoPE is not what transformers computes"),
    },
    "MistralForCausalLM": {
        "model_type": (("mistral",), "a MistralForCausalLM has model_type 'mistral'"),
        "sliding_window": ((None,), "sliding-window attention is not supported (Mistral 7B "
                                    "v0.1 uses 4096; v0.2 / v0.3 have none)"),
    },
    "Qwen2ForCausalLM": {
        "model_type": (("qwen2",), "a Qwen2ForCausalLM has model_type 'qwen2'"),
        "use_sliding_window": (FALSE, "sliding-window attention is not supported"),
        "use_mrope": (FALSE, "multimodal RoPE (Qwen2-VL) is not supported"),
        "layer_types": SLIDING_LAYERS,
    },
    "Qwen3ForCausalLM": {
        "model_type": (("qwen3",), "a Qwen3ForCausalLM has model_type 'qwen3'"),
        "attention_bias": (FALSE, "a bias on q, k, v and o is not supported"),
        "use_sliding_window": (FALSE, "sliding-window attention is not supported"),
        "layer_types": SLIDING_LAYERS,
    },
}

INERT_COMMON = {
    "transformers_version": "the version that wrote the file",
    "torch_dtype": "storage dtype: import-hf reads fp32, training chooses --bf16",
    "dtype": "storage dtype: import-hf reads fp32, training chooses --bf16",
    "bos_token_id": "a tokenizer / generation setting",
    "eos_token_id": "a tokenizer / generation setting",
    "pad_token_id": "a tokenizer / generation setting (transformers only freezes that row's "
                    "gradient)",
    "use_cache": "a generation setting",
    "_name_or_path": "where the folder came from",
    "tokenizer_class": "a tokenizer setting",
    "output_attentions": "what transformers returns, not what it computes",
    "output_hidden_states": "what transformers returns, not what it computes",
    "return_dict": "what transformers returns, not what it computes",
}
SLIDING_UNUSED = "read by transformers only with use_sliding_window true (refused)"
INERT_BY_FAMILY = {
    "LlamaForCausalLM": {
        "pretraining_tp": "transformers no longer splits the projections by it (the split was "
                          "the same product)",
        "is_llama_config": "nanotron's marker in SmolLM configs; transformers does not read it",
    },
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"sliding_window": SLIDING_UNUSED, "max_window_layers": SLIDING_UNUSED},
    "Qwen3ForCausalLM": {"sliding_window": SLIDING_UNUSED, "max_window_layers": SLIDING_UNUSED},
}
FAMILY_SWITCHES = {  # architecture -> (add_qkv_bias, qk_layernorm)
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
SUPPORTED = tuple(FAMILY_SWITCHES)


def field_role(arch: str, key: str) -> str:
    """"honoured", "checked", "inert" or "unknown": how import-hf treats ``key`` of ``arch``."""
    if key in HONOURED:
        return "honoured"
    if key in CHECKED_COMMON or key in CHECKED_BY_FAMILY[arch]:
        return "checked"
    if key in INERT_COMMON or key in INERT_BY_FAMILY[arch]:
        return "inert"
    return "unknown"


def check_fields(cfg: dict) -> str:
    """The architecture of ``cfg`` after every key has been accounted for; ValueError naming
    the first key that is refused or unknown."""
    archs = cfg.get("architectures") or ["?"]
    arch = archs[0]
    if len(archs) != 1 or arch not in SUPPORTED:
        raise ValueError(f"config.json architectures {cfg.get('architectures')}: architecture "
                         f"{arch!r} is not supported; import-hf reads {', '.join(SUPPORTED)}")
    check_roles(cfg, arch, lambda key: field_role(arch, key) != "unknown",
                {**CHECKED_COMMON, **CHECKED_BY_FAMILY[arch]})
    return arch


def check_roles(cfg: dict, arch: str, known, checked: dict) -> None:
    """The rule every family reader applies (dense, looped, Nanbeige): each key of ``cfg`` has a
    role (``known(key)``), and each CHECKED key present holds an accepted value (``checked``:
    key -> (the accepted values, or a predicate; why another is refused)). ValueError naming
    the unknown keys, or the first refused value."""
    unknown = sorted(k for k in cfg if not known(k))
    if unknown:
        raise ValueError(f"config.json field(s) {unknown} are unknown to megaloop for {arch}, "
                         f"so it cannot tell whether they change the computation; if you know "
                         f"they do not, delete them from config.json")
    for key, (accepted, why) in checked.items():
        ok = accepted(cfg.get(key)) if callable(accepted) else cfg.get(key) in accepted
        if key in cfg and not ok:
            raise ValueError(f"config.json {key}={cfg[key]!r}: {why}")


def rope_settings(cfg: dict) -> tuple[int, float | None]:
    """(--rotary-base, --rope-scaling-factor or None for plain RoPE) of a config.json, in either
    form transformers writes: top-level ``rope_theta`` + ``rope_scaling`` (4.x) or one
    ``rope_parameters`` dict (5.x). ValueError for a scaling megaloop does not implement."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling")
    if legacy and params.get("rope_type", "default") != "default" and legacy != {
            k: v for k, v in params.items() if k != "rope_theta"}:
        raise ValueError("config.json has both rope_scaling and rope_parameters, and they "
                         "differ; keep one of them")
    if legacy:
        params = {**params, **legacy}
    kind = params.pop("rope_type", params.pop("type", "default"))
    theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    if theta != int(theta):
        raise ValueError(f"config.json rope_theta {theta} is not an integer; megaloop's "
                         f"--rotary-base is one")
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("config.json partial_rotary_factor: megaloop applies RoPE to every "
                         "head dimension only (1.0)")
    if kind == "default":
        if params:
            raise ValueError(f"config.json RoPE keys {sorted(params)} mean nothing to plain "
                             f"RoPE (rope_type 'default'); remove them")
        return int(theta), None
    if kind != "llama3":
        raise ValueError(f"config.json rope_type {kind!r}: megaloop implements plain RoPE "
                         f"('default') and Llama 3.x scaling ('llama3') only")
    # transformers falls back to max_position_embeddings when the original context is missing.
    params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    if "factor" not in params:
        raise ValueError("config.json RoPE scaling 'llama3' has no factor; add the checkpoint's "
                         "factor")
    factor = float(params.pop("factor"))
    for key, fixed in LLAMA3_FIXED.items():
        value = params.pop(key, None)
        if value != fixed:
            raise ValueError(f"config.json RoPE scaling 'llama3' has {key}={value}; megatron-core "
                             f"implements {key}={fixed} only (every Llama 3.x checkpoint uses it)")
    if params:
        raise ValueError(f"config.json RoPE scaling 'llama3' has keys {sorted(params)} that "
                         f"megaloop does not implement")
    return int(theta), factor


def model_config_from_hf(cfg: dict, divisible_by: int) -> ModelConfig:
    """The ModelConfig of a Llama / Mistral / Qwen2 / Qwen3 config.json; ValueError naming the
    field for anything megaloop does not compute (see the module docstring)."""
    arch = check_fields(cfg)
    qkv_bias, qk_norm = FAMILY_SWITCHES[arch]
    theta, factor = rope_settings(cfg)
    heads = cfg["num_attention_heads"]
    return ModelConfig(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"], num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        position_embedding_type="rope", rotary_base=theta,
        use_rope_scaling=factor is not None,
        rope_scaling_factor=factor if factor is not None else ModelConfig.rope_scaling_factor,
        normalization="RMSNorm", norm_epsilon=cfg.get("rms_norm_eps", 1e-6), swiglu=True,
        disable_bias_linear=True, add_qkv_bias=qkv_bias, qk_layernorm=qk_norm,
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
        init_method_std=cfg.get("initializer_range", 0.02),
        # These families have no residual dropout; attention dropout as the config says.
        hidden_dropout=0.0, attention_dropout=cfg.get("attention_dropout", 0.0),
        make_vocab_size_divisible_by=divisible_by, norm_scheme="pre")


def decoder_keys(model, loop, vocab_size: int) -> dict:
    """The Llama-family config.json keys of a looped decoder's shapes, as export-hf writes them
    for every looped layout (megaloop's, Ouro's, Nanbeige's): ``model`` a ModelConfig, ``loop`` a
    LoopConfig; num_hidden_layers counts the looped core."""
    heads = model.num_attention_heads
    return {
        "vocab_size": vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size or 4 * model.hidden_size,
        "num_hidden_layers": loop.num_core_layers(model.num_layers),
        "num_attention_heads": heads,
        "num_key_value_heads": model.num_query_groups or heads,
        "head_dim": model.kv_channels or model.hidden_size // heads,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_position_embeddings,
        "rms_norm_eps": model.norm_epsilon,
        "rope_theta": float(model.rotary_base),
        "initializer_range": model.init_method_std,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
    }
