"""Nanbeige4.2 folders (``NanbeigeForCausalLM``, ``model_type: nanbeige``) in and out.

Nanbeige4.2-3B is a Llama decoder whose whole stack of layers runs ``num_loops`` times with
the same weights: pre-norm layers (RMSNorm before attention and before the SwiGLU MLP), grouped-
query attention without biases, rotate-half RoPE, an untied head. Between two passes the final
norm (``model.norm``) normalizes the state, which the next pass reads; after the last pass it is
applied once more before the head. Nothing else enters the loop (no injection, no per-step
parameters, no exit gate), and every (pass, layer) pair keeps its own KV cache. That is
megaloop's looped model with no prelude or coda, ``--norm-scheme pre``, the step norm
``model.norm`` and ``--step-norm-placement recurrent``; ``skip_loop_final_norm: true`` (the norm
only after the last pass) is ``--step-norm-placement readout``. The tensors carry Llama's names,
which are the looped export's (``layout``), so a folder reads and writes with the same map.

Every key of config.json has a role, as for the other families: HONOURED (becomes a megaloop
setting), CHECKED (megaloop computes one value; any other is refused by name: the released
model's value for each of Nanbeige's optional features, n-gram embeddings, hyper-connections,
depth attention, the split loop, is "off") or INERT (does not change the logits). Any other key
is refused. ``export_form`` turns an accepted config.json into the looped export's keys, which
``hf_looped.looped_configs`` reads; ``nanbeige_config`` writes one back.
"""

from __future__ import annotations

from megaloop.convert.hf_families import HONOURED as FAMILY_HONOURED
from megaloop.convert.hf_families import (INERT_BY_FAMILY, INERT_COMMON, check_roles,
                                         decoder_keys)
from megaloop.model.config import LoopConfig, ModelConfig

ARCHITECTURE, MODEL_TYPE = "NanbeigeForCausalLM", "nanbeige"
# Where Nanbeige's own modeling code lives: an export's auto_map names it, so transformers loads
# the written folder with the family's code (trust_remote_code) as it loads the released one.
HUB_CODE = "Nanbeige/Nanbeige4.2-3B"

OFF, NONE = (False, None), (None,)
EMPTY = (None, [])

# The decoder's shape keys mean what they mean in every Llama-family config.json.
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
              "tie_word_embeddings", "attention_dropout")
HONOURED = {
    **{key: FAMILY_HONOURED[key] for key in SHAPE_KEYS},
    "architectures": "NanbeigeForCausalLM",
    "model_type": "nanbeige (checked against the architecture)",
    "vocab_size": "the embedding table's rows",
    "num_hidden_layers": "--num-layers (the whole stack is the looped core)",
    "initializer_range": "--init-method-std",
    "num_loops": "--num-loops",
    "skip_loop_final_norm": "--step-norm-placement: false recurrent (the norm between passes), "
                            "true readout (only after the last pass)",
}
CHECKED = {
    "hidden_act": (("silu",), "only SwiGLU (silu) MLPs are supported"),
    "attention_bias": (OFF, "a bias on q, k, v and o is not supported"),
    "mlp_bias": (OFF, "MLP biases are not supported"),
    "qk_layernorm": (OFF, "q/k norms are not part of Nanbeige's released model; refused here"),
    "rope_scaling": (NONE, "RoPE scaling (Nanbeige's linear / dynamic forms) is not supported"),
    "loop_loss_weights": (EMPTY, "a non-empty list runs len(loop_loss_weights) + 1 passes with "
                                 "a loss per pass; megaloop reads num_loops"),
    "enable_double_loop_split": (OFF, "the split loop (LoopSplit) is not supported"),
    "loop_middle_layers": (NONE, "the split loop (LoopSplit) is not supported"),
    "loop_share_kv": (OFF, "passes sharing one KV cache is not supported (each pass keeps "
                           "its own, as the released model does)"),
    "enable_hyper_connection": (OFF, "hyper-connections are not supported"),
    "enable_mhc": (OFF, "manifold hyper-connections (mHC) are not supported"),
    "enable_h_res_identity": (OFF, "read with mHC only (not supported)"),
    "mhc_identity_nohresparam": (OFF, "read with mHC only (not supported)"),
    "mhc_diff_for_loop": (OFF, "read with mHC only (not supported)"),
    "mhc_double_stream_position_for_loop": (NONE, "read with mHC only (not supported)"),
    "enable_depth_attention": (OFF, "depth attention is not supported"),
    "depth_attention_stride": (NONE, "read with depth attention only (not supported)"),
    "emb_neighbor_num": (NONE, "n-gram embeddings are not supported"),
    "emb_split_num": (NONE, "n-gram embeddings are not supported"),
    "ngram_vocab_size_ratio": (NONE, "n-gram embeddings are not supported"),
    "ngram_embedding_hidden_size": (NONE, "n-gram embeddings are not supported"),
    "ngram_mod_force_prime": (OFF, "n-gram embeddings are not supported"),
    "ngram_compressed_tokenizer": (OFF, "n-gram embeddings are not supported"),
    "ngram_insert_all_layers": (OFF, "n-gram embeddings are not supported"),
    "ngram_layer_downproject_size": (NONE, "n-gram embeddings are not supported"),
    "insert_ngram_layer_idx": (EMPTY, "n-gram embeddings are not supported"),
    "skip_ngram_for_input": (OFF, "n-gram embeddings are not supported"),
    "emb_tp_num": (NONE, "n-gram embeddings are not supported"),
}
INERT = {
    **INERT_COMMON,
    "auto_map": "where the folder's own modeling code is; megaloop computes the model itself",
    "kv_channels": "not read by Nanbeige's modeling code (head_dim is)",
    "pretraining_tp": INERT_BY_FAMILY["LlamaForCausalLM"]["pretraining_tp"],
    "ngram_fused_mode": "read with n-gram embeddings only (refused when on)",
    "num_residual_streams": "read with hyper-connections only (refused when on)",
    "mhc_sinkhorn_iterations": "read with mHC only (refused when on)",
    "mhc_init_gating_factor": "read with mHC only (refused when on)",
    "depth_attention_recent_window": "read with depth attention only (refused when on)",
    "depth_attention_static_anchor_once": "read with depth attention only (refused when on)",
}


