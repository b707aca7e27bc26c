"""An independent Huginn-0125, written here from the published definition ("Scaling up Test-Time
Compute with Latent Reasoning: A Recurrent Depth Approach", its released config.json and the
computation of its modeling code, described in words), in plain torch and fp32, for the parity
tests of megaloop's Huginn import:

    e = prelude(wte[ids] * sqrt(n_embd))                 # n_layers_in_prelude sandwich layers
    s = s_0                                              # noise in Huginn; given here
    for step in 1..T:
        s = core(adapter @ [s; e])                       # n_layers_in_recurrent_block layers
        logits_step = head(ln_f(coda(ln_f(s))))          # the same ln_f twice; head = wte
    sandwich layer:  x = n2(x + attn(n1(x)));  x = n4(x + mlp(n3(x)))

Attention is causal multi-head attention over one fused projection Wqkv = [Wq; Wk; Wv], a
learned bias added to q and k (qk_bias[0], qk_bias[1], one vector per head) before RoPE, and
RoPE on *interleaved* pairs (x[2i], x[2i+1]) rotated by p / rope_base^(2i / head_dim), scale
head_dim ** -0.5; the MLP is proj(silu(a) * b) with [a; b] = fc(x); RMSNorm x * rsqrt(mean(x^2)
+ eps) * weight. ``make_huginn_folder`` writes a tiny folder with every key of Huginn-0125's
config.json. Nothing here imports megaloop.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ouro_reference import drawers, rms_norm, write_folder


def huginn_config(**overrides) -> dict:
    """Every key of Huginn-0125's config.json (as its configuration class writes it: 2 prelude,
    4 core, 2 coda layers of 5280 = 55 heads x 96, mean recurrence 32, vocabulary 65536), at a
    tiny size unless ``full=True``; ``overrides`` replace any key."""
    full = overrides.pop("full", False)
    cfg = {
        "architectures": ["RavenForCausalLM"], "model_type": "huginn_raven",
        "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig",
                     "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"},
        "activation_checkpoint_impl": "per-iteration", "architecture_class_name": "RecurrentGPT",
        "bias": False, "block_class_name": "SandwichBlock", "block_size": 4096,
        "bos_token_id": 65504, "eos_token_id": 65505, "pad_token_id": 65509,
        "init_orthogonal": False, "init_strategy": "takase", "injection_type": "linear",
        "intermediate_size": 17920, "mean_backprop_depth": 8, "mean_recurrence": 32,
        "mlp_class_name": "GatedMLP", "n_embd": 5280, "n_heads": 55, "n_layers": 8,
        "n_layers_in_coda": 2, "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4,
        "nonlin_name": "SiLU", "norm_class_name": "RMSNorm_llama", "norm_eps": 1e-06,
        "num_key_value_heads": 55, "num_attention_heads": 55, "head_dim": 96,
        "padding_multiple": 4096, "padded_vocab_size": 65536, "qk_bias": True,
        "rope_base": 50000, "sampling_scheme": "poisson-lognormal-filling",
        "state_init": "like-init", "test_time_noise": 0, "test_time_noise_type": "fixed",
        "tie_embeddings": True, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.47.1", "vocab_size": 65536,
    }
    if not full:
        cfg.update({"vocab_size": 128, "padded_vocab_size": 128, "n_embd": 32, "n_heads": 4,
                    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8,
                    "intermediate_size": 48, "n_layers_in_prelude": 1,
                    "n_layers_in_recurrent_block": 2, "n_layers_in_coda": 1, "n_layers": 4,
                    "mean_recurrence": 3, "mean_backprop_depth": 2, "block_size": 64,
                    "rope_base": 10000, "padding_multiple": 64, "bos_token_id": 1,
                    "eos_token_id": 0, "pad_token_id": None})
    cfg.update(overrides)
    # What Huginn's configuration class derives from the keys above.
    d, depth = cfg["n_embd"], (cfg["n_layers_in_prelude"] + cfg["n_layers_in_coda"] +
                               cfg["n_layers_in_recurrent_block"] * cfg["mean_recurrence"])
    std = math.sqrt(2 / (5 * d))
    cfg["effective_expected_depth"] = depth
    cfg["init_values"] = {"std": std, "out_proj": std / math.sqrt(2 * depth),
                          "embedding": std, "embed_scale": math.sqrt(d)}
    return cfg


def rope_table(head_dim: int, length: int, base: float) -> torch.Tensor:
    """[1, length, 1, head_dim / 2, 2]: (cos, sin) of p / base^(2i / head_dim)."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angle = torch.arange(length).float()[:, None] * inv[None, :]
    return torch.stack([angle.cos(), angle.sin()], -1)[None, :, None]


