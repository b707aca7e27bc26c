"""An independent Parcae forward in plain torch, written from the published definition ("Parcae",
arXiv 2604.12946, and its public model code), not from megaloop's: the tests feed it the same
weights as megaloop's model (tests/test_parcae.py) under Parcae's own tensor names.

    e   = ln_prelude(prelude(wte[ids]))             (once)
    x_0 = given (Parcae draws it: truncated normal, std sqrt(2 / (5 d)))
    x_t = core(exp(-dt A) * x_{t-1} + dt * (e B^T)),  dt = softplus(dt_bias), A = exp(A_log)
    y_t = log_softmax(wte . ln_f(coda(C x_t)))      (tied head; logit scale 1, no softcap)

Every block is pre-norm, ``x + attn(norm_1(x))`` then ``x + mlp(norm_2(x))``, with RMSNorm (eps
``norm_eps``, a learned scale, computed in fp32), attention without biases over heads of
``d / heads``: q, k, v projections, RoPE rotating interleaved pairs (2i, 2i + 1) by position *
base^(-2i / head_dim), then a parameter-free RMS norm of q and k per head (``qk_eps``: None is
torch's default, Parcae's), causal softmax attention of scale 1 / sqrt(head_dim), output
projection; the MLP is ``proj(relu(fc x)^2 / 2)``. Value embeddings (Parcae's nanochat-style
token-indexed tables) are added to the values of the layers ``has_ve`` picks, gated by
``2 sigmoid(W_gate x[..., :32])`` per head.

``bug`` seeds a known mistake (the tests check it is caught): ``decay-without-softplus`` (dt =
dt_bias, no softplus), ``B-on-state`` (B applied to the state, not to e) or
``value-gate-without-2`` (the value-embedding gate in (0, 1)).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

VE_GATE_CHANNELS = 32


def has_ve(layer: int, n: int) -> bool:
    """Parcae's rule: every other layer, the last one included."""
    return layer % 2 == (n - 1) % 2


def layer_ids(cfg) -> dict:
    """(part, i) -> (Parcae's layer id, its value-embedding table index): the id decides the gate
    (``has_ve(id, R x backprop depth)``), the index the table (``has_ve(index, P + R + C)``)."""
    P, R, C = cfg["prelude"], cfg["core"], cfg["coda"]
    ids = {}
    for i in range(P):
        ids["prelude", i] = (i, i)
    for i in range(R):
        ids["core_block", i] = (P + i, P + i)
    for i in range(C):
        ids["coda", i] = (P + R * cfg["mean_recurrence"] + i, P + R + i)
    return ids


def random_weights(cfg, seed: int) -> dict:
    """Every tensor of a Parcae model of ``cfg`` under Parcae's names, random (non-trivial
    norms, decay and B), value-embedding tables included."""
    g = torch.Generator().manual_seed(seed)
    d, V, f, heads = cfg["d"], cfg["vocab"], cfg["ffn"], cfg["heads"]

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=g) * std

    w = {"wte": randn(V, d, std=0.5), "ln_prelude": 1 + randn(d, std=0.1),
         "ln_f": 1 + randn(d, std=0.1), "C": randn(d, d, std=1 / math.sqrt(d)),
         "adapter.A_log": randn(d, std=0.3),
         # around softplus^-1(0.8), Parcae's initial dt
         "adapter.dt_bias": 0.36 + randn(d, std=0.3),
         "adapter.B": torch.eye(d) + randn(d, d, std=0.1)}
    n_eff = cfg["prelude"] + cfg["core"] + cfg["coda"]
    n_gate = cfg["core"] * cfg["backprop_depth"]
    for (part, i), (lid, idx) in layer_ids(cfg).items():
        p = f"{part}.{i}."
        w.update({p + "norm_1": 1 + randn(d, std=0.1), p + "norm_2": 1 + randn(d, std=0.1),
                  p + "attn.c_q": randn(d, d, std=1 / math.sqrt(d)),
                  p + "attn.c_k": randn(d, d, std=1 / math.sqrt(d)),
                  p + "attn.c_v": randn(d, d, std=1 / math.sqrt(d)),
                  p + "attn.c_proj": randn(d, d, std=0.5 / math.sqrt(d)),
                  p + "mlp.fc": randn(f, d, std=1 / math.sqrt(d)),
                  p + "mlp.proj": randn(d, f, std=0.5 / math.sqrt(f))})
        if has_ve(lid, n_gate):
            w[p + "attn.ve_gate"] = randn(heads, VE_GATE_CHANNELS, std=0.1)
        if has_ve(idx, n_eff):
            w[f"value_embeds.{idx}"] = randn(V, d, std=0.5)
    return w


