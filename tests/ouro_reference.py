"""An independent Ouro, written here from the published definition of ByteDance's Ouro models
(config.json keys, tensor names and the computation of "Scaling Latent Reasoning via Looped
Language Models"), in plain torch and fp32, for the parity tests of megaloop's Ouro import:

    h = embed(ids)
    for t in 1..T (total_ut_steps):
        for every layer:  h = h + n2(attn(n1(h)));  h = h + n4(mlp(n3(h)))
        h = norm(h)                         # the step's output, and the next step's input
        logits_t = lm_head(h);  lambda_t = sigmoid(early_exit_gate(h))
    p_t = lambda_t prod_{s<t} (1 - lambda_s) for t < T,  p_T = prod_{s<T} (1 - lambda_s)

n1..n4 are the layer's RMSNorms input_layernorm, input_layernorm_2, post_attention_layernorm and
post_attention_layernorm_2; attention is causal grouped-query attention without biases, RoPE in
the rotate-half form (theta = rope_theta), scale head_dim ** -0.5; the MLP is SwiGLU
down(silu(gate(x)) * up(x)); RMSNorm is x * rsqrt(mean(x^2) + eps) * weight.

``make_ouro_folder`` writes a tiny folder in that layout (every key of Ouro-1.4B's config.json,
safetensors under Ouro's names, a tokenizer.json with SmolLM2's three special tokens first).
Nothing here imports megaloop.
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def ouro_config(**overrides) -> dict:
    """Every key of Ouro-1.4B's config.json, at a tiny size (``overrides`` replace any)."""
    cfg = {
        "architectures": ["OuroForCausalLM"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig",
                     "AutoModel": "modeling_ouro.OuroModel",
                     "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
        "bos_token_id": 1, "eos_token_id": 0, "head_dim": 8, "hidden_act": "silu",
        "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
        "layer_types": None, "max_position_embeddings": 64, "max_window_layers": 28,
        "model_type": "ouro", "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "rope_scaling": None,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "total_ut_steps": 4, "early_exit_threshold": 1.0,
        "transformers_version": "4.55.0", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 128,
    }
    cfg.update(overrides)
    if cfg["layer_types"] is None:
        cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    return cfg


def random_weights(cfg: dict, seed: int) -> dict:
    """Ouro-named fp32 tensors of ``cfg``: projections ~ N(0, 0.08), norm scales around 1 (not
    all ones, so a swapped norm shows), a gate whose bias spreads the exits over the steps."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    normal, scale = drawers(seed, H)
    w = {"model.embed_tokens.weight": normal(V, H, std=1.0), "model.norm.weight": scale(),
         "model.early_exit_gate.weight": normal(1, H, std=0.5),
         "model.early_exit_gate.bias": torch.tensor([-1.0])}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(V, H, std=0.2)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update(llama_projections(cfg, p, normal))
        for name in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm",
                     "post_attention_layernorm_2"):
            w[p + name + ".weight"] = scale()
    return w


def drawers(seed: int, hidden: int):
    """(normal(*shape, std=0.08), scale()) drawing from one seeded stream: projections ~ N(0,
    std), norm scales 1 + N(0, 0.2) of size ``hidden``."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std=0.08):
        return torch.randn(*shape, generator=g) * std

    def scale():
        return 1.0 + normal(hidden, std=0.2)

    return normal, scale


def llama_projections(cfg: dict, p: str, normal) -> dict:
    """The seven projections of a Llama layer under prefix ``p`` (bias-free, Llama's names),
    each drawn by ``normal(*shape)``."""
    H, F_ = cfg["hidden_size"], cfg["intermediate_size"]
    d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return {p + "self_attn.q_proj.weight": normal(nq * d, H),
            p + "self_attn.k_proj.weight": normal(nkv * d, H),
            p + "self_attn.v_proj.weight": normal(nkv * d, H),
            p + "self_attn.o_proj.weight": normal(H, nq * d),
            p + "mlp.gate_proj.weight": normal(F_, H),
            p + "mlp.up_proj.weight": normal(F_, H),
            p + "mlp.down_proj.weight": normal(H, F_)}


def write_tokenizer(folder: str, vocab_size: int) -> None:
    """A word-level tokenizer.json of ``vocab_size`` entries (SmolLM2's three special tokens,
    then words w3, w4, ...) and its tokenizer_config.json (eos <|endoftext|>, as SmolLM2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(SPECIAL)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": SPECIAL[0], "bos_token": SPECIAL[1], "pad_token": None,
                   "model_max_length": 65536}, f)


def make_ouro_folder(folder: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                     **overrides) -> tuple[dict, dict]:
    """Write a tiny Ouro-layout Hugging Face folder (config.json with every key of the released
    one, ``overrides`` applied; model.safetensors in ``dtype``; tokenizer.json and its config;
    generation_config.json). Returns (the fp32 weights as stored, rounded through ``dtype``; the
    config dict)."""
    cfg = ouro_config(**overrides)
    return write_folder(folder, random_weights(cfg, seed), cfg, dtype), cfg


def write_folder(folder: str, weights: dict, cfg: dict, dtype: torch.dtype,
                 generation: dict | None = None) -> dict:
    """A Hugging Face folder of ``weights`` stored in ``dtype``: model.safetensors, config.json
    (``cfg``), generation_config.json (bos/eos, then ``generation``), a word-level tokenizer.
    Returns the weights as stored (rounded through ``dtype``), in fp32."""
    from safetensors.torch import save_file

    weights = {k: v.to(dtype).float() for k, v in weights.items()}
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in weights.items()},
              os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
                   **(generation or {})}, f)
    write_tokenizer(folder, cfg["vocab_size"])
    return weights


# --- the computation ------------------------------------------------------------------------
def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention(w, p, cfg, x, cos, sin):
    b, s, _ = x.shape
    d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(b, s, nq, d).transpose(1, 2)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(b, s, nkv, d).transpose(1, 2)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(b, s, nkv, d).transpose(1, 2)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = k.repeat_interleave(nq // nkv, dim=1), v.repeat_interleave(nq // nkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, nq * d)
    return out @ w[p + "self_attn.o_proj.weight"].T


def mlp(w, p, x):
    gate = x @ w[p + "mlp.gate_proj.weight"].T
    up = x @ w[p + "mlp.up_proj.weight"].T
    return (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def step_states(weights: dict, cfg: dict, ids: torch.Tensor, num_loops: int | None = None):
    """The normalized state after every loop step: a list of T tensors [b, s, hidden]."""
    w, eps = weights, cfg["rms_norm_eps"]
    d = cfg["head_dim"]
    pos = torch.arange(ids.shape[1]).float()
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]
    h = w["model.embed_tokens.weight"][ids]
    states = []
    for _ in range(num_loops or cfg["total_ut_steps"]):
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            a = attention(w, p, cfg, rms_norm(h, w[p + "input_layernorm.weight"], eps), cos, sin)
            h = h + rms_norm(a, w[p + "input_layernorm_2.weight"], eps)
            m = mlp(w, p, rms_norm(h, w[p + "post_attention_layernorm.weight"], eps))
            h = h + rms_norm(m, w[p + "post_attention_layernorm_2.weight"], eps)
        h = rms_norm(h, w["model.norm.weight"], eps)
        states.append(h)
    return states


def head(weights: dict, cfg: dict) -> torch.Tensor:
    return weights["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] \
        else weights["lm_head.weight"]


@torch.no_grad()
def per_step_log_probs(weights: dict, cfg: dict, ids: torch.Tensor,
                       num_loops: int | None = None) -> torch.Tensor:
    """log-softmax of every step's logits: [T, b, s, vocab_size]."""
    states = step_states(weights, cfg, ids, num_loops)
    return torch.stack([F.log_softmax(h @ head(weights, cfg).T, -1) for h in states])


@torch.no_grad()
def exit_pdf(weights: dict, cfg: dict, ids: torch.Tensor,
             num_loops: int | None = None) -> torch.Tensor:
    """The exit distribution p_t of every token: [T, b, s], summing to 1 over t."""
    states = step_states(weights, cfg, ids, num_loops)
    survival, p = torch.ones(ids.shape), []
    for t, h in enumerate(states):
        if t == len(states) - 1:
            p.append(survival)
            break
        lam = torch.sigmoid(h @ weights["model.early_exit_gate.weight"].T
                            + weights["model.early_exit_gate.bias"])[..., 0]
        p.append(lam * survival)
        survival = survival * (1 - lam)
    return torch.stack(p)


def megaloop_objective(weights: dict, cfg: dict, ids, labels, loss_mask, beta: float) -> float:
    """megaloop's exit objective per token, sum_t p_t CE_t + beta KL(p || uniform over T),
    averaged over the tokens ``loss_mask`` keeps."""
    logp = per_step_log_probs(weights, cfg, ids)
    ce = -logp.gather(-1, labels.expand(logp.shape[0], *labels.shape).unsqueeze(-1))[..., 0]
    p = exit_pdf(weights, cfg, ids)
    per_token = (p * ce).sum(0) + beta * (p * torch.log(p * p.shape[0])).sum(0)
    mask = loss_mask.float()
    return ((per_token * mask).sum() / mask.sum()).item()


def ouro_labels_loss(weights: dict, cfg: dict, ids, labels) -> float:
    """Ouro's own loss for ``labels``: the cross-entropy of the exit-weighted logits
    sum_t p_t z_t, averaged over tokens (no regularizer)."""
    states = step_states(weights, cfg, ids)
    p = exit_pdf(weights, cfg, ids)
    mixed = sum(p[t][..., None] * (h @ head(weights, cfg).T) for t, h in enumerate(states))
    return F.cross_entropy(mixed.flatten(0, 1), labels.flatten()).item()
