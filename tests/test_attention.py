"""The local spec's core attention (megaloop/model/attention.py) against megatron-core's own.

``SDPADotProductAttention`` must give megatron-core's ``DotProductAttention`` outputs and
gradients wherever it takes its fused path (causal square, one decoding query, grouped-query
attention, TP = 2's per-rank heads), must take that path there (counted), and must hand every
other call (an attention mask, bf16, dropout in training) to megatron-core's forward unchanged.
"""

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed, setup_parallel

HEADS, D = 4, 8


def _pair(groups, dropout=0.0):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megaloop.model.attention import SDPADotProductAttention

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * D, num_attention_heads=HEADS,
                               num_query_groups=groups, attention_dropout=dropout,
                               use_cpu_initialization=True)
    args = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                attention_type="self")
    return DotProductAttention(**args), SDPADotProductAttention(**args)


def _run(module, q, k, v, mask=None):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = module(q, k, v, mask)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


def _cases(rank, world, tp):
    setup_parallel(tp=tp)
    calls = []
    real = F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    F.scaled_dot_product_attention = counted
    out = {}
    heads = HEADS // tp
    torch.manual_seed(0)
    for name, groups, sq, sk, dtype, mask, dropout, fused in [
            ("causal square", HEADS, 12, 12, torch.float32, False, 0.0, True),
            ("grouped query", 2, 12, 12, torch.float32, False, 0.0, True),
            ("one decoding query", HEADS, 1, 9, torch.float32, False, 0.0, True),
            ("padding mask", HEADS, 12, 12, torch.float32, True, 0.0, False),
            ("bf16", HEADS, 12, 12, torch.bfloat16, False, 0.0, False),
            ("dropout in training", HEADS, 12, 12, torch.float32, False, 0.5, False)]:
        ref, ours = _pair(groups, dropout)
        kv_heads = groups // tp
        q = torch.randn(sq, 2, heads, D, dtype=dtype)
        k, v = (torch.randn(sk, 2, kv_heads, D, dtype=dtype) for _ in range(2))
        m = None
        if mask:  # megatron-core's convention: True = masked out; the last two keys are padding
            m = torch.triu(torch.ones(sq, sk, dtype=torch.bool), 1)[None, None].repeat(2, 1, 1, 1)
            m[1, :, :, -2:] = True
        from megatron.core import tensor_parallel

        tracker = tensor_parallel.get_cuda_rng_tracker()  # the stream dropout draws from
        state, streams = torch.get_rng_state(), tracker.get_states()
        expected = _run(ref, q, k, v, m)
        torch.set_rng_state(state)
        tracker.set_states(streams)
        before = len(calls)
        got = _run(ours, q, k, v, m)
        out[name] = (expected, got, len(calls) > before, fused)
    F.scaled_dot_product_attention = real
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_path_equals_megatron_core_and_other_calls_are_its_own(tp):
    for rank_out in run_distributed(_cases, tp, tp):
        for name, (expected, got, took_fused, fused) in rank_out.items():
            assert took_fused == fused, name
            for e, g in zip(expected, got, strict=True):
                if fused:  # another kernel: equal to float32 rounding
                    torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=name)
                else:  # megatron-core's own forward: bit for bit
                    assert torch.equal(g, e), name
