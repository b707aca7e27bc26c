"""An inference forward of megatron-core's transformer layers: the same modules, less host work.

A cached decoding step of a small looped model spends most of its time on the host, not in
arithmetic: megatron-core's ``TransformerLayer`` and ``SelfAttention`` are written for training
and for every parallel layout at once, so each call goes through an autograd function per linear,
process-group lookups, offloading and NVTX contexts, configuration checks and a softmax module,
a few hundred microseconds per layer on a CPU whatever the batch (docs/inference.md has the
profile). ``block_forward`` computes what ``TransformerBlock.forward`` computes for an
inference call over a ``StaticInferenceContext`` (the engine's paged views and every
``LoopKVCache``), from the block's own modules and weights:

- the norms, the bias-dropout-add functions (every norm scheme's, megaloop/model/specs.py)
  and the final norm are the layer's own modules, called as ``TransformerLayer`` calls them;
- the linears are ``F.linear`` on the modules' weights (their bias added where the module adds
  it, handed on where it skips it), the row-parallel ones followed by megatron-core's all-reduce
  over the tensor-parallel group;
- query/key/value are split as ``SelfAttention.get_query_key_value_tensors`` splits them, and
  rotated by megatron-core's own ``apply_rotary_pos_emb``;
- the new keys and values are written into the context's buffers where megatron-core's static
  path writes them, but keys *after* RoPE, rotated by each token's position
  (``PositionRope``, made by ``recurrence.begin`` from the forward's position ids): megatron-core
  stores keys before RoPE and rotates the whole cached prefix by column at every call, work that
  grows with the context; a rotary score depends only on the distance of the two positions,
  which a row's left padding in the engine's views does not change, so both give the same
  scores. A cache is therefore filled by one forward or the other, never both
  (``LoopKVCache(layer_forward=...)``);
- attention is PyTorch's ``scaled_dot_product_attention`` over the cached prefix, with the
  caller's mask (True: hidden) or, without one, causal over a square or one query that sees
  every cached key (megatron-core's static rules for these calls).

``unsupported(model)`` says which layers this cannot compute (a reason naming it), so a model
is decoded by this forward only when all its layers are plain megatron-core ones it knows: the
engine announces which forward it decodes with (``InferenceEngine.forward_impl``) and
tests/test_layer_forward.py checks both give the same logits on every layout it serves.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

MARK = "megaloop_layer_forward"
"""The attribute a ``StaticInferenceContext`` carries (True) when its blocks run this forward."""
STATIC = "megaloop_static"
"""The attribute that holds, for a decode forward of static shapes, the column (a LongTensor
[1]) its new K/V go to; attention then reads the cache's whole width under the caller's mask
(megaloop/inference/cuda_graphs.py)."""
ROWS = "megaloop_rows"
"""The attribute that holds the batch rows a call runs on (a LongTensor; None: all): early exit's
rows still in the loop, read and written in place in the cache instead of a compacted copy."""


class PositionRope:
    """The rotary angles of each new token at its own position, as the cos and sin [s, b, 1,
    rot_dim] that megatron-core's unfused RoPE computes from the angles at every call (here once
    per forward, for every layer and step of it)."""

    def __init__(self, table: torch.Tensor, position_ids: torch.Tensor, mscale: float = 1.0):
        # table [S, 1, 1, rot_dim], position_ids [b, s] -> [s, b, rot_dim]
        freqs = table[:, 0, 0][position_ids.t()]
        self.cos, self.sin = torch.cos(freqs) * mscale, torch.sin(freqs) * mscale
        self._cast: dict = {}

    def index_rows(self, rows: torch.Tensor) -> "PositionRope":
        """The angles of batch rows ``rows`` (early exit's rows still going)."""
        out = PositionRope.__new__(PositionRope)
        out.cos, out.sin = self.cos.index_select(1, rows), self.sin.index_select(1, rows)
        out._cast = {}
        return out

    def _angles(self, dtype, dims: int):
        """(cos, sin, sin with its first half negated) in ``dtype``, shaped to broadcast over a
        [s, b, ..., dim] tensor of ``dims`` dimensions."""
        if (dtype, dims) not in self._cast:
            cos, sin = self.cos.to(dtype), self.sin.to(dtype)
            half = sin.size(-1) // 2
            signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            shape = cos.shape[:2] + (1,) * (dims - 3) + cos.shape[2:]
            self._cast[(dtype, dims)] = tuple(a.view(shape) for a in (cos, sin, signed))
        return self._cast[(dtype, dims)]

    def apply(self, t: torch.Tensor, interleaved: bool) -> torch.Tensor:
        """``t`` [s, b, ..., dim] rotated: megatron-core's ``_apply_rotary_pos_emb_bshd`` (the
        first rot_dim features rotated, halves or interleaved pairs, the rest passed). Halves:
        rotate_half(x) = (-x2, x1) is x rolled by rot_dim / 2 with the first half negated,
        which the sine carries: three tensor calls instead of six."""
        cos, sin, signed = self._angles(t.dtype, t.dim())
        rot = cos.size(-1)
        x, rest = (t, None) if rot == t.size(-1) else (t[..., :rot], t[..., rot:])
        if interleaved:
            x1, x2 = x[..., ::2], x[..., 1::2]
            x = x * cos + torch.stack((-x2, x1), dim=-1).view(x.shape) * sin
        else:
            x = torch.addcmul(x * cos, torch.roll(x, rot // 2, dims=-1), signed)
        return x if rest is None else torch.cat((x, rest), dim=-1)


def unsupported(model) -> Optional[str]:
    """Why ``block_forward`` cannot compute ``model``'s blocks (None: it can)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megaloop.model.spiral_schedule import is_active

    c = model.config
    if is_active(model.loop):  # (its coarse steps cut the rotary table per resolution)
        return "SpiralFormer's multi-resolution steps (megatron-core's layers decode them)"
    checks = (
        (c.context_parallel_size == 1, "context parallelism"),
        (not c.sequence_parallel, "sequence parallelism"),
        (not c.multi_latent_attention, "multi-latent attention"),
        (not getattr(c, "no_rope_freq", None), "--no-rope-freq"),
        (not getattr(c, "attention_output_gate", False), "an attention output gate"),
        (not c.flash_decode, "flash decoding"),
        (not c.apply_query_key_layer_scaling, "query-key layer scaling"),
        (not c.fp32_residual_connection, "an fp32 residual connection"),
        (getattr(c, "activation_func_clamp_value", None) is None, "a clamped activation"),
        (not getattr(c, "glu_linear_offset", 0.0), "a GLU linear offset"),
        (not getattr(c, "use_te_activation_func", False), "Transformer Engine's activation"),
        (c.num_query_groups is None or
         c.num_query_groups >= c.tensor_model_parallel_size,
         "fewer query groups than tensor-parallel ranks"),
        (c.fp8 is None, "FP8"),
    )
    for ok, what in checks:
        if not ok:
            return f"{what} (megatron-core's layers decode it)"
    for name in ("prelude", "core", "coda"):
        block = getattr(model, name, None)
        if block is None:
            continue
        for layer in block.layers:
            attn, mlp = layer.self_attention, layer.mlp
            parts = (
                ("the layer", layer, TransformerLayer),
                ("self-attention", attn, SelfAttention),
                ("linear_qkv", attn.linear_qkv, ColumnParallelLinear),
                ("linear_proj", attn.linear_proj, RowParallelLinear),
                ("MLP", mlp, MLP),
                ("linear_fc1", getattr(mlp, "linear_fc1", None), ColumnParallelLinear),
                ("linear_fc2", getattr(mlp, "linear_fc2", None), RowParallelLinear),
            )
            for what, module, expected in parts:
                if type(module) is not expected:
                    return (f"{name} layer {layer.layer_number}: its {what} is a "
                            f"{type(module).__name__}, not megatron-core's "
                            f"{expected.__name__} (megatron-core's layers decode it)")
            if not isinstance(layer.cross_attention, IdentityOp) or \
                    not isinstance(attn.core_attention, DotProductAttention):
                return (f"{name} layer {layer.layer_number}: cross-attention or a core "
                        f"attention other than megatron-core's (its layers decode it)")
            core = attn.core_attention
            if getattr(core, "softmax_offset", None) is not None or \
                    core.scale_mask_softmax.window_size is not None:
                return (f"{name} layer {layer.layer_number}: a softmax offset or sliding window "
                        f"(megatron-core's layers decode it)")
    return None


def call(block, hidden_states, attention_mask, rotary_pos_emb, inference_context=None):
    """``block``'s forward on ``hidden_states``: this module's (``block_forward``) where the
    inference context is marked for it (``MARK``), the block's own call otherwise. The one
    place the model calls its prelude, core and coda through."""
    if inference_context is not None and getattr(inference_context, MARK, False):
        return block_forward(block, hidden_states, attention_mask, rotary_pos_emb,
                             inference_context)
    if inference_context is None:
        out = block(hidden_states=hidden_states, attention_mask=attention_mask,
                    rotary_pos_emb=rotary_pos_emb)
        tokens = getattr(block, "value_tokens", None)  # set on blocks with value embeddings
        if tokens is not None and torch.is_grad_enabled():
            # A recomputed block re-reads the token ids in the backward pass, when later
            # micro-batches may have replaced them: put this forward's back first.
            from megaloop.model.loop_step import ReselectStep

            out = ReselectStep.apply(out, tokens, tokens.value)
        return out
    return block(hidden_states=hidden_states, attention_mask=attention_mask,
                 rotary_pos_emb=rotary_pos_emb, inference_context=inference_context)


def block_forward(block, hidden_states, attention_mask, rotary_pos_emb, inference_context):
    """``block(hidden_states=..., attention_mask=..., rotary_pos_emb=...,
    inference_context=...)`` for a megatron-core ``TransformerBlock`` (module docstring)."""
    if torch.is_grad_enabled():
        raise RuntimeError("megaloop's layer forward is for inference: call it under no_grad")
    # Inference mode drops autograd's per-op bookkeeping (a fifth of a small layer's host time).
    # Its tensors cannot be written in place outside it, so a cache buffer this forward makes
    # is made outside (``_attention``); the rest of the model reads its output under no_grad.
    with torch.inference_mode():
        allowed = None if attention_mask is None else ~attention_mask
        h = hidden_states
        for layer in block.layers:
            h = _layer(layer, h, allowed, rotary_pos_emb, inference_context)
        if block.final_layernorm is not None:
            h = _norm(block.final_layernorm, h)
        return h


def _linear(module, x):
    """(output, bias or None) as the megatron-core linear ``module`` returns them, without its
    autograd function: the product, a row-parallel linear's partial sums reduced over its group,
    then the bias added (or handed on, where the module skips adding it)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    out = F.linear(x, module.weight)
    if getattr(module, "input_is_parallel", False) and module.tp_group.size() > 1:
        out = reduce_from_tensor_model_parallel_region(out, group=module.tp_group)
    bias = module.bias if module.bias is not None and module.bias.numel() else None
    if module.skip_bias_add:
        return out, bias
    return (out if bias is None else out + bias), None


def _norm(norm, x):
    """``norm(x)``; PyTorch's RMSNorm module as its formula (fewer host calls, the same value
    up to rounding; computed in at least float32, as the module does)."""
    if type(norm) is not torch.nn.RMSNorm:
        return norm(x)
    wide = x.dtype in (torch.float32, torch.float64)
    v = x if wide else x.float()
    eps = norm.eps if norm.eps is not None else torch.finfo(v.dtype).eps
    y = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    weight = norm.weight
    if weight is not None:
        y = y * weight
    return y if wide else y.to(x.dtype)


def _bda(bda, out_with_bias, residual):
    """The layer's bias-dropout-add slot at inference (no dropout): megatron-core's function and
    megaloop's normed one as their sums, any other module called as TransformerLayer calls it."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    from megaloop.model.specs import NormedBiasDropoutAdd

    out, bias = out_with_bias
    if bda is get_bias_dropout_add or type(bda) is NormedBiasDropoutAdd:
        if bias is not None:
            out = out + bias
        if bda is get_bias_dropout_add:
            return residual + out
        if bda.where == "branch":
            return residual + _norm(bda.norm, out)
        return _norm(bda.norm, residual + out)
    return bda(False, False)(out_with_bias, residual, 0.0)


def _layer(layer, x, mask, rope, context):
    c = layer.config
    a = _attention(layer.self_attention, _norm(layer.input_layernorm, x), mask, rope, context)
    x = _bda(layer.self_attn_bda, a, x)
    m = _mlp(layer.mlp, _norm(layer.pre_mlp_layernorm, x), c)
    return _bda(layer.mlp_bda, m, x)


def _mlp(mlp, x, c):
    y, bias = _linear(mlp.linear_fc1, x)
    if bias is not None:
        y = y + bias
    if c.gated_linear_unit:
        gate, up = torch.chunk(y, 2, dim=-1)
        y = c.activation_func(gate) * up
    else:
        y = c.activation_func(y)
    return _linear(mlp.linear_fc2, y)


def _attention(attn, x, allowed, rope, context):
    """``allowed``: the attention mask inverted (True: a query may look), or None."""
    from megatron.core.transformer.identity_op import IdentityOp

    c = attn.config
    groups, heads = attn.num_query_groups_per_partition, attn.num_attention_heads_per_partition
    dim, per = attn.hidden_size_per_attention_head, \
        attn.num_attention_heads_per_partition // attn.num_query_groups_per_partition
    mixed, _ = _linear(attn.linear_qkv, x)
    sq, b = mixed.shape[:2]
    # [sq, b, groups, heads / groups + 2, dim]: each group's queries, its key, its value
    mixed = mixed.view(sq, b, groups, per + 2, dim)
    value = mixed[:, :, :, per + 1]
    if rope is not None and not isinstance(rope, PositionRope):
        raise ValueError("megaloop's layer forward rotates by position: give "
                         "recurrence.begin the forward's position ids")
    q_norm, k_norm = (None if isinstance(n, IdentityOp) else n
                      for n in (attn.q_layernorm, attn.k_layernorm))
    if q_norm is None and k_norm is None and rope is not None:
        qk = rope.apply(mixed[:, :, :, :per + 1], c.rotary_interleaved)  # one call for both
        query, key = qk[:, :, :, :per].reshape(sq, b, heads, dim), qk[:, :, :, per]
    else:
        query, key = mixed[:, :, :, :per].reshape(sq, b, heads, dim), mixed[:, :, :, per]
        if q_norm is not None:
            query = q_norm(query)
        if k_norm is not None:
            key = k_norm(key)
        if rope is not None:
            query = rope.apply(query, c.rotary_interleaved)
            key = rope.apply(key, c.rotary_interleaved)
    # megatron-core's static cache layout: keys and values at [offset, offset + sq) of the rows
    # [batch offset, + b); attention reads the prefix up to the new tokens. Keys after RoPE.
    start, rows = context.sequence_len_offset, context.batch_size_offset
    end = start + sq
    if attn.layer_number not in context.key_value_memory_dict:
        size = (context.max_sequence_length, context.max_batch_size, groups, dim)
        with torch.inference_mode(False):  # (others write it in place: early exit, the pool)
            context.key_value_memory_dict[attn.layer_number] = (
                torch.empty(size, dtype=key.dtype, device=key.device),
                torch.empty(size, dtype=value.dtype, device=value.device))
    keys, values = context.key_value_memory_dict[attn.layer_number]
    subset, column = getattr(context, ROWS, None), getattr(context, STATIC, None)
    if column is not None:  # static shapes: the column from a tensor, the whole width read
        if subset is not None or sq != 1 or rows != 0 or b != keys.size(1):
            raise ValueError("a static decode forward takes one token of every row of its "
                             "cache (no early exit)")
        keys.index_copy_(0, column, key)
        values.index_copy_(0, column, value)
        k, v = keys, values
    elif subset is None:
        keys[start:end, rows:rows + b] = key
        values[start:end, rows:rows + b] = value
        k, v = keys[:end, rows:rows + b], values[:end, rows:rows + b]
    else:  # early exit's rows still going: only their prefix is read, their new column written
        keys[start:end].index_copy_(1, subset, key)
        values[start:end].index_copy_(1, subset, value)
        k, v = keys[:end].index_select(1, subset), values[:end].index_select(1, subset)
    # [s, b, h, d] -> [b, h, s, d]
    q = query.permute(1, 2, 0, 3)
    k, v = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
    if allowed is None and sq > 1 and sq != end:
        raise ValueError(f"an unmasked call of {sq} tokens after {start} cached ones: give an "
                         f"attention mask")
    # (megatron-core without a mask: causal over a square, a prefill; one query sees every key)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, is_causal=allowed is None and sq > 1,
        scale=attn.core_attention.softmax_scale, enable_gqa=heads != groups)
    out = out.permute(2, 0, 1, 3).reshape(sq, b, heads * dim)
    return _linear(attn.linear_proj, out)