def random_weights(cfg: dict, seed: int) -> dict:
    """Huginn-named fp32 tensors of ``cfg``: projections ~ N(0, 0.08), the embedding N(0, 0.2)
    (it is multiplied by sqrt(n_embd)), q/k biases N(0, 0.5), norm scales around 1 (not all
    ones, so a norm in the wrong place shows); and the RoPE table Huginn saves."""
    d, V, ffn = cfg["n_embd"], cfg["vocab_size"], cfg["intermediate_size"]
    heads, kv, hd = cfg["n_heads"], cfg["num_key_value_heads"], cfg["n_embd"] // cfg["n_heads"]
    normal, scale = drawers(seed, d)
    w = {"transformer.wte.weight": normal(V, d, std=0.2),
         "transformer.adapter.weight": normal(d, 2 * d, std=0.15),
         "transformer.ln_f.weight": scale(),
         "freqs_cis": rope_table(hd, cfg["block_size"], cfg["rope_base"])}
    for block, key in (("prelude", "n_layers_in_prelude"),
                       ("core_block", "n_layers_in_recurrent_block"),
                       ("coda", "n_layers_in_coda")):
        for i in range(cfg[key]):
            p = f"transformer.{block}.{i}."
            w.update({p + "attn.Wqkv.weight": normal((heads + 2 * kv) * hd, d),
                      p + "attn.proj.weight": normal(d, heads * hd),
                      p + "mlp.fc.weight": normal(2 * ffn, d),
                      p + "mlp.proj.weight": normal(d, ffn),
                      **{p + f"norm_{n}.weight": scale() for n in (1, 2, 3, 4)}})
            if cfg["qk_bias"]:
                w[p + "attn.qk_bias"] = normal(2, 1, heads, hd, std=0.5)
    return w


def make_huginn_folder(folder: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                       **overrides) -> tuple[dict, dict]:
    """Write a tiny Huginn-layout folder (config.json with every key of the released one,
    ``overrides`` applied; model.safetensors in ``dtype``; a tokenizer). Returns (the fp32 weights
    as stored, the config dict)."""
    cfg = huginn_config(**overrides)
    return write_folder(folder, random_weights(cfg, seed), cfg, dtype), cfg


def _rotate_pairs(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [b, s, heads, hd] with pairs (2i, 2i+1) rotated by table [s, hd / 2, 2] (cos, sin)."""
    pairs = x.unflatten(-1, (-1, 2))
    cos, sin = table[None, :, None, :, 0], table[None, :, None, :, 1]
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)


def _rotate_halves(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Llama's rotate-half form of the same angles (dimension i paired with i + hd / 2)."""
    cos, sin = (torch.cat([table[..., j]] * 2, -1)[None, :, None] for j in (0, 1))
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def attention(w, p, cfg, x, table, interleaved=True):
    b, s, d = x.shape
    heads, kv = cfg["n_heads"], cfg["num_key_value_heads"]
    hd = d // heads
    q, k, v = (x @ w[p + "attn.Wqkv.weight"].T).split([heads * hd, kv * hd, kv * hd], -1)
    q, k, v = q.view(b, s, heads, hd), k.view(b, s, kv, hd), v.view(b, s, kv, hd)
    if cfg["qk_bias"]:
        q, k = q + w[p + "attn.qk_bias"][0], k + w[p + "attn.qk_bias"][1]
    rotate = _rotate_pairs if interleaved else _rotate_halves  # (halves: a seeded bug)
    q, k = rotate(q, table), rotate(k, table)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, heads * hd)
    return out @ w[p + "attn.proj.weight"].T


