"""Looped Hugging Face folders: Ouro's (``OuroForCausalLM``, ``model_type: ouro``) and the ones
export-hf writes (``MegaloopForCausalLM`` or Ouro's names) -> megaloop's configs.

Ouro's computation is megaloop's Ouro-style model: the whole decoder is the looped core (no
prelude or coda), every layer normalizes the input and the output of both sub-layers
(``--norm-scheme ouro``), the final norm runs after every step and its output is the next step's input
(``--step-norm-placement recurrent``), and a linear exit gate reads every step
(``model.early_exit_gate``). Every key of config.json falls in one of three sets, as for the dense
families (``hf_families``): HONOURED (becomes a megaloop setting), CHECKED (megaloop implements one
value; another is refused by name) and INERT (does not change the logits; the reason is beside
it). Any other key is refused: the reader cannot tell whether it changes the computation.

``early_exit_threshold`` and ``early_exit_step`` are how Ouro's code picks the step a token is
read at; they become the model's default exit rule (``default_exit``): the run config's
``generation`` section, which generate, serve and lm-eval use unless ``--exit`` says otherwise.

Nanbeige4.2 (``NanbeigeForCausalLM``) is read through ``hf_nanbeige``, which checks its keys and
turns them into this form (``export_form``). Huginn (``RavenForCausalLM``) has keys and tensor
names of its own: ``looped_configs`` and ``default_exit`` hand it to ``hf_huginn``; Parcae's
folders (``_class_name: ParcaeConfig``) likewise to ``hf_parcae``; LoopFormer's
(``model_type: loopformer``, or a folder holding its train.py checkpoint) to ``hf_loopformer``.

This module is the form both directions share: ``hf_export`` writes it and imports from here
what the modeling file implements (``check_exportable``) and the exit rule's keys
(``threshold_keys``, the inverse of ``default_exit``); nothing here imports ``hf_export``.
"""

from __future__ import annotations

from megaloop.convert import hf_huginn, hf_loopformer, hf_nanbeige, hf_parcae
from megaloop.convert.hf_families import FALSE, SLIDING_LAYERS, check_roles, rope_settings
from megaloop.model.config import LoopConfig, ModelConfig

# architecture -> model_type.
LOOPED_ARCHITECTURES = {"OuroForCausalLM": "ouro", "MegaloopForCausalLM": "megaloop"}
EXPORT_ARCHITECTURES = tuple(LOOPED_ARCHITECTURES)

# config.json keys an export may lack: the Ouro layout's values (what configuration_megaloop.py
# defaults).
EXPORT_DEFAULTS = {
    "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "initializer_range": 0.02,
    "tie_word_embeddings": False, "total_ut_steps": 4, "norm_scheme": "ouro", "qk_norm": False,
    "num_prelude_layers": 0, "num_coda_layers": 0, "step_norm_placement": "recurrent",
    "use_exit_gate": True, "input_injection": "none", "injection_source": "embedding",
    "lora_rank": 0, "lora_alpha": None, "lora_steps": 0, "qkv_bias": False, "rope_scaling": None,
    "attention_dropout": 0.0,
}