def rms_norm(x, weight, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def rope(x, base):
    """Rotate interleaved pairs (2i, 2i + 1) of every head; x [b, s, heads, hd]."""
    hd, s = x.shape[-1], x.shape[1]
    inv = 1.0 / base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = torch.outer(torch.arange(s, dtype=torch.float32), inv)[None, :, None, :]
    cos, sin = torch.cos(ang), torch.sin(ang)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1).flatten(-2)


def block(w, p, x, cfg, ve=None, qk_eps=None, bug=None):
    b, s, d = x.shape
    heads = cfg["heads"]
    hd = d // heads
    u = rms_norm(x, w[p + "norm_1"], cfg["norm_eps"])
    q = (u @ w[p + "attn.c_q"].T).view(b, s, heads, hd)
    k = (u @ w[p + "attn.c_k"].T).view(b, s, heads, hd)
    v = (u @ w[p + "attn.c_v"].T).view(b, s, heads, hd)
    if ve is not None and p + "attn.ve_gate" in w:
        gate = (1 if bug == "value-gate-without-2" else 2) * torch.sigmoid(
            u[..., :VE_GATE_CHANNELS] @ w[p + "attn.ve_gate"].T)
        v = v + gate[..., None] * ve.view(b, s, heads, hd)
    q, k = rope(q, cfg["rope_base"]), rope(k, cfg["rope_base"])
    q = F.rms_norm(q, (hd,), eps=qk_eps)
    k = F.rms_norm(k, (hd,), eps=qk_eps)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    y = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
    x = x + y @ w[p + "attn.c_proj"].T
    u = rms_norm(x, w[p + "norm_2"], cfg["norm_eps"])
    return x + (0.5 * F.relu(u @ w[p + "mlp.fc"].T).pow(2)) @ w[p + "mlp.proj"].T


def forward(w, cfg, ids, x0, steps: int, qk_eps=None, bug=None) -> list:
    """Log-probabilities [b, s, V] after each of ``steps`` passes, from the state ``x0``
    [b, s, d]."""
    ids_layer = layer_ids(cfg)

    def run(part, n, x):
        for i in range(n):
            idx = ids_layer[part, i][1]
            table = w.get(f"value_embeds.{idx}")
            ve = table[ids] if table is not None else None
            x = block(w, f"{part}.{i}.", x, cfg, ve, qk_eps, bug)
        return x

    e = rms_norm(run("prelude", cfg["prelude"], w["wte"][ids]), w["ln_prelude"], cfg["norm_eps"])
    if bug == "decay-without-softplus":
        dt = w["adapter.dt_bias"]
    else:
        dt = F.softplus(w["adapter.dt_bias"])
    decay = torch.exp(-dt * torch.exp(w["adapter.A_log"]))
    x, out = x0, []
    for _ in range(steps):
        if bug == "B-on-state":
            z = decay * (x @ w["adapter.B"].T) + dt * e
        else:
            z = decay * x + dt * (e @ w["adapter.B"].T)
        x = run("core_block", cfg["core"], z)
        r = run("coda", cfg["coda"], x @ w["C"].T)
        logits = rms_norm(r, w["ln_f"], cfg["norm_eps"]) @ w["wte"].T
        out.append(torch.log_softmax(logits.float(), -1))
    return out


@torch.no_grad()
def greedy(w, cfg, prompt: list, max_tokens: int, qk_eps=None) -> list:
    """Greedy continuation after ``mean_recurrence`` passes from the zero state, the whole
    sequence recomputed for every token (no cache)."""
    ids = list(prompt)
    for _ in range(max_tokens):
        x = torch.tensor([ids])
        x0 = torch.zeros(1, len(ids), cfg["d"])
        logp = forward(w, cfg, x, x0, cfg["mean_recurrence"], qk_eps)[-1]
        ids.append(int(logp[0, -1].argmax()))
    return ids[len(prompt):]


# --- a Parcae folder (what Parcae's save_pretrained writes) -----------------------------------

# Parcae's published configurations (parcae_lm/configs/parcae/*.py): layers in each of prelude,
# recurrent block and coda; width; heads (all four: head dim 128, MLP 4x, vocabulary 32768
# padded to a multiple of 64, context 2048, tied, mean recurrence 8, backprop depth 4).
PUBLISHED_SIZES = {"small": (2, 768, 6), "medium": (4, 1024, 8), "large": (6, 1280, 10),
                   "xlarge": (8, 1536, 12)}


