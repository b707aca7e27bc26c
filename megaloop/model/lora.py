"""Stepwise LoRA ("Closing the Loop" (arXiv 2610.00673) section 4.4): one rank-r adapter per loop
step on every core linear.

At loop step t the core's linears compute ``W x + (alpha / r) * B_t A_t x`` instead of ``W x``;
the shared W is untouched and B_t starts at 0, so a model with adapters starts out equal to the
model without them. Because B_t = 0, the gradient of A_t is exactly 0 at initialisation
(dL/dA_t = B_t^T ...); only B_t learns in the first step, and A_t from the second step on.

No megatron-core class is forked. After the model is built, ``StepwiseLoRA`` adds one adapter
module next to each target linear (``self_attention.linear_qkv_lora`` beside
``self_attention.linear_qkv``, ...) and registers a forward hook on the linear that adds the
adapter's output. Living inside the layer, the adapters follow the layer's checkpoint keys
(including pipeline layer offsets) and its recomputation, and the base weights keep their names,
so checkpoints with and without LoRA share every base key.

Tensor parallelism mirrors the base linear, and the rank-r bottleneck carries the collective:
- column-parallel base (linear_qkv, linear_fc1): A replicated, B split over output rows like W
  (with the same stride-2 [gate; up] layout as a SwiGLU fc1); ``u = A x`` is copied into the TP
  region (all-reduce of its gradient), or all-gathered over the sequence under SP;
- row-parallel base (linear_proj, linear_fc2): A split over input columns like W, B replicated;
  the partial ``u = A_shard x_shard`` is all-reduced (reduce-scattered over the sequence under
  SP) exactly where the base reduces its output, before the replicated B.
Replicated LoRA parameters that see only a slice of the tokens under SP carry megatron-core's
``sequence_parallel`` tag so their gradients are summed over the TP group.

The step is set around each core pass by the recurrence's ``around_core`` hook, which also keeps it
right under activation recomputation (megaloop.model.loop_step).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                             make_sharded_tensors_for_checkpoint)

from megaloop.model.loop_step import ReselectStep, StepHolder
from megaloop.model.recurrence import LoopVariant

# target linear -> (parent attribute, tensor-parallel kind)
TARGETS = {
    "linear_qkv": ("self_attention", "column"),
    "linear_proj": ("self_attention", "row"),
    "linear_fc1": ("mlp", "column"),
    "linear_fc2": ("mlp", "row"),
}


class LoRAAdapter(MegatronModule):
    """Per-step A_t [r, in], B_t [out, r] for one base linear, sharded like that linear."""

    def __init__(self, config, base: torch.nn.Module, kind: str, num_steps: int, rank: int,
                 alpha: float, step: StepHolder, generator: torch.Generator, stride: int = 1):
        super().__init__(config=config)
        self.kind, self.rank, self.scale, self.step = kind, rank, alpha / rank, step
        self.stride = stride
        tp = parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        out_local, in_local = base.weight.shape
        in_full = in_local * tp if kind == "row" else in_local
        out_full = out_local * tp if kind == "column" else out_local
        self.norm = _fused_input_norm(base, config)
        dtype = config.params_dtype
        self.lora_A = torch.nn.ParameterList()
        self.lora_B = torch.nn.ParameterList()
        for _ in range(num_steps):
            # PEFT's default: A ~ U(-1/sqrt(in), 1/sqrt(in)) (Kaiming-uniform, a=sqrt(5)), drawn as
            # the full matrix from a generator seeded identically on every rank, then sliced, so
            # any TP degree holds the same adapter.
            bound = 1.0 / math.sqrt(in_full)
            a_full = (torch.rand(rank, in_full, generator=generator) * 2 - 1) * bound
            if kind == "row":
                a = a_full.chunk(tp, dim=1)[tp_rank]
                b = torch.zeros(out_full, rank)
            else:
                a = a_full
                b = torch.zeros(out_local, rank)
            a = torch.nn.Parameter(a.to(device=base.weight.device, dtype=dtype).contiguous())
            b = torch.nn.Parameter(b.to(device=base.weight.device, dtype=dtype))
            sharded, replicated = (a, b) if kind == "row" else (b, a)
            tensor_parallel.set_tensor_model_parallel_attributes(
                sharded, is_parallel=True, dim=1 if kind == "row" else 0, stride=stride)
            # The replicated factor sees a slice of the tokens under sequence parallelism on the
            # side where activations are sequence-split (A of a column linear, B of a row linear).
            replicated.sequence_parallel = config.sequence_parallel
            self.lora_A.append(a)
            self.lora_B.append(b)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """(alpha / r) * B_t A_t x on this rank's share, in the base output's layout."""
        t = min(self.step.value, len(self.lora_A)) - 1
        if self.norm is not None:
            x = self.norm(x)
        u = F.linear(x, self.lora_A[t])
        sp = self.config.sequence_parallel
        if self.kind == "column":
            u = tensor_parallel.gather_from_sequence_parallel_region(u) if sp else \
                tensor_parallel.copy_to_tensor_model_parallel_region(u)
        else:
            u = tensor_parallel.reduce_scatter_to_sequence_parallel_region(u) if sp else \
                tensor_parallel.reduce_from_tensor_model_parallel_region(u)
        return F.linear(u, self.lora_B[t]) * self.scale

    def hook(self, module, args, kwargs, output):
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        return out + self.delta(x).to(out.dtype), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Checkpoint keys sharded like the base linear, so a checkpoint reshards on load."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = self.state_dict(prefix="", keep_vars=True)
        sharded = "lora_A" if self.kind == "row" else "lora_B"
        axis = {k: (1 if self.kind == "row" else 0) for k in state if k.startswith(sharded)}
        out = make_sharded_tensors_for_checkpoint(
            state, prefix, axis, sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=metadata["dp_cp_group"])
        if self.stride == 2:
            # A SwiGLU fc1's rows are [gate; up] per rank: store the two halves as megatron-core
            # stores the base fc1 weight, so resharding puts every row back with its half.
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            singleton = (metadata or {}).get("singleton_local_shards", False)
            for k in axis:
                out[f"{prefix}{k}"] = apply_swiglu_sharded_factory(out[f"{prefix}{k}"],
                                                                   sharded_offsets, singleton)
        return out


def _fused_input_norm(base, config):
    """Transformer Engine fuses the layer's input norm into linear_qkv / linear_fc1 (the hook then
    sees the un-normalized input); apply the same norm to the adapter's input. Local spec: None."""
    weight = getattr(base, "layer_norm_weight", None)
    if weight is None:
        return None
    eps = config.layernorm_epsilon
    zero_centered = getattr(config, "layernorm_zero_centered_gamma", False)

    def norm(x):
        w = weight + 1 if zero_centered else weight
        if config.normalization == "RMSNorm":
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        return F.layer_norm(x, (x.shape[-1],), w, getattr(base, "layer_norm_bias", None), eps)

    return norm


