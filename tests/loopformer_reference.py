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
    w1 = weights[f"{name}.w1"]  # (float64 weights: the frequencies in float64 too)
    hidden = F.silu(w1 @ frequencies(v, size).to(w1.dtype) + weights[f"{name}.b1"])
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


def final_normed(weights: dict, cfg: dict, ids: torch.Tensor, route) -> torch.Tensor:
    """[b, s, d]: rms_f(x) after ``route``'s last step (the head's input)."""
    x = weights["wte"][ids] + weights["wpe"][: ids.shape[1]]
    t = 0.0
    for dt in route:
        c = embed(weights, "time", t, cfg["freq"]) + embed(weights, "size", dt, cfg["freq"])
        for k in range(cfg["layers"]):
            x = layer(x, weights, k, c, cfg)
        t += dt
    return rms(x, cfg["eps"], weights["norm_f"])


def objective(weights: dict, cfg: dict, ids, labels, full, short, stop=True) -> torch.Tensor:
    """[b, s] LoopFormer's training objective per token: CE(full route) + 0.1 CE(short route)
    + 0.1 mean over the hidden size of (sg(y_full) - y_short)^2, y = ``final_normed``
    (``stop`` False: the seeded bug without the stop-gradient)."""
    def ce(route):
        logits = per_step_logits(weights, cfg, ids, list(route))[-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               reduction="none").view(labels.shape)

    target = final_normed(weights, cfg, ids, full)
    target = target.detach() if stop else target
    mse = (final_normed(weights, cfg, ids, short) - target).pow(2).mean(-1)
    return ce(full) + 0.1 * ce(short) + 0.1 * mse


def parameter_count(vocab: int, positions: int, hidden: int, ffn: int, layers: int,
                    freq: int) -> int:
    """Parameters of LoopFormer's definition (tied head; biases only in the embedders and the
    adaLN linears; norms in the layers have none)."""
    per_layer = 4 * hidden * hidden + 2 * hidden * ffn + (4 * hidden * hidden + 4 * hidden)
    embedder = freq * hidden + hidden + hidden * hidden + hidden
    return vocab * hidden + positions * hidden + layers * per_layer + 2 * embedder + hidden


# --- LoopFormer's own files (for tests/test_loopformer_import.py) -----------------------------
def random_weights(cfg: dict, seed: int) -> dict:
    """Seeded weights under the reference's names at ``cfg``'s sizes (hidden, layers, freq,
    vocab, positions, ffn), every one non-zero: the adaLN linears too (LoopFormer initialises
    them at 0, which would hide a wrong chunk order), and norm_f away from 1."""
    g = torch.Generator().manual_seed(seed)
    d, F_, V, P, ffn = cfg["hidden"], cfg["freq"], cfg["vocab"], cfg["positions"], cfg["ffn"]

    def r(*shape, std=0.1):
        return std * torch.randn(*shape, generator=g)

    # Scales chosen so that the step condition, gates and scales are O(1) (the embedder's input
    # has F components of size <= 1), as after training, and the logits O(1).
    w = {"wte": r(V, d, std=0.3), "wpe": r(P, d, std=0.3), "norm_f": 1 + r(d, std=0.2)}
    for e in ("time", "size"):
        w.update({f"{e}.w1": r(d, F_, std=0.05), f"{e}.b1": r(d), f"{e}.w2": r(d, d),
                  f"{e}.b2": r(d)})
    for k in range(cfg["layers"]):
        w.update({f"h.{k}.c_attn": r(3 * d, d, std=0.2), f"h.{k}.c_proj": r(d, d, std=0.2),
                  f"h.{k}.up": r(ffn, d, std=0.2), f"h.{k}.down": r(d, ffn, std=0.2),
                  f"h.{k}.ada_w": r(4 * d, d, std=0.2), f"h.{k}.ada_b": r(4 * d, std=0.3)})
    return w


def loopformer_state(weights: dict, cfg: dict) -> dict:
    """The reference's weights under the names of LoopFormer's ``GPT.state_dict()`` (the tied
    head included, as torch saves both names of a shared parameter)."""
    out = {"transformer.wte.weight": weights["wte"], "lm_head.weight": weights["wte"],
           "transformer.wpe.weight": weights["wpe"], "transformer.norm_f.weight": weights["norm_f"]}
    for e, theirs in (("time", "time_embedder"), ("size", "dt_embedder")):
        out.update({f"{theirs}.mlp.0.weight": weights[f"{e}.w1"],
                    f"{theirs}.mlp.0.bias": weights[f"{e}.b1"],
                    f"{theirs}.mlp.2.weight": weights[f"{e}.w2"],
                    f"{theirs}.mlp.2.bias": weights[f"{e}.b2"]})
    for k in range(cfg["layers"]):
        p = f"transformer.h.blocks.{k}."
        out.update({p + "attn.c_attn.weight": weights[f"h.{k}.c_attn"],
                    p + "attn.c_proj.weight": weights[f"h.{k}.c_proj"],
                    p + "mlp.c_fc.weight": weights[f"h.{k}.up"],
                    p + "mlp.c_proj.weight": weights[f"h.{k}.down"],
                    p + "adaLN_modulation.1.weight": weights[f"h.{k}.ada_w"],
                    p + "adaLN_modulation.1.bias": weights[f"h.{k}.ada_b"]})
    return out


def gpt_config_fields(cfg: dict) -> dict:
    """GPTConfig's fields at ``cfg``'s sizes."""
    return {"model_type": "loopformer", "block_size": cfg["positions"],
            "vocab_size": cfg["vocab"], "n_layer": cfg["layers"], "n_head": cfg["heads"],
            "n_embd": cfg["hidden"], "dropout": 0.0, "bias": False,
            "intermediate_dim": cfg["ffn"]}


def write_checkpoint(path: str, state: dict, fields: dict, prefix: str = "") -> None:
    """A checkpoint as LoopFormer's train.py saves it: 'model' (``prefix`` before every name,
    e.g. torch.compile's '_orig_mod.'), 'model_args' (train.py's keys: no intermediate_dim or
    model_type), 'config' pickled as an object of a class named models.loopformer.GPTConfig (a
    throwaway module registered only while saving), an optimizer state and counters."""
    import dataclasses
    import sys
    import types

    GPTConfig = dataclasses.make_dataclass("GPTConfig", list(fields))
    GPTConfig.__module__ = "models.loopformer"
    package, module = types.ModuleType("models"), types.ModuleType("models.loopformer")
    module.GPTConfig, package.loopformer = GPTConfig, module
    saved = {n: sys.modules.get(n) for n in ("models", "models.loopformer")}
    sys.modules.update({"models": package, "models.loopformer": module})
    try:
        args = {k: fields[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "bias",
                                       "vocab_size", "dropout")}
        torch.save({"model": {prefix + k: v for k, v in state.items()},
                    "optimizer": {"state": {0: {"step": torch.tensor(3.0)}},
                                  "param_groups": [{"lr": 6e-4, "betas": (0.9, 0.95),
                                                    "params": [0], "fused": None}]},
                    "model_args": args, "iter_num": 3, "val_iter_num": 1,
                    "best_val_loss": torch.tensor(4.2), "config": GPTConfig(**fields)}, path)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def greedy(weights: dict, cfg: dict, prompt: list, n: int, route) -> list:
    """``n`` tokens appended by argmax of the last position's logits after the whole route,
    the sequence recomputed for each (LoopFormer's generate with the argmax instead of a
    sample)."""
    ids = list(prompt)
    for _ in range(n):
        logits = per_step_logits(weights, cfg, torch.tensor([ids]), route)[-1]
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]
