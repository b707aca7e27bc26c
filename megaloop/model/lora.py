"""Stepwise LoRA ("Closing the Loop" (arXiv 2610.00673) section 4.4): one rank-r adapter per loop
step on every core linear.

At loop step t the core's linears compute ``W x + (alpha / r) * B_t A_t x`` instead of ``W x``;
the shared W is untouched and B_t starts at 0, so a model with adapters starts out equal to the
model without them. Because B_t = 0, the gradient of A_t is exactly 0 at initialisation
(dL/dA_t = B_t^T ...); only B_t learns in the first step, and A_t from the second step on.

No megatron-core class is forked and no hook is registered. The core's layer spec names, for
linear_qkv / linear_proj / linear_fc1 / linear_fc2, a subclass of the class the spec had
(``lora_linear``: local ``ColumnParallelLinear`` / ``RowParallelLinear``, or the Transformer Engine
linears) whose forward adds the adapter's output to the base output. The adapters are children of
the linear (``self_attention.linear_qkv.lora_A.0``), so they follow the layer's checkpoint keys
(including pipeline layer offsets) and its recomputation, and the base weights keep their names:
checkpoints with and without LoRA share every base key. Prelude and coda keep plain linears.
The Transformer Engine subclasses (of TELayerNormColumnParallelLinear, TEColumnParallelLinear,
TERowParallelLinear) are written the same way but unverified: they run only with a GPU and TE.

Tensor parallelism mirrors the base linear, and the rank-r bottleneck carries the collective:
- column-parallel base (linear_qkv, linear_fc1): A replicated, B split over output rows like W
  (with the same stride-2 [gate; up] layout as a SwiGLU fc1); ``u = A x`` is copied into the TP
  region (all-reduce of its gradient), or all-gathered over the sequence under SP;
- row-parallel base (linear_proj, linear_fc2): A split over input columns like W, B replicated;
  the partial ``u = A_shard x_shard`` is all-reduced (reduce-scattered over the sequence under
  SP) exactly where the base reduces its output, before the replicated B.
Replicated LoRA parameters that see only a slice of the tokens under SP carry megatron-core's
``sequence_parallel`` tag so their gradients are summed over the TP group.

The step is a ``StepHolder`` shared by every adapted linear of the core (handed to them through
the spec's params); ``StepwiseLoRA.around_core`` sets it around each core pass and keeps it right
under activation recomputation (megaloop.model.loop_step).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.spec_utils import ModuleSpec, get_module
from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                             make_sharded_tensors_for_checkpoint)

from megaloop.compat import submodules_of, with_submodules
from megaloop.model.loop_step import ReselectStep, StepHolder
from megaloop.model.recurrence import LoopVariant

# target linear -> (parent submodule in the layer spec, tensor-parallel kind)
TARGETS = {
    "linear_qkv": ("self_attention", "column"),
    "linear_proj": ("self_attention", "row"),
    "linear_fc1": ("mlp", "column"),
    "linear_fc2": ("mlp", "row"),
}


@dataclasses.dataclass(eq=False)
class LoRASetup:
    """What every adapted linear of one core shares; the spec hands it to each as ``lora=``."""

    num_steps: int
    rank: int
    alpha: float
    step: StepHolder
    generator: torch.Generator
    """Draws every A, in the order megatron-core builds the linears (per layer: linear_proj,
    linear_qkv, linear_fc1, linear_fc2; per linear: step 1..T); private, so that building
    adapters does not shift the global RNG stream (the base weights, dropout), and seeded alike
    on every rank."""


class _LoRALinear:
    """Mixed in before a tensor-parallel linear class by ``lora_linear``: per-step A_t [r, in],
    B_t [out, r] sharded like that linear, added to its output."""

    lora_kind = "column"  # set per subclass

    def __init__(self, input_size, output_size, *args, lora: LoRASetup, **kwargs):
        super().__init__(input_size, output_size, *args, **kwargs)
        config = kwargs["config"]
        self.lora_step, self.lora_scale = lora.step, lora.alpha / lora.rank
        # megatron-core's MLP builds a SwiGLU fc1 with stride 2 ([gate; up] per rank).
        self.lora_stride = kwargs.get("stride", 1)
        self.lora_sp = config.sequence_parallel
        # Transformer Engine fuses the layer's input norm into linear_qkv / linear_fc1: the
        # forward then receives the un-normalized input, and the adapter applies the same norm.
        self.lora_fused_norm = getattr(self, "layer_norm_weight", None) is not None
        row = self.lora_kind == "row"
        tp = parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        out_local, in_local = self.weight.shape
        in_full = in_local * tp if row else in_local
        device, dtype = self.weight.device, config.params_dtype
        self.lora_A = torch.nn.ParameterList()
        self.lora_B = torch.nn.ParameterList()
        for _ in range(lora.num_steps):
            # PEFT's default: A ~ U(-1/sqrt(in), 1/sqrt(in)) (Kaiming-uniform, a=sqrt(5)), drawn as
            # the full matrix, then sliced, so any TP degree holds the same adapter.
            bound = 1.0 / math.sqrt(in_full)
            a = (torch.rand(lora.rank, in_full, generator=lora.generator) * 2 - 1) * bound
            if row:
                a = a.chunk(tp, dim=1)[tp_rank]
            b = torch.zeros(out_local, lora.rank)  # split like W's rows, or full (row kind)
            a = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
            b = torch.nn.Parameter(b.to(device=device, dtype=dtype))
            sharded, replicated = (a, b) if row else (b, a)
            tensor_parallel.set_tensor_model_parallel_attributes(
                sharded, is_parallel=True, dim=1 if row else 0, stride=self.lora_stride)
            # The replicated factor sees a slice of the tokens under sequence parallelism on the
            # side where activations are sequence-split (A of a column linear, B of a row linear).
            replicated.sequence_parallel = config.sequence_parallel
            self.lora_A.append(a)
            self.lora_B.append(b)

    def forward(self, input_, *args, **kwargs):
        out, bias = super().forward(input_, *args, **kwargs)
        return out + self.lora_delta(input_).to(out.dtype), bias

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """(alpha / r) * B_t A_t x on this rank's share, in the base output's layout; steps
        beyond the trained count use the last adapter."""
        t = min(self.lora_step.value, len(self.lora_A)) - 1
        if self.lora_fused_norm:
            x = self._lora_input_norm(x)
        u = F.linear(x, self.lora_A[t])
        if self.lora_kind == "column":
            u = tensor_parallel.gather_from_sequence_parallel_region(u) if self.lora_sp else \
                tensor_parallel.copy_to_tensor_model_parallel_region(u)
        else:
            u = tensor_parallel.reduce_scatter_to_sequence_parallel_region(u) if self.lora_sp \
                else tensor_parallel.reduce_from_tensor_model_parallel_region(u)
        return F.linear(u, self.lora_B[t]) * self.lora_scale

    def _lora_input_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The norm TE's LayerNormLinear applies to its input (unverified without TE)."""
        config = self.config  # every megatron-core / TE linear keeps its config
        eps = config.layernorm_epsilon
        w = self.layer_norm_weight
        if getattr(config, "layernorm_zero_centered_gamma", False):
            w = w + 1
        if config.normalization == "RMSNorm":
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        return F.layer_norm(x, (x.shape[-1],), w, getattr(self, "layer_norm_bias", None), eps)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The base linear's entries as its class shards them (one axis over its whole state
        dict), with the adapters replaced by entries sharded like the base, so a checkpoint
        reshards on load."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        state = {**self.lora_A.state_dict(prefix="lora_A.", keep_vars=True),
                 **self.lora_B.state_dict(prefix="lora_B.", keep_vars=True)}
        row = self.lora_kind == "row"
        sharded = "lora_A." if row else "lora_B."
        axis = {k: (1 if row else 0) for k in state if k.startswith(sharded)}
        adapters = make_sharded_tensors_for_checkpoint(
            state, prefix, axis, sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=metadata["dp_cp_group"])
        if self.lora_stride == 2:
            # A SwiGLU fc1's rows are [gate; up] per rank: store the two halves as megatron-core
            # stores the base fc1 weight (MLP.sharded_state_dict wraps only weight and bias), so
            # resharding puts every row back with its half.
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            singleton = metadata.get("singleton_local_shards", False)
            for k in axis:
                adapters[prefix + k] = apply_swiglu_sharded_factory(
                    adapters[prefix + k], sharded_offsets, singleton)
        out.update(adapters)
        return out


