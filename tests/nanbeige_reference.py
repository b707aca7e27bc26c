"""An independent Nanbeige4.2, written here from the published definition (the released
config.json's keys and the computation of its modeling code, as described in words), in plain
torch and fp32, for the parity tests of megaloop's Nanbeige import:

    h = embed(ids)                                   # no scale
    for pass in 1..num_loops:
        for every layer:  h = h + attn(n1(h));  h = h + mlp(n2(h))      # Llama's pre-norm layer
        if not skip_loop_final_norm:  h = norm(h)    # between passes, and after the last
    if skip_loop_final_norm:  h = norm(h)            # only once
    logits = lm_head(h)

n1, n2 are the layer's input_layernorm and post_attention_layernorm; attention is causal
grouped-query attention without biases, RoPE in the rotate-half form (theta = rope_theta), scale
head_dim ** -0.5; the MLP is SwiGLU down(silu(gate(x)) * up(x)); RMSNorm x * rsqrt(mean(x^2) +
eps) * weight. Every pass uses the same positions and its own keys and values.

The layer pieces (RMSNorm, rotate-half RoPE, attention, SwiGLU) are the Llama pieces of
tests/ouro_reference.py; the loop around them is Nanbeige's. ``make_nanbeige_folder`` writes a
tiny folder with every key of Nanbeige4.2-3B's config.json. Nothing here imports megaloop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ouro_reference import (attention, drawers, llama_projections, mlp, rms_norm,
                            write_folder)


def nanbeige_config(**overrides) -> dict:
    """Every key of Nanbeige4.2-3B's config.json (22 layers looped twice, hidden 3072, 48 query
    heads over 8 key/value heads of 128, vocabulary 166144, theta 7e7), at a tiny size unless
    ``full=True``; ``overrides`` replace any key."""
    full = overrides.pop("full", False)
    cfg = {
        "architectures": ["NanbeigeForCausalLM"], "model_type": "nanbeige",
        "auto_map": {"AutoConfig": "configuration_nanbeige.NanbeigeConfig",
                     "AutoModel": "modeling_nanbeige.NanbeigeModel",
                     "AutoModelForCausalLM": "modeling_nanbeige.NanbeigeForCausalLM"},
        "vocab_size": 166144, "hidden_size": 3072, "intermediate_size": 10752,
        "num_hidden_layers": 22, "num_attention_heads": 48, "num_key_value_heads": 8,
        "head_dim": 128, "kv_channels": 128, "hidden_act": "silu",
        "max_position_embeddings": 262144, "rope_theta": 70000000, "rope_scaling": None,
        "attention_bias": False, "attention_dropout": 0.0, "rms_norm_eps": 1e-05,
        "num_loops": 2, "loop_loss_weights": [], "skip_loop_final_norm": False,
        "pretraining_tp": 1, "tie_word_embeddings": False, "pad_token_id": 0,
        "bos_token_id": 166100, "eos_token_id": 166101, "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
    }
    if not full:
        cfg.update({"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 8, "kv_channels": 8, "max_position_embeddings": 64,
                    "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 0,
                    "pad_token_id": None})
    cfg.update(overrides)
    return cfg


def random_weights(cfg: dict, seed: int) -> dict:
    """Llama-named fp32 tensors of ``cfg``: projections ~ N(0, 0.08), norm scales around 1 (not
    all ones, so a norm in the wrong place shows)."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    normal, scale = drawers(seed, H)
    w = {"model.embed_tokens.weight": normal(V, H, std=1.0), "model.norm.weight": scale()}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(V, H, std=0.2)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update(llama_projections(cfg, p, normal))
        w.update({p + "input_layernorm.weight": scale(),
                  p + "post_attention_layernorm.weight": scale()})
    return w


def make_nanbeige_folder(folder: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                         **overrides) -> tuple[dict, dict]:
    """Write a tiny Nanbeige-layout folder (config.json with every key of the released one,
    ``overrides`` applied; model.safetensors in ``dtype``; a tokenizer.json and its config;
    generation_config.json). Returns (the fp32 weights as stored, rounded through ``dtype``; the
    config dict)."""
    cfg = nanbeige_config(**overrides)
    generation = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    return write_folder(folder, random_weights(cfg, seed), cfg, dtype, generation), cfg


def rope(cfg: dict, length: int):
    d = cfg["head_dim"]
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(length).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[None, None], emb.sin()[None, None]


@torch.no_grad()
def final_state(weights: dict, cfg: dict, ids: torch.Tensor, num_loops: int | None = None,
                norm_between: bool | None = None) -> torch.Tensor:
    """The state the head reads after ``num_loops`` passes (default config.json's):
    [b, s, hidden]. ``norm_between`` overrides ``not skip_loop_final_norm`` (a seeded bug)."""
    w, eps = weights, cfg["rms_norm_eps"]
    cos, sin = rope(cfg, ids.shape[1])
    between = (not cfg["skip_loop_final_norm"]) if norm_between is None else norm_between
    h = w["model.embed_tokens.weight"][ids]
    for _ in range(num_loops or cfg["num_loops"]):
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = h + attention(w, p, cfg, rms_norm(h, w[p + "input_layernorm.weight"], eps), cos,
                              sin)
            h = h + mlp(w, p, rms_norm(h, w[p + "post_attention_layernorm.weight"], eps))
        if between:
            h = rms_norm(h, w["model.norm.weight"], eps)
    return h if between else rms_norm(h, w["model.norm.weight"], eps)


def head(weights: dict, cfg: dict) -> torch.Tensor:
    return weights["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] \
        else weights["lm_head.weight"]


@torch.no_grad()
def log_probs(weights: dict, cfg: dict, ids: torch.Tensor, num_loops: int | None = None,
              norm_between: bool | None = None) -> torch.Tensor:
    """log-softmax of the logits after ``num_loops`` passes: [b, s, vocab_size]."""
    h = final_state(weights, cfg, ids, num_loops, norm_between)
    return F.log_softmax(h @ head(weights, cfg).T, -1)


@torch.no_grad()
def greedy(weights: dict, cfg: dict, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation, recomputing the whole sequence for every token (no cache)."""
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(log_probs(weights, cfg, torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]
