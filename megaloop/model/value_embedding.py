"""``--value-embeddings``: a token-indexed table added to the values of every other layer.

Parcae ("Parcae: Scaling Laws For Stable Looped Language Models") takes these value embeddings
from nanochat: in the layers ``has_value_embedding`` picks, attention's value for head h of a
token with id i becomes

    v_h = W_v,h x + 2 sigmoid(G_h x[:32]) * E_i,h

with E a [vocab, kv heads x head dim] table and G a [kv heads, 32] gate reading the first 32
channels of the attention input (the layer's input norm output), so the gate is in (0, 2).
A core layer keeps its one table over every loop step (the tokens do not change between steps).

The layers: number the model's layers once through, prelude, core, coda, 0..n-1; a layer has a
table when its number has the parity of n - 1 (every other layer, the last one included). Each
block is built from a list of layer specs (megatron-core's ``TransformerBlockSubmodules``), the
picked layers naming a subclass of the spec's ``linear_qkv`` class (as stepwise LoRA does,
megaloop/model/lora.py) that adds the term to the value rows of its output; no megatron-core
class is forked. Under pipeline parallelism a stage's core layers are numbered from its offset.

The forward's token ids reach the layers through a holder the model sets once per forward
(``recurrence.context``); where activation recomputation re-runs a block during the backward
pass, ``layer_forward.call`` has put the forward's ids back first (``ReselectStep``).

Tensor parallelism: a rank holds its query groups' columns of E and rows of G (TP-sharded
parameters, dims 1 and 0), so the term lands on its own value rows with no collective in the
forward; the gate's input is copied into the TP region (its gradient summed over the ranks).
Sequence parallelism (the attention input is then split over the sequence) and Transformer
Engine's fused input norm are refused by ``ModelConfig.validate``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.spec_utils import ModuleSpec, get_module
from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                             make_sharded_tensors_for_checkpoint)

from megaloop.compat import submodules_of, with_submodules

GATE_CHANNELS = 32
"""The attention input's channels the gate reads (Parcae's ``ve_gate_channels``)."""


def has_value_embedding(index: int, num_layers: int) -> bool:
    """Whether layer ``index`` (0-based, prelude, core, coda numbered once through) of
    ``num_layers`` has a table: every other layer, ending at the last."""
    return index % 2 == (num_layers - 1) % 2


class ValueTokens:
    """The token ids [b, s] of the forward in flight, and the generator fresh tables draw from.
    One per model, shared by every value-embedding linear."""

    def __init__(self, seed: int):
        self.value = None
        self.generator = torch.Generator().manual_seed(seed)


class _ValueEmbeddingLinear:
    """Mixed in before linear_qkv's class by ``value_embedding_linear``: a table and a gate per
    rank's query groups, their term added to the value rows of the fused QKV output."""

    def __init__(self, input_size, output_size, *args, value_tokens: ValueTokens,
                 vocab_size: int, **kwargs):
        super().__init__(input_size, output_size, *args, **kwargs)
        config = kwargs["config"]
        self.value_tokens = value_tokens
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        heads = config.num_attention_heads
        groups = config.num_query_groups or heads
        self.head_dim = config.kv_channels or config.hidden_size // heads
        self.groups, self.per_group = groups // tp, heads // groups
        # Drawn whole and sliced, so any TP degree holds the same numbers: the table as an
        # embedding (normal, --init-method-std), the gate zero (every gate starts at 1).
        full = torch.randn(vocab_size, groups * self.head_dim,
                           generator=value_tokens.generator) * config.init_method_std
        table = full.chunk(tp, dim=1)[rank].contiguous()
        gate = torch.zeros(self.groups, GATE_CHANNELS)
        device, dtype = self.weight.device, config.params_dtype
        self.value_embedding = torch.nn.Parameter(table.to(device=device, dtype=dtype))
        self.value_gate = torch.nn.Parameter(gate.to(device=device, dtype=dtype))
        tensor_parallel.set_tensor_model_parallel_attributes(
            self.value_embedding, is_parallel=True, dim=1, stride=1)
        tensor_parallel.set_tensor_model_parallel_attributes(
            self.value_gate, is_parallel=True, dim=0, stride=1)

    def forward(self, input_, *args, **kwargs):
        out, bias = super().forward(input_, *args, **kwargs)
        return self._with_value_embedding(out, input_), bias

    def _with_value_embedding(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        tokens = self.value_tokens.value
        if tokens is None:
            raise RuntimeError("--value-embeddings: no token ids for this forward (the model "
                               "sets them in recurrence.context)")
        s, b = out.shape[:2]
        # [b, s] ids -> [s, b, groups, head_dim] of this rank's columns
        table = F.embedding(tokens.t(), self.value_embedding).view(s, b, self.groups,
                                                                   self.head_dim)
        u = tensor_parallel.copy_to_tensor_model_parallel_region(x[..., :GATE_CHANNELS])
        gate = 2 * torch.sigmoid(F.linear(u, self.value_gate))  # [s, b, groups]
        # [s, b, groups, per + 2, dim]: each group's queries, its key, its value (megatron-core)
        parts = out.view(s, b, self.groups, self.per_group + 2, self.head_dim)
        value = parts[:, :, :, -1] + (gate.unsqueeze(-1) * table).to(out.dtype)
        return torch.cat([parts[:, :, :, :-1], value.unsqueeze(3)], dim=3).view_as(out)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The base linear's entries, and the table and gate sharded as they are (columns,
        rows), so a checkpoint reshards on load. megatron-core stores a block's layers as one
        tensor per name with a layer axis, which only some layers having a table would leave
        with holes: each table is its own entry, named by its layer's place in the block."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for name in ("value_embedding", "value_gate"):  # (the base's: replicated, stacked)
            out.pop(prefix + name)
        where = "".join(f".{offset}" for _, offset, _ in sharded_offsets)
        state = {f"value_embedding{where}": self.value_embedding,
                 f"value_gate{where}": self.value_gate}
        made = make_sharded_tensors_for_checkpoint(
            state, prefix, {f"value_embedding{where}": 1, f"value_gate{where}": 0}, (),
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=metadata["dp_cp_group"])
        for name in ("value_embedding", "value_gate"):  # stored by layer, loaded as the module's
            out[prefix + name] = made[f"{prefix}{name}{where}"]
        return out


