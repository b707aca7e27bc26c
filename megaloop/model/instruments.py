"""Measurement-only loop variants that training and evaluation both use ("Closing the Loop"
(arXiv 2610.00673) Fig. 6, "What Makes Recurrence Effective in Looped Language Models?" (arXiv
2609.36636) App. C.4). They change no result: each only watches the core passes.

- ``StepGradNorms``: the gradient norm of every core layer *per loop step* (Closing the Loop Fig.
  6). A shared layer's gradient is the sum of T contributions, one per application; the
  contribution of step t is the gradient with respect to the weights *as used at step t*. While
  active, every core pass runs on fresh views ``w.view_as(w)`` of its parameters (one set per
  step, through ``torch.func.functional_call``, as a loop variant); autograd passes the gradient
  of each view on to the shared parameter unchanged (megatron DDP's accumulation is untouched),
  and a hook on the view adds it to that step's buffer. Costs T x core-parameter fp32 buffers,
  so the trainer only turns it on for the iterations it logs. The per-step views need the
  forward not to be re-run in the backward pass (no full activation recomputation).
- ``LoopGeometry``: per step t, between the core's input and output states: angular distance
  ``arccos(cos(in, out)) / pi``, relative update norm ``||out - in|| / ||in||``, and the state
  variance (over hidden dims) of ``out``, normalised by that of the last step (the training
  horizon). Per-token values averaged over all tokens. It compares a whole core pass's input
  and output, which one stage sees only at pipeline size 1.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core import parallel_state

from megaloop.device import current_device
from megaloop.model.recurrence import LoopVariant


GEOMETRY_KEYS = ("angular_distance", "relative_update_norm", "state_variance")


def unwrap(model):
    """The LoopedGPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _accumulate_into(buffer: torch.Tensor):
    def hook(grad):
        buffer.add_(grad.float())  # returns None: the gradient flows on unchanged
    return hook


class StepGradNorms(LoopVariant):
    """Per core layer, per loop step: the norm of that step's gradient contribution.

    A loop variant (megaloop/model/recurrence.py), added innermost while capturing: its
    ``around_core`` runs the step's core pass through ``torch.func.functional_call`` with fresh
    views of the core's parameters, so it knows the step from the recurrence (under pipeline
    parallelism: from the virtual chunk) and swaps nothing by hand."""

    def __init__(self, model, num_loops: int):
        self.model = unwrap(model)
        self.core = self.model.core
        self.num_loops = num_loops
        self.layer_params = [list(layer.named_parameters()) for layer in self.core.layers]
        # Global core-layer index of each local layer (megatron-core numbers layers across
        # pipeline stages), so the stages' rows land in one table.
        self.global_index = [layer.layer_number - 1 for layer in self.core.layers]
        self.num_layers = self.core.config.num_layers
        self.buffers = None

    # --- capture ----------------------------------------------------------------------------
    def start(self) -> None:
        """Capture the next forward-backward passes (until ``finish``)."""
        self.buffers = [[{n: torch.zeros_like(p, dtype=torch.float32) for n, p in params}
                         for _ in range(self.num_loops)] for params in self.layer_params]
        self.model.variants.append(self)

    def around_core(self, run, z, attention_mask, rotary_pos_emb, t, ctx):
        if t > self.num_loops:
            raise RuntimeError(f"the core ran loop step {t}; --log-grad-norm-per-step captures "
                               f"{self.num_loops}")
        views = {}
        for i, params in enumerate(self.layer_params):
            for name, p in params:
                if p.requires_grad:
                    view = p.view_as(p)  # its gradient flows on to p unchanged
                    view.register_hook(_accumulate_into(self.buffers[i][t - 1][name]))
                    views[f"layers.{i}.{name}"] = view
        return torch.func.functional_call(
            self.core, views, args=(),
            kwargs={"hidden_states": z, "attention_mask": attention_mask,
                    "rotary_pos_emb": rotary_pos_emb})

    # --- result -----------------------------------------------------------------------------
    def finish(self, num_tokens: int) -> list:
        """Stop capturing; returns norms[layer][step] of the gradient each step contributed,
        reduced and scaled exactly like the main gradient (summed over data-parallel ranks,
        divided by the tokens of the global batch), full-matrix norms under tensor parallelism,
        every core layer of every pipeline stage."""
        self.model.variants.remove(self)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        # Context-parallel ranks hold gradients of their parts of the sequences: summed with DP.
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        # On the accelerator: NCCL reduces GPU tensors only (and the sums stay asynchronous).
        squares = torch.zeros(self.num_layers, self.num_loops, dtype=torch.float64,
                              device=current_device())
        for i, params in enumerate(self.layer_params):
            row = self.global_index[i]
            for t in range(self.num_loops):
                for name, p in params:
                    g = self.buffers[i][t][name]
                    torch.distributed.all_reduce(g, group=dp_group)
                    if getattr(p, "sequence_parallel", False):  # a partial sum per TP rank
                        torch.distributed.all_reduce(g, group=tp_group)
                    if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                        squares[row, t] += g.double().pow(2).sum()
        torch.distributed.all_reduce(squares, group=tp_group)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(squares,
                                         group=parallel_state.get_pipeline_model_parallel_group())
        self.buffers = None
        return (squares.sqrt() / max(num_tokens, 1)).tolist()