def parcae_config(size: str | None = None, **overrides) -> dict:
    """config.json as Parcae's save_pretrained writes it (every field of its configuration, in
    its order, then _class_name) for a published ``size``, or a tiny model (2/2/2 layers of 64,
    4 heads, vocabulary 128, mean recurrence 4, backprop depth 2); ``overrides`` replace keys."""
    P, d, heads = PUBLISHED_SIZES[size] if size else (2, 64, 4)
    name = f"parcae-{size}" if size else "parcae-tiny"
    cfg = {
        "name": name, "hf_config": {"org": "SandyResearch", "name": name},
        "block_size": 2048 if size else 64, "n_embd": d, "intermediate_size": 4 * d,
        "num_attention_heads": heads, "num_key_value_heads": heads,
        "vocab_size": 32768 if size else 128, "padding_multiple": 64,
        "padded_vocab_size": 32768 if size else 128,
        "rope_settings": {"use_rope": True, "rope_condense_ratio": 1, "rope_base": 50000},
        "use_abacus": False, "randomize_positions_from": None,
        "block_class_name": "TransformerPreNormBlock", "norm_class_name": "RMSNorm",
        "attn_impl": "flash", "norm_eps": 1e-05, "mlp_class_name": "BaseMLP",
        "nonlin_name": "ReLU2", "bias": False, "qk_bias": False, "init_strategy": "scaled-zero",
        "init_orthogonal": True, "skip_initialization": False, "mup_model_scaling_factor": 1,
        "use_fused_head": "pytorch", "debias_attention": False, "center_attention": False,
        "clip_qkv": None, "qk_norm": True, "logit_softcap": None,
        "activation_checkpoint_impl": "per-iteration", "simple_ops": False, "strategy": "single",
        "injection_type": "diagonal", "n_layers_in_recurrent_block": P,
        "n_layers_in_prelude": P, "n_layers_in_coda": P, "state_init": "like-init",
        "recurrent_embedding_dimension": d, "recurrent_intermediation_embedding_dimension": 4 * d,
        "recurrent_num_attention_heads": None, "prelude_norm": True,
        "sampling_scheme": "poisson-truncated-full", "mean_recurrence": 8 if size else 4,
        "mean_backprop_depth": 4 if size else 2, "lockstep_n": False, "lockstep_k": False,
        "curriculum_target": "forward", "recurrent_iteration_method": "per-sequence",
        "tie_embeddings": True, "model_class_name": "Parcae",
        "_is_recurrent_block_config": False, "_class_name": "ParcaeConfig",
    }
    cfg.update(overrides)
    return cfg


def reference_cfg(config: dict) -> dict:
    """The reference's settings of a Parcae config.json (the tables' rows: padded_vocab_size;
    RoPE base 50000, all Parcae's loader builds)."""
    return {"d": config["n_embd"], "heads": config["num_attention_heads"],
            "ffn": config["intermediate_size"], "vocab": config["padded_vocab_size"],
            "prelude": config["n_layers_in_prelude"],
            "core": config["n_layers_in_recurrent_block"], "coda": config["n_layers_in_coda"],
            "mean_recurrence": config["mean_recurrence"],
            "backprop_depth": config["mean_backprop_depth"], "norm_eps": config["norm_eps"],
            "rope_base": 50000}


def rope_table(head_dim: int, length: int, base: float) -> torch.Tensor:
    """Parcae's freqs_cis buffer: [1, length, 1, head_dim / 2, 2], the (cos, sin) of position p
    times base^(-2i / head_dim)."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angle = torch.outer(torch.arange(length, dtype=torch.float32), inv)
    return torch.stack([angle.cos()[None, :, None, :], angle.sin()[None, :, None, :]], dim=4)


def state_dict(w, cfg, block_size: int) -> dict:
    """``w`` (short names) under the names of Parcae's model.state_dict(): the tied lm_head (the
    embedding's tensor) and the RoPE buffer included."""
    out = {"freqs_cis": rope_table(cfg["d"] // cfg["heads"], block_size, cfg["rope_base"])}
    for name, tensor in w.items():
        if name.startswith("value_embeds."):
            out[name + ".weight"] = tensor
        elif name.startswith("adapter."):
            out["transformer." + name] = tensor
        else:
            out[f"transformer.{name}.weight"] = tensor
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def write_parcae_folder(folder: str, seed: int = 0, dtype=torch.float32, tokenizer=True,
                        **overrides):
    """A tiny Parcae folder: config.json (``parcae_config(**overrides)``), model.pt (every tensor
    of random_weights in ``dtype``, full names) and, with ``tokenizer``, a word-level
    tokenizer.json of the vocabulary. Returns (the weights as stored, in fp32 under the
    reference's names; the config.json dict; the reference's settings)."""
    import json
    import os

    from ouro_reference import write_tokenizer

    config = parcae_config(**overrides)
    cfg = reference_cfg(config)
    w = {k: v.to(dtype).float() for k, v in random_weights(cfg, seed).items()}
    os.makedirs(folder, exist_ok=True)
    state = {k: v.to(dtype) for k, v in state_dict(w, cfg, config["block_size"]).items()}
    state["lm_head.weight"] = state["transformer.wte.weight"]  # one tensor, as Parcae ties it
    torch.save(state, os.path.join(folder, "model.pt"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if tokenizer:
        write_tokenizer(folder, config["vocab_size"])
    return w, config, cfg
