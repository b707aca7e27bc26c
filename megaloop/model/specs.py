"""Layer specs: which megatron-core modules build a layer, per backend and norm scheme.

The model never forks a megatron-core layer. A norm scheme is a change of *spec* ("Closing the Loop"
(arXiv 2610.00673) App. A):

- `pre`: megatron-core's own GPT layer spec, ``u + B(N(u))``;
- `ouro`: the spec's input norms, and the two bias-dropout-add steps swapped for one that
  normalizes the sub-layer output before it joins the residual, ``u + N2(B(N1(u)))`` (Ouro's
  "four norms per layer");
- `post`: no input norms, the sum is normalized, ``N(u + B(u))``;
- `sandwich`: input norms and a normalized sum, ``N2(u + B(N1(u)))`` (Huginn);
- `magic`: pre-norm whose norms have no learnable scale, ``u + B(N0(u))`` (MagicNorm).

Backends: the local spec builds separate ``input_layernorm`` / ``pre_mlp_layernorm`` modules
(megatron-core maps their checkpoint keys to ``linear_qkv.layer_norm_weight`` /
``linear_fc1.layer_norm_weight``); the Transformer Engine spec fuses those norms into
``linear_qkv`` / ``linear_fc1`` (``TELayerNormColumnParallelLinear``). Schemes that change the input
norms (`post`, `magic`, or AdaLN conditioning that modulates the norm output) therefore unfuse
them on TE: plain ``TEColumnParallelLinear`` linears and the norm in the layer's own slots, whose
checkpoint keys stay the fused names, as the local spec's do. Checkpoint keys are therefore the
same on both backends (tests/test_te_mapping.py builds TE's modules and loads their checkpoint
into the local layers); the TE variants' forward is verified only where a GPU and TE exist
(tests/test_gpu.py).

Stepwise LoRA is a change of spec too: the core's layer spec (``layer_spec(..., lora=...)``) names
adapter-carrying subclasses of its four linear classes (megaloop.model.lora.with_lora); prelude and
coda are built from the plain spec.

The step norm (after each loop step) and the coda's final norm are `rms` (the backend's
learnable norm of ``--normalization``), `frms` (the same without a scale) or `identity`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megaloop.compat import submodules_of, with_submodules
from megaloop.model.attention import SDPADotProductAttention
from megaloop.model.lora import LoRASetup, with_lora

NORM_SCHEMES = ("ouro", "pre", "post", "sandwich", "magic")
STEP_NORMS = ("rms", "frms", "identity")


def norm_spec(use_te: bool) -> type:
    """The norm module class of the backend (configured by TransformerConfig.normalization)."""
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    from megatron.core.models.backends import LocalSpecProvider

    return LocalSpecProvider().layer_norm(rms_norm=True)


class ScaleFreeNorm(torch.nn.Module):
    """RMSNorm (or LayerNorm, per ``--normalization``) without any learnable parameter.

    The build signature of megatron-core norms (``config, hidden_size, eps``), so it fills any
    norm slot of a spec. It has no parameters, hence nothing to shard or tag for SP.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.shape, self.eps = (hidden_size,), eps
        self.rms = config.normalization == "RMSNorm"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return F.rms_norm(x, self.shape, eps=self.eps)
        return F.layer_norm(x, self.shape, eps=self.eps)


