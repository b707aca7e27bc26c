"""The local backend's core attention with a fused fast path: PyTorch's scaled_dot_product_attention.

megatron-core's ``DotProductAttention`` (the local spec's core attention) materialises the
[b, heads, sq, sk] scores: a ``baddbmm``, a masked fill, a softmax and a ``bmm``, with their
copies in the backward. On CPU that is a visible share of a small model's step (the CPU trainer
benchmark, benchmarks/cpu_trainer.py). ``torch.nn.functional.scaled_dot_product_attention``
computes the same causal attention in one fused kernel (its flash implementation on CPU too).

``SDPADotProductAttention`` is megatron-core's class with one change: a call it can serve exactly
runs the fused kernel, every other call runs megatron-core's own forward. The fused path serves

- fp32 inputs (bf16/fp16 keep megatron-core's softmax-in-fp32 handling);
- no attention mask passed, and either the causal mask over a square sq == sk (training,
  evaluation, a prefill without cache) or one query (a decoding step, which attends to every
  cached key, as megatron-core's softmax does for sq = 1);
- no attention dropout in effect (megatron-core draws it under its RNG tracker), no sliding
  window, no softmax offset, no query-key layer scaling, no packed sequences or bias.

Masked calls (the inference engine's padded and chunked layouts) keep megatron-core's
-10000-filled softmax, so rows that are all padding stay finite as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPADotProductAttention(DotProductAttention):
    """megatron-core's DotProductAttention, fused where it can be (module docstring)."""

    def _fused(self, query, key, attention_mask, attention_bias, packed_seq_params) -> bool:
        sq, sk = query.size(0), key.size(0)
        causal_or_one = (self.attn_mask_type == AttnMaskType.causal and (sq == sk or sq == 1))
        return (query.dtype == torch.float32 and attention_mask is None and causal_or_one
                and attention_bias is None and packed_seq_params is None
                and self.softmax_offset is None and self.scale_mask_softmax.window_size is None
                and not self.config.apply_query_key_layer_scaling
                and (self.attention_dropout.p == 0.0 or not self.training))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if not self._fused(query, key, attention_mask, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:  # grouped-query attention: each key/value head serves `groups` queries
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=q.size(2) > 1,
                                             scale=self.softmax_scale)
        # [b, heads, sq, d] -> [sq, b, heads * d]
        return out.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1),
                                               self.hidden_size_per_partition)