def is_nanbeige(cfg: dict) -> bool:
    arch = (cfg.get("architectures") or ["?"])[0]
    return arch == ARCHITECTURE or cfg.get("model_type") == MODEL_TYPE


def check_fields(cfg: dict) -> None:
    """Every key of a Nanbeige config.json accounted for; ValueError naming the first key that is
    refused or unknown."""
    archs = cfg.get("architectures") or ["?"]
    if archs != [ARCHITECTURE] or cfg.get("model_type") != MODEL_TYPE:
        raise ValueError(f"config.json (architectures {cfg.get('architectures')}, model_type "
                         f"{cfg.get('model_type')!r}): a Nanbeige folder has architectures "
                         f"[{ARCHITECTURE!r}] and model_type {MODEL_TYPE!r}")
    check_roles(cfg, ARCHITECTURE, lambda k: k in HONOURED or k in CHECKED or k in INERT,
                CHECKED)
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in cfg]
    if missing:
        raise ValueError(f"config.json lacks {missing}")


def export_form(cfg: dict) -> dict:
    """The looped export's config.json keys (``hf_looped.EXPORT_DEFAULTS``' layout) for a
    Nanbeige config.json, after ``check_fields``. Absent keys take the defaults of Nanbeige's
    configuration class (num_loops 1, skip_loop_final_norm false, rms_norm_eps 1e-6,
    rope_theta 10000, untied)."""
    check_fields(cfg)
    heads = cfg["num_attention_heads"]
    out = {key: cfg[key] for key in ("vocab_size", "hidden_size", "intermediate_size",
                                     "num_hidden_layers", "num_attention_heads")}
    out.update({
        "architectures": ["MegaloopForCausalLM"], "model_type": "megaloop",
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "max_position_embeddings": cfg.get("max_position_embeddings", 2048),
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "rope_theta": cfg.get("rope_theta", 10000.0),
        "tie_word_embeddings": cfg.get("tie_word_embeddings", False),
        "initializer_range": cfg.get("initializer_range", 0.02),
        "attention_dropout": cfg.get("attention_dropout", 0.0),
        "total_ut_steps": cfg.get("num_loops", 1),
        "norm_scheme": "pre",
        "step_norm_placement": "readout" if cfg.get("skip_loop_final_norm") else "recurrent",
        "use_exit_gate": False,
    })
    return out


def nanbeige_style(model: ModelConfig, loop: LoopConfig) -> str | None:
    """None when Nanbeige's code computes this model, else what it cannot compute."""
    gaps = [what for what, bad in (
        ("a prelude or coda", loop.num_prelude_layers or loop.num_coda_layers),
        (f"--norm-scheme {model.norm_scheme} (Nanbeige's layers are pre-norm)",
         model.norm_scheme != "pre"),
        (f"--step-norm {loop.step_norm} (Nanbeige's norm has a learned scale)",
         loop.step_norm != "rms"),
        ("an exit gate (train with --exit-loss last)", loop.gated),
        (f"--input-injection {loop.input_injection}", loop.input_injection != "none"),
        ("stepwise LoRA", loop.lora_rank),
        ("--qk-layernorm", model.qk_layernorm), ("--add-qkv-bias", model.add_qkv_bias),
        ("--use-rope-scaling", model.use_rope_scaling)) if bad]
    return "; ".join(gaps) or None


def nanbeige_config(model: ModelConfig, loop: LoopConfig, vocab_size: int) -> dict:
    """config.json in Nanbeige's keys (the inverse of ``export_form`` for a Nanbeige-style
    model); auto_map names Nanbeige's code on the Hugging Face Hub."""
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "auto_map": {"AutoConfig": f"{HUB_CODE}--configuration_nanbeige.NanbeigeConfig",
                     "AutoModel": f"{HUB_CODE}--modeling_nanbeige.NanbeigeModel",
                     "AutoModelForCausalLM": f"{HUB_CODE}--modeling_nanbeige.NanbeigeForCausalLM"},
        **decoder_keys(model, loop, vocab_size),
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": model.attention_dropout,
        "num_loops": loop.num_loops,
        "loop_loss_weights": [],
        "skip_loop_final_norm": loop.step_norm_placement == "readout",
        "pretraining_tp": 1,
        "use_cache": True,
    }
