"""An independent plain-torch LoopFormer, written from the published definition ("LoopFormer:
Elastic-Depth Looped Transformers for Latent Reasoning via Shortcut Modulation", arXiv
2602.11451, and its public model code), not from megaloop's modules.

The model: x_0 = wte[ids] + wpe[positions]; a route is a list of step sizes dt_1..dt_n summing
to 1; step i runs the shared block of layers on x with the condition
``c = E_t(t_i) + E_dt(dt_i)``, t_1 = 0, t_{i+1} = t_i + dt_i, where E(v) = W2 silu(W1 f(v) + b1)
+ b2 and f(v) = [cos(v w_j); sin(v w_j)], w_j = 10000^(-j / (F/2)), j < F/2. A layer, with
``[g_a; g_m; s_a; s_m] = W_ada silu(c) + b_ada`` (4 chunks of the hidden size, in that order):

    x = x + g_a * Attn(rms(x) * (1 + s_a))
    x = x + g_m * MLP(rms(x) * (1 + s_m))

rms without a learnable scale, Attn causal multi-head with fused [q; k; v] and an output
projection, MLP = W_down gelu(W_up .), no biases. The readout after step i is
``lm_head(rms_f(x_i))`` with rms_f's learnable scale and the head tied to wte.

``weights`` use these names (hidden d, F = frequency size):
  wte [V, d], wpe [P, d], norm_f [d]; for each embedder e in (time, size): {e}.w1 [d, F],
  {e}.b1, {e}.w2 [d, d], {e}.b2; for layer k: h.{k}.c_attn [3d, d] (q rows, then k, then v),
  h.{k}.c_proj [d, d], h.{k}.up [ffn, d], h.{k}.down [d, ffn], h.{k}.ada_w [4d, d],
  h.{k}.ada_b [4d].

``bug`` seeds a mistake for the tests to catch: "no-dt" drops E_dt from c; "gate-offset" uses
1 + g instead of g (Recurrence Effective's convention, not LoopFormer's)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def frequencies(v: float, size: int) -> torch.Tensor:
    half = size // 2
    w = torch.tensor([10000.0 ** (-j / half) for j in range(half)], dtype=torch.float64)
    return torch.cat([torch.cos(v * w), torch.sin(v * w)]).float()


def embed(weights: dict, name: str, v: float, size: int) -> torch.Tensor:
    hidden = F.silu(weights[f"{name}.w1"] @ frequencies(v, size) + weights[f"{name}.b1"])
    return weights[f"{name}.w2"] @ hidden + weights[f"{name}.b2"]


def rms(x: torch.Tensor, eps: float, scale=None) -> torch.Tensor:
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if scale is None else y * scale


def attention(x: torch.Tensor, c_attn, c_proj, heads: int) -> torch.Tensor:
    b, s, d = x.shape
    q, k, v = (x @ c_attn.T).split(d, dim=-1)
    q, k, v = (z.view(b, s, heads, d // heads).transpose(1, 2) for z in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d // heads)
    future = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return (probs @ v).transpose(1, 2).reshape(b, s, d) @ c_proj.T


def layer(x, weights, k, c, cfg, bug=None):
    d = cfg["hidden"]
    mod = weights[f"h.{k}.ada_w"] @ F.silu(c) + weights[f"h.{k}.ada_b"]
    g_a, g_m, s_a, s_m = mod.split(d)
    if bug == "gate-offset":
        g_a, g_m = 1 + g_a, 1 + g_m
    eps = cfg["eps"]
    x = x + g_a * attention(rms(x, eps) * (1 + s_a), weights[f"h.{k}.c_attn"],
                            weights[f"h.{k}.c_proj"], cfg["heads"])
    up = F.gelu(rms(x, eps) * (1 + s_m) @ weights[f"h.{k}.up"].T)
    return x + g_m * (up @ weights[f"h.{k}.down"].T)


def per_step_logits(weights: dict, cfg: dict, ids: torch.Tensor, route, bug=None) -> list:
    """Logits [b, s, V] read out after each step of ``route`` (a list of step sizes)."""
    x = weights["wte"][ids] + weights["wpe"][: ids.shape[1]]
    t, out = 0.0, []
    for dt in route:
        c = embed(weights, "time", t, cfg["freq"])
        if bug != "no-dt":
            c = c + embed(weights, "size", dt, cfg["freq"])
        for k in range(cfg["layers"]):
            x = layer(x, weights, k, c, cfg, bug)
        out.append(rms(x, cfg["eps"], weights["norm_f"]) @ weights["wte"].T)
        t += dt
    return out


def parameter_count(vocab: int, positions: int, hidden: int, ffn: int, layers: int,
                    freq: int) -> int:
    """Parameters of LoopFormer's definition (tied head; biases only in the embedders and the
    adaLN linears; norms in the layers have none)."""
    per_layer = 4 * hidden * hidden + 2 * hidden * ffn + (4 * hidden * hidden + 4 * hidden)
    embedder = freq * hidden + hidden + hidden * hidden + hidden
    return vocab * hidden + positions * hidden + layers * per_layer + 2 * embedder + hidden
