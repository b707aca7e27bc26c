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
dt_bias, no softplus) or ``B-on-state`` (B applied to the state, not to e).
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


def block(w, p, x, cfg, ve=None, qk_eps=None):
    b, s, d = x.shape
    heads = cfg["heads"]
    hd = d // heads
    u = rms_norm(x, w[p + "norm_1"], cfg["norm_eps"])
    q = (u @ w[p + "attn.c_q"].T).view(b, s, heads, hd)
    k = (u @ w[p + "attn.c_k"].T).view(b, s, heads, hd)
    v = (u @ w[p + "attn.c_v"].T).view(b, s, heads, hd)
    if ve is not None and p + "attn.ve_gate" in w:
        gate = 2 * torch.sigmoid(u[..., :VE_GATE_CHANNELS] @ w[p + "attn.ve_gate"].T)
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
            x = block(w, f"{part}.{i}.", x, cfg, ve, qk_eps)
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