class StepwiseLoRA(LoopVariant):
    """Adds per-step adapters to every layer of a core ``TransformerBlock`` (not a module itself:
    the adapters are registered inside the layers, next to the linears they adapt)."""

    def __init__(self, core, config, num_steps: int, rank: int, alpha: float, seed: int):
        self.step = StepHolder()
        self.num_steps = num_steps
        self.adapters: list[LoRAAdapter] = []
        # A private generator: drawing A must not shift the global RNG stream (dropout, the init
        # of modules built later), and it is identical on every rank.
        generator = torch.Generator().manual_seed(seed)
        for layer in core.layers:
            for name, (parent_name, kind) in TARGETS.items():
                parent = getattr(layer, parent_name)
                base = getattr(parent, name)
                stride = 2 if name == "linear_fc1" and config.gated_linear_unit else 1
                adapter = LoRAAdapter(config, base, kind, num_steps, rank, alpha, self.step,
                                      generator, stride)
                parent.add_module(f"{name}_lora", adapter)
                base.register_forward_hook(adapter.hook, with_kwargs=True)
                self.adapters.append(adapter)

    def around_core(self, run, z, attention_mask, rotary_pos_emb, t, ctx):
        """Use step t's adapters (1-based) in this core pass; steps beyond the trained count
        reuse the last adapter (inference at more loops than trained). The output is marked so
        that the backward pass re-selects step t before it recomputes the core."""
        self.step.value = t
        out = run(z, attention_mask, rotary_pos_emb)
        if not torch.is_grad_enabled() or not out.requires_grad:
            return out
        return ReselectStep.apply(out, self.step, t)