class MachineEpsilonNorm(torch.nn.Module):
    """RMSNorm without a learnable parameter whose epsilon is the machine epsilon of the input's
    dtype (``F.rms_norm``'s default): Parcae's QK-norm (--qk-layernorm-scale-free). The build
    signature of megatron-core norms; the ``eps`` it is built with (--norm-epsilon) is not
    this norm's."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):  # noqa: ARG002 - see above
        super().__init__()
        self.shape = (hidden_size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.shape)


class NormedBiasDropoutAdd(MegatronModule):
    """Bias-dropout-add with a norm: ``residual + drop(N(x + b))`` (``where="branch"``, ouro) or
    ``N(residual + drop(x + b))`` (``where="sum"``, post / sandwich).

    TransformerLayer calls ``bda(training, fused)`` and then the returned function with
    ``((x, bias), residual, p)``; this module keeps that protocol, so it drops into the
    ``self_attn_bda`` / ``mlp_bda`` slots of any megatron-core layer spec.
    """

    def __init__(self, config, norm: type, where: str = "branch"):
        super().__init__(config=config)
        if where not in ("branch", "sum"):
            raise ValueError(f"NormedBiasDropoutAdd: where={where!r}, expected branch or sum")
        self.where = where
        self.norm = build_module(norm, config=config, hidden_size=config.hidden_size,
                                 eps=config.layernorm_epsilon)

    def forward(self, training: bool, fused: bool):  # noqa: ARG002 - fused has no meaning here
        def bias_norm_dropout_add(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            if self.where == "branch":
                return residual + F.dropout(self.norm(x), p=prob, training=training)
            return self.norm(residual + F.dropout(x, p=prob, training=training))

        return bias_norm_dropout_add


def _with_input_norms(spec: ModuleSpec, norm, use_te: bool) -> ModuleSpec:
    """``spec`` with both sub-layer input norms replaced by ``norm`` (IdentityOp: none).

    TE fuses the input norms into linear_qkv / linear_fc1; unfuse them into plain TE column
    linears, so the norm sits in the layer's own ``input_layernorm`` / ``pre_mlp_layernorm``.
    Their parameters (a scale, AdaLN's ``timestep_scale``) keep the checkpoint keys the local
    spec gives its separate norms, the fused norms' names, so one checkpoint loads into either
    backend.
    """
    sub = spec.submodules
    attn, mlp = sub.self_attention, sub.mlp
    keys_map = sub.sharded_state_dict_keys_map
    if use_te:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear
        from megatron.core.models.gpt import gpt_layer_specs

        attn = with_submodules(attn, linear_qkv=TEColumnParallelLinear)
        mlp = with_submodules(mlp, linear_fc1=TEColumnParallelLinear)
        local = gpt_layer_specs.get_gpt_layer_local_spec().submodules
        keys_map = {**keys_map, **local.sharded_state_dict_keys_map}
    return with_submodules(spec, self_attention=attn, mlp=mlp, input_layernorm=norm,
                           pre_mlp_layernorm=norm, sharded_state_dict_keys_map=keys_map)


def layer_spec(config, norm_scheme: str, use_te: bool, unfuse_input_norms: bool = False,
               lora: Optional[LoRASetup] = None, qk_scale_free: bool = False) -> ModuleSpec:
    """Spec of one transformer layer for a norm scheme on a backend.

    ``unfuse_input_norms``: keep the input norms as separate modules on TE too (timestep AdaLN
    modulates their output); a no-op on the local backend, whose norms are separate anyway.
    ``lora``: the linears carry stepwise LoRA adapters sharing this setup (the core's spec).
    ``qk_scale_free``: the q/k norms are ``MachineEpsilonNorm`` (--qk-layernorm-scale-free).
    """
    from megatron.core.models.gpt import gpt_layer_specs

    if norm_scheme not in NORM_SCHEMES:
        raise ValueError(f"unknown --norm-scheme {norm_scheme!r}; choose one of "
                         f"{', '.join(NORM_SCHEMES)}")
    if use_te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=config.qk_layernorm)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            qk_layernorm=config.qk_layernorm, normalization=config.normalization)
        # megatron-core's core attention with a fused fast path (megaloop/model/attention.py).
        attention = submodules_of(spec).self_attention
        spec = with_submodules(spec, self_attention=with_submodules(
            attention, core_attention=SDPADotProductAttention))
    if qk_scale_free:
        # Parcae's QK-norm in megatron-core's q/k norm slots (a plain module on either backend)
        attention = submodules_of(spec).self_attention
        spec = with_submodules(spec, self_attention=with_submodules(
            attention, q_layernorm=MachineEpsilonNorm, k_layernorm=MachineEpsilonNorm))
    norm = norm_spec(use_te)
    if norm_scheme == "post":
        spec = _with_input_norms(spec, IdentityOp, use_te)
    elif norm_scheme == "magic":
        spec = _with_input_norms(spec, ScaleFreeNorm, use_te)
    elif unfuse_input_norms and use_te:
        spec = _with_input_norms(spec, norm, use_te)
    if norm_scheme in ("ouro", "post", "sandwich"):
        where = "branch" if norm_scheme == "ouro" else "sum"
        bda = ModuleSpec(module=NormedBiasDropoutAdd,
                         params={"config": config, "norm": norm, "where": where})
        spec = with_submodules(spec, self_attn_bda=bda, mlp_bda=bda)
    if lora is not None:
        spec = with_lora(spec, lora)
    return spec


def step_norm_spec(kind: str, use_te: bool):
    """The module class of a step / final norm (`rms`, `frms`), None for `identity`."""
    if kind not in STEP_NORMS:
        raise ValueError(f"unknown --step-norm {kind!r}; choose one of {', '.join(STEP_NORMS)}")
    return {"rms": norm_spec(use_te), "frms": ScaleFreeNorm, "identity": None}[kind]


def build_norm(config, use_te: bool, kind: str = "rms") -> torch.nn.Module:
    """A free-standing norm (step norm, readout norm) of kind `rms`, `frms` or `identity`."""
    cls = step_norm_spec(kind, use_te)
    if cls is None:
        return IdentityOp()
    norm = build_module(cls, config=config, hidden_size=config.hidden_size,
                        eps=config.layernorm_epsilon)
    if config.sequence_parallel:
        # Under sequence parallelism each rank sees a slice of tokens: the norm's gradient must
        # be summed over the TP group, which megatron-core does for params tagged like this.
        for p in norm.parameters():
            p.sequence_parallel = True
    return norm