HONOURED = {
    "architectures": "Ouro's or megaloop's looped model (LOOPED_ARCHITECTURES)",
    "model_type": "checked against the architecture",
    "vocab_size": "the embedding table's rows",
    "hidden_size": "--hidden-size",
    "intermediate_size": "--ffn-hidden-size",
    "num_hidden_layers": "--num-layers (the looped core; plus prelude and coda)",
    "num_attention_heads": "--num-attention-heads",
    "num_key_value_heads": "--num-query-groups",
    "head_dim": "--kv-channels",
    "max_position_embeddings": "--max-position-embeddings",
    "rms_norm_eps": "--norm-epsilon",
    "rope_theta": "--rotary-base",
    "rope_scaling": "--use-rope-scaling, --rope-scaling-factor (Llama 3.x form only)",
    "rope_parameters": "--rotary-base, --use-rope-scaling, --rope-scaling-factor",
    "tie_word_embeddings": "--untie-embeddings-and-output-weights",
    "initializer_range": "--init-method-std",
    "attention_dropout": "--attention-dropout",
    "total_ut_steps": "--num-loops",
    "early_exit_threshold": "the default exit rule (q:<threshold>; 1.0: full depth)",
    "early_exit_step": "the default exit rule (fixed:<step + 1>), before the threshold",
    # megaloop's own keys (export-hf writes them for models that are not Ouro-style)
    "norm_scheme": "--norm-scheme",
    "qk_norm": "--qk-layernorm",
    "qkv_bias": "--add-qkv-bias",
    "num_prelude_layers": "--num-prelude-layers",
    "num_coda_layers": "--num-coda-layers",
    "step_norm_placement": "--step-norm-placement",
    "use_exit_gate": "the exit gate (--exit-loss last has none)",
    "input_injection": "--input-injection",
    "injection_source": "--injection-source",
    "lora_rank": "--lora-rank",
    "lora_alpha": "--lora-alpha",
    "lora_steps": "one adapter per loop step (must equal total_ut_steps)",
}
CHECKED = {
    "hidden_act": (("silu",), "only SwiGLU (silu) MLPs are supported"),
    "use_sliding_window": (FALSE, "sliding-window attention is not supported"),
    "layer_types": SLIDING_LAYERS,
    "attention_bias": (FALSE, "a bias on q, k, v and o is not supported (qkv_bias is)"),
    "mlp_bias": (FALSE, "MLP biases are not supported"),
    "partial_rotary_factor": ((1.0,), "RoPE on every head dimension only"),
}
INERT = {
    "transformers_version": "the version that wrote the file",
    "torch_dtype": "storage dtype: megaloop reads fp32, training chooses --bf16",
    "dtype": "storage dtype: megaloop reads fp32, training chooses --bf16",
    "bos_token_id": "a tokenizer setting (the folder's tokenizer is carried along)",
    "eos_token_id": "a tokenizer / generation setting (megaloop stops at the tokenizer's "
                    "end-of-text token)",
    "pad_token_id": "a tokenizer setting (transformers only freezes that row's gradient)",
    "use_cache": "a generation setting",
    "auto_map": "where the folder's own modeling code is; megaloop computes the model itself",
    "_name_or_path": "where the folder came from",
    "tokenizer_class": "a tokenizer setting",
    "sliding_window": "read only with use_sliding_window true (refused)",
    "max_window_layers": "read only with use_sliding_window true (refused)",
    "chunk_size": "read by Ouro's modeling code, never used by its forward",
    "output_attentions": "what transformers returns, not what it computes",
    "output_hidden_states": "what transformers returns, not what it computes",
    "return_dict": "what transformers returns, not what it computes",
}


def check_exportable(model: ModelConfig, loop: LoopConfig | None = None) -> None:
    """Refuse what the modeling file (``hf_modeling/``) does not implement, naming the flag (the
    rules are ``LoopConfig.supports(export="hf")``'s; without ``loop`` only the architecture's).
    export-hf refuses such a model before writing; ``looped_configs`` refuses a config.json that
    describes one, so a folder this module reads is one the export could have written."""
    reason = (loop or LoopConfig()).supports(export="hf", model=model)
    if reason:
        raise ValueError(reason)


def is_looped_config(cfg: dict) -> bool:
    """Whether config.json describes a looped model this module reads (Huginn's through
    ``hf_huginn``, Parcae's through ``hf_parcae``)."""
    arch = (cfg.get("architectures") or ["?"])[0]
    return arch in LOOPED_ARCHITECTURES or cfg.get("model_type") in ("ouro", "megaloop") or \
        hf_nanbeige.is_nanbeige(cfg) or hf_huginn.is_huginn(cfg) or hf_parcae.is_parcae(cfg) or \
        hf_loopformer.is_loopformer(cfg)