class LoopGeometry(LoopVariant):
    """Geometry of the recurrence on validation batches (What Makes Recurrence Effective App. C.4),
    per loop step: a loop variant that, while measuring, compares each core pass's input and
    output (the step index comes from the recurrence)."""

    def __init__(self, model, num_loops: int):
        self.model = unwrap(model)
        self.num_loops = num_loops

    def start(self) -> None:
        # sums over tokens, per step: angular distance, relative update norm, state variance
        # On the accelerator: they are all-reduced (NCCL takes GPU tensors only), and adding
        # GPU sums to them needs no host synchronisation per step.
        self.sums = torch.zeros(3, self.num_loops, dtype=torch.float64, device=current_device())
        self.tokens = torch.zeros(self.num_loops, dtype=torch.float64, device=current_device())
        self.model.variants.append(self)

    def around_core(self, run, z, attention_mask, rotary_pos_emb, t, ctx):
        out = run(z, attention_mask, rotary_pos_emb)
        if t > self.num_loops:  # evaluation at another loop count: ignore the extra
            return out
        u, v = z.detach().float(), out.detach().float()
        cos = torch.nn.functional.cosine_similarity(u, v, dim=-1, eps=1e-12)
        angular = torch.arccos(cos.clamp(-1.0, 1.0)) / math.pi
        update = (v - u).norm(dim=-1) / u.norm(dim=-1).clamp_min(1e-12)
        variance = v.var(dim=-1, unbiased=False)
        self.sums[0, t - 1] += angular.double().sum()
        self.sums[1, t - 1] += update.double().sum()
        self.sums[2, t - 1] += variance.double().sum()
        self.tokens[t - 1] += angular.numel()
        return out

    def finish(self) -> Optional[dict]:
        self.model.variants.remove(self)
        packed = torch.cat([self.sums.flatten(), self.tokens])
        if self.model.config.sequence_parallel:  # each TP rank saw a slice of the tokens
            torch.distributed.all_reduce(packed, group=parallel_state.get_tensor_model_parallel_group())
        # Per-token sums: over data- and context-parallel ranks (each CP rank saw its chunks).
        torch.distributed.all_reduce(
            packed, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        sums = packed[:3 * self.num_loops].view(3, self.num_loops)
        tokens = packed[3 * self.num_loops:]
        if tokens.min().item() == 0:
            return None
        means = sums / tokens
        horizon = means[2, -1].item()
        return {"angular_distance": means[0].tolist(),
                "relative_update_norm": means[1].tolist(),
                "state_variance": (means[2] / horizon if horizon > 0 else means[2]).tolist()}
