"""The FLOP model of a looped model: forward matmul FLOPs per *application* of a layer.

A looped model runs its core T times, and the coda, head and gate once per read-out step; counting
parameters instead would under-report a looped model by about T times. Both the throughput line
(megaloop.training.metrics: TFLOP/s/GPU) and the pipeline cost model
(megaloop.parallel.balance) count with these formulas, so they sit here, below both: the model's
shape is all they read.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megaloop.model.config import LoopConfig, ModelConfig
from megaloop.model.spiral import num_chunks
from megaloop.model.spiral_schedule import chunk_sizes, is_active, offset


def readouts_per_forward(loop: LoopConfig) -> int:
    """How many steps run coda + head: every step, except in `last` mode (and dense T=1)."""
    return 1 if loop.exit_loss == "last" or loop.num_loops == 1 else loop.num_loops


def flops_per_iteration(model: ModelConfig, loop: LoopConfig, vocab_size: int,
                        seq_length: int, global_batch: int,
                        num_loops: Optional[int] = None) -> float:
    """Model FLOPs of one training iteration (forward + backward = 3 x forward matmul FLOPs).

    ``num_loops``: the loop count the iteration ran, when it is not ``loop.num_loops`` (random
    depth draws T per step, and the core, coda and head run that many times).
    """
    if num_loops is not None and num_loops != loop.num_loops:
        loop = dataclasses.replace(loop, num_loops=num_loops)
    h = model.hidden_size
    per_layer = layer_flops_per_token(model, seq_length)
    r = readouts_per_forward(loop)
    layer_apps = loop.num_prelude_layers + loop.num_coda_layers * r
    head = r * (2 * h * vocab_size + (2 * h if loop.gated else 0))
    return 3.0 * global_batch * seq_length * (
        layer_apps * per_layer + core_flops_per_token(model, loop, seq_length) + head)


def layer_flops_per_token(model: ModelConfig, seq_length: int) -> float:
    """Forward matmul FLOPs of one transformer layer per token of a sequence of seq_length."""
    h = model.hidden_size
    heads = model.num_attention_heads
    head_dim = model.kv_channels or h // heads
    kv = (model.num_query_groups or heads) * head_dim
    ffn = model.ffn_hidden_size or 4 * h
    return (2 * h * (heads * head_dim + 2 * kv)      # QKV projection
            + 2 * heads * head_dim * h                # output projection
            + 2 * 2 * seq_length * heads * head_dim   # scores and weighted sum (full square)
            + 2 * (3 if model.swiglu else 2) * h * ffn)


def core_step_flops_per_token(model: ModelConfig, loop: LoopConfig, seq_length: int) -> list:
    """Forward FLOPs of each loop step's core pass, per token of the full sequence. A step at
    chunk size g (SpiralFormer, --loop-resolutions) runs the K core layers on L_t = (L + omega) // g latents
    (attention on an L_t square), plus its matmul operators (scorer d -> 1 per token, allocation
    d -> g per latent); MeSH adds its d -> B routers (elementwise pooling, mixing and norms are
    not counted, as nowhere else)."""
    h, K = model.hidden_size, loop.num_core_layers(model.num_layers)
    steps = []
    for g in chunk_sizes(loop):
        L_t = num_chunks(seq_length, g, offset(g, loop.resolution_offset)) if g > 1 else seq_length
        flops = K * layer_flops_per_token(model, L_t) * L_t / seq_length
        if g > 1:
            flops += (2 * h if loop.resolution_down == "self-aggregation" else 0) + \
                (2 * h * g * L_t / seq_length if loop.resolution_up == "allocation" else 0)
        steps.append(flops)
    if is_active(loop) and loop.loop_topology == "mesh":
        B = loop.mesh_slots or loop.num_loops + 3
        steps = [f + 2 * (2 * h * B) for f in steps]          # write and read router per step
        steps[0] += 2 * (2 * h * B)                            # transitional write-read
        steps[-1] += 2 * h * B                                 # final read
    return steps


def core_flops_per_token(model: ModelConfig, loop: LoopConfig, seq_length: int) -> float:
    """All loop steps' core FLOPs per token (K x T layer applications for the plain loop)."""
    return sum(core_step_flops_per_token(model, loop, seq_length))
