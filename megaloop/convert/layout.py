"""How megaloop's (megatron-core's) parameters map to Hugging Face names, in both directions.

Hugging Face side (the names Llama / Mistral / Qwen2 / Qwen3 use, and Ouro's for the Ouro norm
scheme):

    model.embed_tokens.weight                     embedding.word_embeddings.weight
    model.prelude.{i}.<layer>                     prelude.layers.{i}.<layer>
    model.layers.{i}.<layer>                      core.layers.{i}.<layer>      (the looped stack)
    model.norm.weight                             step_norm.weight             (after every step)
    model.coda.{i}.<layer>, model.coda_norm       coda.layers.{i}.<layer>, coda.final_layernorm
    model.early_exit_gate.{weight,bias}           exit_gate.linear.{weight,bias}
    model.input_injection.logit                   injection.logit
    lm_head.weight                                output_layer.weight          (untied only)

Inside a layer, megatron-core fuses two pairs of projections:
- ``linear_qkv`` holds q, k and v *interleaved per query group*: for each of the G groups, the
  rows of its H/G query heads, then its key head, then its value head (head_dim rows each); its
  bias (--add-qkv-bias, Qwen2's q/k/v biases) interleaves the same way;
- ``linear_fc1`` of a SwiGLU MLP is ``[gate; up]``.
Stepwise LoRA adapters of the fused linears split the same way (B's rows like the weight's rows;
A is shared, so it is repeated for q, k, v and for gate, up). Hugging Face stacks the per-step
adapters: ``<proj>.lora_A`` [steps, r, in] and ``<proj>.lora_B`` [steps, out, r].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# megaloop layer-local name -> Hugging Face layer-local name, for one-to-one tensors.
LAYER_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn_bda.norm.weight": "input_layernorm_2.weight",  # ouro: norm of attention output
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp_bda.norm.weight": "post_attention_layernorm_2.weight",  # ouro: norm of MLP output
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
# Adapted linear (megaloop module holding ``lora_A.<t>`` / ``lora_B.<t>``) -> the Hugging Face
# projections its adapters feed.
LORA_TARGETS = {
    "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention.linear_proj": ("self_attn.o_proj",),
    "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.linear_fc2": ("mlp.down_proj",),
}
TOP_LEVEL = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "step_norm.weight": "model.norm.weight",
    "coda.final_layernorm.weight": "model.coda_norm.weight",
    "exit_gate.linear.weight": "model.early_exit_gate.weight",
    "exit_gate.linear.bias": "model.early_exit_gate.bias",
    "injection.logit": "model.input_injection.logit",
    "output_layer.weight": "lm_head.weight",
}
BLOCKS = {"prelude": "model.prelude", "core": "model.layers", "coda": "model.coda"}
# Transformer Engine fuses a layer's input norms into the linear after them (the norm's scale is
# that linear's ``layer_norm_weight``); the local spec keeps separate norm modules. The names
# here are the local spec's: the fused TE name -> the separate norm's prefix (megatron-core's
# local spec maps the other way for its checkpoint keys).
FUSED_NORMS = {".self_attention.linear_qkv.layer_norm_": ".input_layernorm.",
               ".mlp.linear_fc1.layer_norm_": ".pre_mlp_layernorm."}


def local_names(state: dict) -> dict:
    """A model's ``state_dict()`` (or ``named_parameters()``), of either layer backend, under the
    local spec's names: TE's fused input norms (``<layer>.self_attention.linear_qkv
    .layer_norm_weight``) as the separate norms (``<layer>.input_layernorm.weight``), and TE's
    ``_extra_state`` (FP8 scaling state, no weight) left out. The values are the model's own
    tensors, so copying into them fills the model."""
    out = {}
    for key, value in state.items():
        if key.endswith("_extra_state"):
            continue
        for fused, separate in FUSED_NORMS.items():
            if fused in key:
                key = key.replace(fused, separate)
        out[key] = value
    return out


@dataclass(frozen=True)
class Heads:
    """Attention geometry needed to (un)interleave the fused QKV rows."""

    num_heads: int
    num_groups: int
    head_dim: int

    def fuse_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[q; k; v] (Hugging Face, each [rows, in]) -> megatron-core's per-group interleave."""
        g, d = self.num_groups, self.head_dim
        cols = q.shape[-1]
        parts = [q.reshape(g, -1, cols), k.reshape(g, d, cols), v.reshape(g, d, cols)]
        return torch.cat(parts, dim=1).reshape(-1, cols)

    def split_qkv(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inverse of ``fuse_qkv``."""
        g, d = self.num_groups, self.head_dim
        q_rows = self.num_heads // g * d
        cols = w.shape[-1]
        q, k, v = w.reshape(g, q_rows + 2 * d, cols).split([q_rows, d, d], dim=1)
        return q.reshape(-1, cols), k.reshape(-1, cols), v.reshape(-1, cols)


def layer_to_hf(state: dict, prefix: str, hf_prefix: str, heads: Heads, used: set) -> dict:
    """One megaloop layer's tensors (``prefix`` + local name) -> Hugging Face names; the keys
    read are added to ``used``."""
    out = {}
    for ours, theirs in LAYER_SIMPLE.items():
        if prefix + ours in state:
            out[hf_prefix + theirs] = state[prefix + ours]
            used.add(prefix + ours)
    used.update(prefix + k for k in ("self_attention.linear_qkv.weight", "mlp.linear_fc1.weight"))
    q, k, v = heads.split_qkv(state[prefix + "self_attention.linear_qkv.weight"])
    out.update({hf_prefix + "self_attn.q_proj.weight": q, hf_prefix + "self_attn.k_proj.weight": k,
                hf_prefix + "self_attn.v_proj.weight": v})
    bias = prefix + "self_attention.linear_qkv.bias"
    if bias in state:  # --add-qkv-bias (Qwen2): the bias rows interleave like the weight's
        used.add(bias)
        parts = heads.split_qkv(state[bias][:, None])
        out.update({f"{hf_prefix}self_attn.{name}_proj.bias": part[:, 0]
                    for name, part in zip("qkv", parts)})
    gate, up = state[prefix + "mlp.linear_fc1.weight"].chunk(2, dim=0)
    out.update({hf_prefix + "mlp.gate_proj.weight": gate, hf_prefix + "mlp.up_proj.weight": up})
    for adapter, projections in LORA_TARGETS.items():
        a_keys = sorted((key for key in state if key.startswith(f"{prefix}{adapter}.lora_A.")),
                        key=lambda key: int(key.rsplit(".", 1)[1]))
        if not a_keys:
            continue
        b_keys = [key.replace(".lora_A.", ".lora_B.") for key in a_keys]
        used.update(a_keys + b_keys)
        a = torch.stack([state[key] for key in a_keys])
        b = torch.stack([state[key] for key in b_keys])
        if len(projections) == 3:
            b_parts = list(zip(*[heads.split_qkv(b_t) for b_t in b]))
            b_parts = [torch.stack(part) for part in b_parts]
        elif len(projections) == 2:
            b_parts = list(b.chunk(2, dim=1))
        else:
            b_parts = [b]
        for proj, b_part in zip(projections, b_parts):
            out[f"{hf_prefix}{proj}.lora_A"] = a
            out[f"{hf_prefix}{proj}.lora_B"] = b_part.contiguous()
    return out


def layer_from_hf(get, hf_prefix: str, prefix: str, heads: Heads, names: set) -> dict:
    """Hugging Face layer tensors (read with ``get(name)``) -> megaloop names: the inverse of
    ``layer_to_hf``, stepwise LoRA adapters included where the file holds them (a dense
    Qwen3 / Llama checkpoint has none). ``names`` is the set of tensors the file holds."""
    out = {}
    for ours, theirs in LAYER_SIMPLE.items():
        if hf_prefix + theirs in names:
            out[prefix + ours] = get(hf_prefix + theirs)
    out[prefix + "self_attention.linear_qkv.weight"] = heads.fuse_qkv(
        get(hf_prefix + "self_attn.q_proj.weight"), get(hf_prefix + "self_attn.k_proj.weight"),
        get(hf_prefix + "self_attn.v_proj.weight"))
    if hf_prefix + "self_attn.q_proj.bias" in names:  # Qwen2's bias on q, k, v
        out[prefix + "self_attention.linear_qkv.bias"] = heads.fuse_qkv(
            *(get(f"{hf_prefix}self_attn.{name}_proj.bias")[:, None] for name in "qkv"))[:, 0]
    out[prefix + "mlp.linear_fc1.weight"] = torch.cat(
        [get(hf_prefix + "mlp.gate_proj.weight"), get(hf_prefix + "mlp.up_proj.weight")], dim=0)
    for adapter, projections in LORA_TARGETS.items():
        if f"{hf_prefix}{projections[0]}.lora_A" not in names:
            continue
        a = get(f"{hf_prefix}{projections[0]}.lora_A")  # [steps, r, in], shared by the parts
        for proj in projections[1:]:
            get(f"{hf_prefix}{proj}.lora_A")  # the same A repeated: read, so it counts as used
        b_parts = [get(f"{hf_prefix}{proj}.lora_B") for proj in projections]  # [steps, out, r]
        if len(projections) == 3:
            b = torch.stack([heads.fuse_qkv(*step) for step in zip(*b_parts)])
        else:
            b = torch.cat(b_parts, dim=1)
        for t in range(a.shape[0]):
            out[f"{prefix}{adapter}.lora_A.{t}"] = a[t].contiguous()
            out[f"{prefix}{adapter}.lora_B.{t}"] = b[t].contiguous()
    return out


def to_hf(state: dict, heads: Heads, tied: bool) -> dict:
    """A whole megaloop state dict (TP=1, under ``local_names``) -> Hugging Face tensors.
    Raises if a tensor has no Hugging Face name (a feature the export does not know)."""
    out, used = {}, set()
    for ours, theirs in TOP_LEVEL.items():
        if ours in state:
            used.add(ours)
            if not (tied and ours == "output_layer.weight"):
                out[theirs] = state[ours]
    for block, hf_block in BLOCKS.items():
        indices = sorted({int(k.split(".")[2]) for k in state if k.startswith(f"{block}.layers.")})
        for i in indices:
            out.update(layer_to_hf(state, f"{block}.layers.{i}.", f"{hf_block}.{i}.", heads, used))
    unknown = sorted(set(state) - used)
    if unknown:
        raise ValueError(f"no Hugging Face name for {unknown[:5]}: export-hf does not support the "
                         f"feature these parameters belong to")
    return out


def from_hf(get, names: set, heads: Heads, layers: dict) -> dict:
    """Hugging Face tensors of an export (read with ``get(name)``; ``names``: what the file
    holds) -> megaloop names at TP=1: the inverse of ``to_hf``. ``layers``: block ("prelude",
    "core", "coda") -> its layer count. Raises if the file holds a tensor nothing here reads
    (a feature, or a layer, the config does not describe)."""
    read = set()

    def tracked(name):
        read.add(name)
        return get(name)

    out = {ours: tracked(theirs) for ours, theirs in TOP_LEVEL.items() if theirs in names}
    for block, hf_block in BLOCKS.items():
        for i in range(layers.get(block, 0)):
            out.update(layer_from_hf(tracked, f"{hf_block}.{i}.", f"{block}.layers.{i}.", heads,
                                     names))
    unused = sorted(set(names) - read)
    if unused:
        raise ValueError(f"the safetensors files hold tensors config.json does not describe: "
                         f"{unused[:5]}")
    return out