def export_form(cfg: dict) -> dict:
    """``cfg`` in the keys this module reads: a Nanbeige config.json translated (after every
    key of it is checked: ``hf_nanbeige.export_form``), any other as it is."""
    return hf_nanbeige.export_form(cfg) if hf_nanbeige.is_nanbeige(cfg) else cfg


def check_fields(cfg: dict) -> str:
    """The architecture of a looped config.json after every key is accounted for; ValueError
    naming the first key refused or unknown."""
    archs = cfg.get("architectures") or ["?"]
    arch = archs[0]
    if len(archs) != 1 or arch not in LOOPED_ARCHITECTURES or \
            cfg.get("model_type") != LOOPED_ARCHITECTURES[arch]:
        raise ValueError(f"config.json (architectures {cfg.get('architectures')}, model_type "
                         f"{cfg.get('model_type')!r}) is not a looped model megaloop reads: "
                         f"{', '.join(f'{a} / {t}' for a, t in LOOPED_ARCHITECTURES.items())}")
    check_roles(cfg, arch, lambda k: k in HONOURED or k in CHECKED or k in INERT, CHECKED)
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in cfg]
    if missing:
        raise ValueError(f"config.json lacks {missing}")
    return arch


def looped_configs(cfg: dict) -> tuple[ModelConfig, LoopConfig]:
    """(ModelConfig, LoopConfig) of a looped config.json (every key checked by
    ``check_fields``); for an export, exactly what wrote it (``hf_export.hf_config`` of the
    result writes the same keys and values). The table is built with exactly ``vocab_size``
    rows (--make-vocab-size-divisible-by 1); import-hf chooses the divisor a training run
    pads to. A Huginn config.json: ``hf_huginn.configs``; a Parcae one: ``hf_parcae.configs``."""
    if hf_huginn.is_huginn(cfg):
        return hf_huginn.configs(cfg)
    if hf_parcae.is_parcae(cfg):
        return hf_parcae.configs(cfg)
    if hf_loopformer.is_loopformer(cfg):
        return hf_loopformer.configs(cfg)
    cfg = export_form(cfg)
    check_fields(cfg)
    c = {**EXPORT_DEFAULTS, **cfg}
    heads = c["num_attention_heads"]
    theta, factor = rope_settings(c)
    prelude, coda = c["num_prelude_layers"], c["num_coda_layers"]
    model_cfg = ModelConfig(
        num_layers=prelude + c["num_hidden_layers"] + coda, hidden_size=c["hidden_size"],
        ffn_hidden_size=c["intermediate_size"], num_attention_heads=heads,
        num_query_groups=c["num_key_value_heads"] or heads,
        kv_channels=c["head_dim"] or c["hidden_size"] // heads,
        max_position_embeddings=c["max_position_embeddings"], position_embedding_type="rope",
        rotary_base=theta, rotary_percent=1.0, use_rope_scaling=factor is not None,
        rope_scaling_factor=factor if factor is not None else ModelConfig.rope_scaling_factor,
        normalization="RMSNorm", norm_epsilon=c["rms_norm_eps"], swiglu=True,
        hidden_dropout=0.0, attention_dropout=float(c["attention_dropout"] or 0.0),
        disable_bias_linear=True, add_qkv_bias=bool(c["qkv_bias"]),
        qk_layernorm=bool(c["qk_norm"]),
        untie_embeddings_and_output_weights=not c["tie_word_embeddings"],
        init_method_std=c["initializer_range"], norm_scheme=c["norm_scheme"],
        make_vocab_size_divisible_by=1)
    loops = c["total_ut_steps"]
    if c["lora_rank"] and c["lora_steps"] != loops:
        raise ValueError(f"config.json: lora_steps {c['lora_steps']} != total_ut_steps {loops}; "
                         f"megaloop keeps one adapter per trained loop step")
    loop = LoopConfig(
        num_loops=loops, num_prelude_layers=prelude, num_coda_layers=coda,
        step_norm_placement=c["step_norm_placement"],
        # The gate exists iff T > 1 and the objective is not "last" (LoopConfig.gated).
        exit_loss="expected" if c["use_exit_gate"] else "last",
        input_injection=c["input_injection"], injection_source=c["injection_source"],
        lora_rank=c["lora_rank"], lora_alpha=c["lora_alpha"])
    if loop.gated != bool(c["use_exit_gate"]):
        raise ValueError(f"config.json: use_exit_gate {c['use_exit_gate']} with total_ut_steps "
                         f"{loops}: a single-step model has no exit gate")
    model_cfg.validate()
    loop.validate(model_cfg.num_layers)
    check_exportable(model_cfg, loop)  # what the export (and this reader) implements
    default_exit(cfg)  # refuse a bad threshold / step here, before any weights are read
    return model_cfg, loop