@functools.lru_cache(maxsize=None)
def value_embedding_linear(base: type) -> type:
    """``base`` (linear_qkv's class) with a value-embedding table; one class per base."""
    return type(f"ValueEmbedding{base.__name__}", (_ValueEmbeddingLinear, base),
                {"__module__": __name__,
                 "__doc__": f"{base.__name__} adding value embeddings to its value rows."})


def with_value_embedding(spec: ModuleSpec, tokens: ValueTokens, vocab_size: int) -> ModuleSpec:
    """A layer spec whose linear_qkv adds value embeddings (its class and params kept)."""
    attention = submodules_of(spec).self_attention
    target = submodules_of(attention).linear_qkv
    params = dict(target.params) if isinstance(target, ModuleSpec) else {}
    linear = ModuleSpec(module=value_embedding_linear(get_module(target)),
                        params={**params, "value_tokens": tokens, "vocab_size": vocab_size})
    return with_submodules(spec, self_attention=with_submodules(attention, linear_qkv=linear))


def block_spec(config, spec: ModuleSpec, first: int, total: int, tokens: ValueTokens,
               vocab_size: int):
    """The layer specs of a block whose layer 0 is layer ``first`` of ``total`` numbered once
    through (module docstring): the picked layers with value embeddings. ``config`` is the
    block's (under pipeline parallelism the core stage's: its offset is added)."""
    from megatron.core.transformer.transformer_block import (LayerNormImpl,
                                                             TransformerBlockSubmodules,
                                                             get_num_layers_to_build)
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    n = get_num_layers_to_build(config)
    offset = get_transformer_layer_offset(config) if config.pipeline_model_parallel_size > 1 \
        else 0
    with_ve = with_value_embedding(spec, tokens, vocab_size)
    layers = [with_ve if has_value_embedding(first + offset + i, total) else spec
              for i in range(n)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=LayerNormImpl)
