"""Attention probes per loop step and head ("SpiralFormer" (arXiv 2602.11698) section 4):
key-marginal entropy and local attention mass (LAM) of the shared core's attention.

``AttentionProbe`` watches a LoopedGPTModel (TP = 1, PP = 1): as a loop variant it learns the step
of each core pass from the recurrence, and a forward hook on every core layer's ``core_attention``
(the one place that sees the post-RoPE query and key) recomputes the attention
probabilities A(q, k) = softmax(q.k * scale + causal mask) from the query and key it was given
(after RoPE and any qk-norm; grouped query heads expanded). At a coarse SpiralFormer step the
sequence is the L_t chunk latents, so the metrics are those of the latent attention, as in
SpiralFormer.

For loop step t, layer l, head h and one sequence of length L_t:

- key-marginal entropy: p(k) = (1/L_t) sum_q A(q, k) (a distribution over keys, since every row
  sums to 1), H = -sum_k p(k) log p(k) in nats; also H / log L_t (1 = uniform over all keys),
  which compares steps whose sequences have different lengths;
- LAM: M_t = ceil(gamma r_t) with gamma = 32 (SpiralFormer), LAM = (1/L_t) sum_q sum_{q - M_t < k <=
  q} A(q, k): the mass on the M_t most recent keys, a window of about gamma tokens at any
  resolution.

Both are averaged over the probed sequences (batch entries), then reported per (t, l, h).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from megaloop.model.recurrence import LoopVariant


def attention_probs(query: torch.Tensor, key: torch.Tensor, scale: float) -> torch.Tensor:
    """query [s, b, nq, d], key [s, b, nk, d] -> causal attention probabilities [b, nq, s, s]."""
    s, b, nq, d = query.shape
    k = key.repeat_interleave(nq // key.size(2), dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", query.float(), k.float()) * scale
    future = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)


def key_marginal_entropy(probs: torch.Tensor) -> torch.Tensor:
    """[b, h, q, k] -> [b, h] entropy (nats) of the key marginal p(k) = mean_q A(q, k)."""
    p = probs.mean(dim=2)
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1)


def local_attention_mass(probs: torch.Tensor, window: int) -> torch.Tensor:
    """[b, h, q, k] -> [b, h] mean over queries of the mass on keys q - window < k <= q."""
    s = probs.size(-1)
    idx = torch.arange(s, device=probs.device)
    dist = idx.view(-1, 1) - idx.view(1, -1)  # q - k
    local = (dist >= 0) & (dist < window)
    return (probs * local).sum(-1).mean(-1)


class AttentionProbe(LoopVariant):
    """Collects per-(step, layer, head) entropy and LAM sums while the model runs forwards."""

    def __init__(self, model, gamma: float = 32.0):
        from megaloop.model.spiral_schedule import chunk_sizes

        self.model, self.gamma = model, gamma
        self.sizes = chunk_sizes(model.loop)
        self.step = 0
        self.sums = defaultdict(lambda: torch.zeros(3, dtype=torch.float64))  # (t, l, h)
        self.count = defaultdict(int)
        model.variants.append(self)
        self.handles = []
        for l, layer in enumerate(model.core.layers):
            attn = layer.self_attention.core_attention
            self.handles.append(attn.register_forward_hook(self._hook(l, attn), with_kwargs=True))

    def around_core(self, run, z, attention_mask, rotary_pos_emb, t, ctx):
        self.step = t
        return run(z, attention_mask, rotary_pos_emb)

    def _hook(self, layer: int, attn):
        def hook(module, args, kwargs, output):
            query = args[0] if args else kwargs["query"]
            key = args[1] if len(args) > 1 else kwargs["key"]
            scale = attn.config.softmax_scale or 1.0 / math.sqrt(query.size(-1))
            probs = attention_probs(query.detach(), key.detach(), scale)
            t = self.step
            g = self.sizes[t - 1] if t - 1 < len(self.sizes) else 1
            window = math.ceil(self.gamma / g)
            ent, lam = key_marginal_entropy(probs), local_attention_mass(probs, window)
            norm = ent / max(math.log(probs.size(-1)), 1e-30)
            for h in range(ent.size(1)):
                self.sums[(t, layer, h)] += torch.stack(
                    [ent[:, h].sum(), lam[:, h].sum(), norm[:, h].sum()]).double()
                self.count[(t, layer, h)] += ent.size(0)
        return hook

    def results(self) -> list[dict]:
        rows = []
        for (t, l, h), tot in sorted(self.sums.items()):
            n = self.count[(t, l, h)]
            g = self.sizes[t - 1] if t - 1 < len(self.sizes) else 1
            rows.append({"step": t, "resolution": f"1/{g}" if g > 1 else "1", "layer": l,
                         "head": h, "entropy": tot[0].item() / n, "lam": tot[1].item() / n,
                         "entropy_norm": tot[2].item() / n,
                         "window": math.ceil(self.gamma / g)})
        return rows

    def close(self):
        self.model.variants.remove(self)
        for hd in self.handles:
            hd.remove()


def write_table(rows: list[dict], path: str) -> None:
    """Markdown: per-step means, then every (step, layer, head)."""
    steps = sorted({r["step"] for r in rows})
    lines = ["| step | resolution | LAM window | mean entropy (nats) | mean entropy / log L_t | "
             "mean LAM |", "|---|---|---|---|---|---|"]
    for t in steps:
        sel = [r for r in rows if r["step"] == t]
        lines.append(f"| {t} | {sel[0]['resolution']} | {sel[0]['window']} | "
                     f"{sum(r['entropy'] for r in sel) / len(sel):.4f} | "
                     f"{sum(r['entropy_norm'] for r in sel) / len(sel):.4f} | "
                     f"{sum(r['lam'] for r in sel) / len(sel):.4f} |")
    lines += ["", "| step | resolution | layer | head | key-marginal entropy | / log L_t | LAM |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['resolution']} | {r['layer']} | {r['head']} | "
              f"{r['entropy']:.4f} | {r['entropy_norm']:.4f} | {r['lam']:.4f} |" for r in rows]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_plot(rows: list[dict], path: str) -> None:
    """PNG: entropy and LAM against loop step, one thin line per head, the mean in black."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("the attention-probe plot needs matplotlib: pip install -e '.[eval]' "
                          "(the table is written without it)") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted({r["step"] for r in rows})
    labels = [next(r["resolution"] for r in rows if r["step"] == t) for t in steps]
    heads = sorted({(r["layer"], r["head"]) for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, title in ((axes[0], "entropy", "key-marginal entropy (nats)"),
                           (axes[1], "entropy_norm", "key-marginal entropy / log L_t"),
                           (axes[2], "lam", "local attention mass")):
        for lh in heads:
            ys = [next(r[key] for r in rows if r["step"] == t and (r["layer"], r["head"]) == lh)
                  for t in steps]
            ax.plot(steps, ys, color="tab:blue", alpha=0.35, linewidth=1)
        means = [sum(r[key] for r in rows if r["step"] == t) / len(heads) for t in steps]
        ax.plot(steps, means, color="black", marker="o", linewidth=2, label="mean over heads")
        ax.set_xticks(steps, [f"{t}\n{lab}" for t, lab in zip(steps, labels)])
        ax.set_xlabel("loop step / resolution")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