def default_exit(cfg: dict) -> dict:
    """The run config's ``generation`` section for a looped config.json: ``exit``, the rule
    (as ``--exit`` writes it) Ouro's code applies by default, None for full depth, and
    ``source``, the key it came from. Ouro reads ``early_exit_step`` first (0-based: the step
    whose hidden state is read), then ``early_exit_threshold`` (the first step whose cumulative
    exit probability reaches it; 1.0, the released models' value, reaches it only at the last
    step)."""
    from megaloop.model.exit_rules import parse_exit

    if hf_huginn.is_huginn(cfg):
        return hf_huginn.default_exit(cfg)
    if hf_parcae.is_parcae(cfg):
        return hf_parcae.default_exit(cfg)
    if hf_loopformer.is_loopformer(cfg):
        return hf_loopformer.default_exit(cfg)
    cfg = export_form(cfg)
    loops = cfg.get("total_ut_steps", EXPORT_DEFAULTS["total_ut_steps"])
    step, threshold = cfg.get("early_exit_step"), cfg.get("early_exit_threshold")
    gated = cfg.get("use_exit_gate", True) and loops > 1
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < loops:
            raise ValueError(f"config.json early_exit_step {step!r}: the 0-based step to read "
                             f"must be an integer in 0..{loops - 1} (total_ut_steps {loops}); "
                             f"remove it for the threshold rule")
        rule = f"fixed:{step + 1}"
        return {"exit": None if step + 1 == loops else rule,
                "source": f"config.json early_exit_step {step}"}
    if threshold is None:
        return {"exit": None, "source": None}
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise ValueError(f"config.json early_exit_threshold {threshold!r} is not a number")
    if not 0 <= threshold <= 1:  # (NaN too)
        raise ValueError(f"config.json early_exit_threshold {threshold:g}: the cumulative exit "
                         f"probability a token leaves at, so in [0, 1] (1.0: full depth, the "
                         f"released models' value; 0: every token after step 1)")
    source = f"config.json early_exit_threshold {threshold:g}"
    if threshold >= 1.0 or not gated:
        if threshold < 1.0:
            raise ValueError(f"config.json early_exit_threshold {threshold:g} asks for early exit, "
                             f"but the model has no exit gate (use_exit_gate false or one "
                             f"step); set it to 1.0")
        return {"exit": None, "source": source}
    # The cumulative exit probability of the first step is >= 0 always: exit after step 1.
    text = "fixed:1" if threshold <= 0 else f"q:{threshold:g}"
    parse_exit(text)
    return {"exit": text, "source": source}


def threshold_keys(generation: dict | None) -> dict:
    """The config.json keys export-hf writes for a run config's ``generation`` section (the
    inverse of ``default_exit`` for the rules it produces)."""
    text = (generation or {}).get("exit")
    if not text:
        return {"early_exit_threshold": 1.0}
    kind, _, value = text.partition(":")
    if kind == "q":
        return {"early_exit_threshold": float(value)}
    if kind == "fixed":
        return {"early_exit_threshold": 1.0, "early_exit_step": int(float(value)) - 1}
    raise ValueError(f"the checkpoint's default exit rule {text} (kl) has no config.json form "
                     f"Ouro's code reads")