def sandwich(w, p, cfg, x, table, bug=None):
    eps = cfg["norm_eps"]
    n = {i: w[p + f"norm_{i}.weight"] for i in (1, 2, 3, 4)}
    x = rms_norm(x + attention(w, p, cfg, rms_norm(x, n[1], eps), table,
                               interleaved=bug != "halves"), n[2], eps)
    a, b = (rms_norm(x, n[3], eps) @ w[p + "mlp.fc.weight"].T).chunk(2, -1)
    return rms_norm(x + (F.silu(a) * b) @ w[p + "mlp.proj.weight"].T, n[4], eps)


def forward(weights: dict, cfg: dict, ids: torch.Tensor, steps: int | None = None,
            s0: torch.Tensor | None = None, bug: str | None = None,
            no_grad_steps: int = 0) -> torch.Tensor:
    """log-softmax of every step's logits, [T, b, s, vocab_size], with autograd, from the initial
    state ``s0`` [b, s, n_embd] (zeros if None: Huginn's ``init_scale=0``). ``no_grad_steps``:
    Huginn's truncated backpropagation, the first n steps run without gradient. ``bug`` seeds one
    mistake: ``scale`` (no embedding scale), ``halves`` (rotate-half RoPE), ``coda_norm`` (no
    ln_f after the coda)."""
    w, eps = weights, cfg["norm_eps"]
    d = cfg["n_embd"]
    table = rope_table(d // cfg["n_heads"], ids.shape[1], cfg["rope_base"])[0, :, 0]
    x = w["transformer.wte.weight"][ids] * (1.0 if bug == "scale" else math.sqrt(d))
    for i in range(cfg["n_layers_in_prelude"]):
        x = sandwich(w, f"transformer.prelude.{i}.", cfg, x, table, bug)
    s = torch.zeros_like(x) if s0 is None else s0
    out = []
    for step in range(steps or cfg["mean_recurrence"]):
        with torch.set_grad_enabled(torch.is_grad_enabled() and step >= no_grad_steps):
            s = torch.cat([s, x], -1) @ w["transformer.adapter.weight"].T
            for i in range(cfg["n_layers_in_recurrent_block"]):
                s = sandwich(w, f"transformer.core_block.{i}.", cfg, s, table, bug)
            r = rms_norm(s, w["transformer.ln_f.weight"], eps)
            for i in range(cfg["n_layers_in_coda"]):
                r = sandwich(w, f"transformer.coda.{i}.", cfg, r, table, bug)
            if bug != "coda_norm":
                r = rms_norm(r, w["transformer.ln_f.weight"], eps)
            out.append(F.log_softmax(r @ w["transformer.wte.weight"].T, -1))
    return torch.stack(out)


@torch.no_grad()
def per_step_log_probs(weights: dict, cfg: dict, ids: torch.Tensor, steps: int | None = None,
                       s0: torch.Tensor | None = None, bug: str | None = None) -> torch.Tensor:
    """``forward`` without autograd: [T, b, s, vocab_size]."""
    return forward(weights, cfg, ids, steps, s0, bug)


@torch.no_grad()
def greedy(weights: dict, cfg: dict, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation from the zero state at full depth, recomputing the whole sequence for
    every token (no cache)."""
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(per_step_log_probs(weights, cfg, torch.tensor([ids]))[-1, 0, -1].argmax()))
    return ids[len(prompt):]
