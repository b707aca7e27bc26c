"""Layer specs: which megatron-core modules build a layer, per backend and norm scheme.

The model never forks a megatron-core layer. A norm scheme is a change of *spec*: `pre` is
megatron-core's own GPT layer spec; `ouro` swaps the two bias-dropout-add steps of that spec for
one that normalizes the sub-layer output before it joins the residual stream (Ouro's "four norms
per layer": the input norms are the spec's own).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module


def norm_spec(use_te: bool) -> type:
    """The norm module class of the backend (configured by TransformerConfig.normalization)."""
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    from megatron.core.models.backends import LocalSpecProvider

    return LocalSpecProvider().layer_norm(rms_norm=True)


class NormedBiasDropoutAdd(MegatronModule):
    """Bias-dropout-add whose branch output is normalized first: ``residual + drop(N(x + b))``.

    TransformerLayer calls ``bda(training, fused)`` and then the returned function with
    ``((x, bias), residual, p)``; this module keeps that protocol, so it drops into the
    ``self_attn_bda`` / ``mlp_bda`` slots of any megatron-core layer spec.
    """

    def __init__(self, config, norm: type):
        super().__init__(config=config)
        self.norm = build_module(norm, config=config, hidden_size=config.hidden_size,
                                 eps=config.layernorm_epsilon)

    def forward(self, training: bool, fused: bool):  # noqa: ARG002 - fused has no meaning here
        def bias_norm_dropout_add(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            x = self.norm(x)
            return residual + F.dropout(x, p=prob, training=training)

        return bias_norm_dropout_add


def layer_spec(config, norm_scheme: str, use_te: bool) -> ModuleSpec:
    """Spec of one transformer layer for a norm scheme (`pre`, `ouro`) on a backend."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=config.qk_layernorm)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            qk_layernorm=config.qk_layernorm, normalization=config.normalization)
    if norm_scheme == "pre":
        return spec
    if norm_scheme == "ouro":
        bda = ModuleSpec(module=NormedBiasDropoutAdd,
                         params={"config": config, "norm": norm_spec(use_te)})
        submodules = dataclasses.replace(spec.submodules, self_attn_bda=bda, mlp_bda=bda)
        return dataclasses.replace(spec, submodules=submodules)
    raise ValueError(f"unknown --norm-scheme {norm_scheme!r}; choose ouro or pre")


def build_norm(config, use_te: bool) -> torch.nn.Module:
    """A free-standing norm (step norm, readout norm) from the backend's norm spec."""
    norm = build_module(norm_spec(use_te), config=config, hidden_size=config.hidden_size,
                        eps=config.layernorm_epsilon)
    if config.sequence_parallel:
        # Under sequence parallelism each rank sees a slice of tokens: the norm's gradient must
        # be summed over the TP group, which megatron-core does for params tagged like this.
        for p in norm.parameters():
            p.sequence_parallel = True
    return norm
