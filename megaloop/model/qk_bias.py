"""``--qk-bias``: a learned bias per head on q and k only (Huginn's ``qk_bias``).

Huginn adds a [2, heads, head_dim] parameter to the projected q and k before RoPE. A bias added
after the projection is the projection's own bias, so megatron-core's QKV bias
(``add_qkv_bias``) computes it exactly once its value rows are zero. This module keeps them at
zero: they start at zero (megatron-core initialises biases to zero) and a gradient hook zeroes
their gradient before it is accumulated (into ``.grad`` and, under megatron-core's DDP, from
there into ``main_grad``), so no optimizer moves them (Adam's update of a parameter that only
ever sees zero gradients is zero; biases get no weight decay). The fused QKV rows are laid out
per query group, [its q heads; its key head; its value head], and a tensor-parallel rank holds
whole groups, so every rank's mask is the same pattern.
"""

from __future__ import annotations

import torch


def value_mask(config, rows: int) -> torch.Tensor:
    """[rows] of one rank's fused QKV bias: 1 on q and k rows, 0 on value rows."""
    d = config.kv_channels or config.hidden_size // config.num_attention_heads
    groups = config.num_query_groups or config.num_attention_heads
    q = config.num_attention_heads // groups * d
    pattern = torch.cat([torch.ones(q + d), torch.zeros(d)])
    if rows % pattern.numel():
        raise ValueError(f"the fused QKV bias has {rows} rows, not whole query groups of "
                         f"{pattern.numel()}")
    return pattern.repeat(rows // pattern.numel())


def hold_value_bias_at_zero(model) -> int:
    """Zero the value rows of every attention QKV bias of ``model`` and keep them there; returns
    how many biases it holds (the caller checks that a --qk-bias model has some)."""
    held = 0
    for name, module in model.named_modules():
        bias = getattr(module, "bias", None)
        if not name.endswith("self_attention.linear_qkv") or bias is None:
            continue
        mask = value_mask(module.config, bias.numel()).to(bias.device, bias.dtype)
        with torch.no_grad():
            bias.mul_(mask)
        bias.register_hook(lambda grad, mask=mask: grad * mask.to(grad.device, grad.dtype))
        held += 1
    return held