@functools.lru_cache(maxsize=None)
def lora_linear(base: type, kind: str) -> type:
    """``base`` (a megatron-core or Transformer Engine tensor-parallel linear class) with
    per-step adapters; ``kind`` is its parallel layout, ``column`` or ``row``. One class per
    (base, kind), so a spec built twice names the same class."""
    if kind not in ("column", "row"):
        raise ValueError(f"lora_linear: kind={kind!r}, expected column or row")
    return type(f"LoRA{base.__name__}", (_LoRALinear, base),
                {"lora_kind": kind, "__module__": __name__,
                 "__doc__": f"{base.__name__} with stepwise LoRA adapters ({kind}-parallel)."})


def with_lora(spec: ModuleSpec, lora: LoRASetup) -> ModuleSpec:
    """A transformer-layer spec whose four target linears carry stepwise adapters; whatever
    class (and params) the spec had for each is kept as the base."""
    sub = submodules_of(spec)
    parents = {}
    for name, (parent, kind) in TARGETS.items():
        parent_spec = parents.get(parent, getattr(sub, parent))
        target = getattr(submodules_of(parent_spec), name)
        params = dict(target.params) if isinstance(target, ModuleSpec) else {}
        adapted = ModuleSpec(module=lora_linear(get_module(target), kind),
                             params={**params, "lora": lora})
        parents[parent] = with_submodules(parent_spec, **{name: adapted})
    return with_submodules(spec, **parents)


class StepwiseLoRA(LoopVariant):
    """The loop variant of stepwise LoRA: owns the step the core's adapted linears read, and the
    generator their A matrices are drawn from (not a module: the adapters live in the linears).
    Build it before the core, whose layer spec gets ``setup`` (megaloop.model.specs.layer_spec)."""

    def __init__(self, num_steps: int, rank: int, alpha: float, seed: int):
        self.step = StepHolder()
        self.num_steps = num_steps
        self.setup = LoRASetup(num_steps, rank, alpha, self.step,
                               torch.Generator().manual_seed(seed))

    def around_core(self, run, z, attention_mask, rotary_pos_emb, t, ctx):
        """Use step t's adapters (1-based) in this core pass; steps beyond the trained count
        reuse the last adapter (inference at more loops than trained). The output is marked so
        that the backward pass re-selects step t before it recomputes the core."""
        self.step.value = t
        out = run(z, attention_mask, rotary_pos_emb)
        if not torch.is_grad_enabled() or not out.requires_grad:
            return out
        return ReselectStep.apply(out, self.step, t)
