"""Initial weights independent of the tensor-parallel degree, generated shard by shard.

megaloop builds models with ``use_cpu_initialization`` so that one seed gives the same weights at
any TP degree. megatron-core implements it by generating every full weight on every rank and
keeping the rank's slice (``tensor_parallel.layers._initialize_affine_weight_cpu``): each rank
pays the random numbers of the whole model, whatever TP, and holds the largest full weight (the
embedding) on the host. At 8B parameters that is minutes per rank of single-core generation.

Here a weight is cut into tiles of ``TILE x TILE`` entries of its full shape; each tile is drawn
from its own generator, seeded from (one number drawn per weight from the global CPU stream, the
tile's row and column), and a rank generates only the tiles its shard covers. Entry (i, j) of a
weight is therefore the same number at every TP degree, and a rank's work is its shard's size.
Tiles are always drawn whole (an edge tile is cropped after drawing), so the stream of a tile
does not depend on where a shard boundary cuts it.

This applies to megatron-core's normal initialisers (``init_method_normal``,
``scaled_init_method_normal``: functools.partial of ``torch.nn.init.normal_``), which draw every
entry independently; any other init method, or a layer that asks for its master weight back,
goes through megatron-core's own function unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import sys

import torch
from megatron.core.tensor_parallel import layers as _layers

TILE = 256  # entries per tile side: 64K draws, small next to any shard, large next to seeding

_MEGATRON_INIT = _layers._initialize_affine_weight_cpu


def _normal_parameters(init_method):
    """(mean, std) of an init method that draws each entry from one normal, else None."""
    if (isinstance(init_method, functools.partial) and init_method.func is torch.nn.init.normal_
            and not init_method.args):
        kw = init_method.keywords
        return float(kw.get("mean", 0.0)), float(kw.get("std", 1.0))
    return None


def _tile_seed(weight_seed: int, ti: int, tj: int) -> int:
    digest = hashlib.blake2b(f"{weight_seed}:{ti}:{tj}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed takes < 2**63


def generate_region(weight_seed: int, rows: tuple[int, int], cols: tuple[int, int], mean: float,
                    std: float) -> torch.Tensor:
    """Rows ``[r0, r1)`` and columns ``[c0, c1)`` of the full weight seeded ``weight_seed``
    (float32), drawing only the tiles that overlap them."""
    (r0, r1), (c0, c1) = rows, cols
    out = torch.empty(r1 - r0, c1 - c0, dtype=torch.float32)
    tile = torch.empty(TILE, TILE, dtype=torch.float32)
    generator = torch.Generator()
    for ti in range(r0 // TILE, math.ceil(r1 / TILE)):
        for tj in range(c0 // TILE, math.ceil(c1 / TILE)):
            generator.manual_seed(_tile_seed(weight_seed, ti, tj))
            tile.normal_(mean, std, generator=generator)
            lo_r, hi_r = max(r0, ti * TILE), min(r1, (ti + 1) * TILE)
            lo_c, hi_c = max(c0, tj * TILE), min(c1, (tj + 1) * TILE)
            out[lo_r - r0:hi_r - r0, lo_c - c0:hi_c - c0] = \
                tile[lo_r - ti * TILE:hi_r - ti * TILE, lo_c - tj * TILE:hi_c - tj * TILE]
    return out


def initialize_shard(weight, output_size, input_size, per_partition_size, partition_dim,
                     init_method, stride=1, return_master_weight=False, *,
                     params_dtype=torch.float32, rank=None, world_size=None,
                     skip_set_tensor_parallel_attributes=False):
    """Drop-in for megatron-core's ``_initialize_affine_weight_cpu`` (same arguments, same shard
    layout: chunks ``rank, rank + world_size, ...`` of ``per_partition_size / stride`` along
    ``partition_dim``), generating only this rank's chunks."""
    normal = _normal_parameters(init_method)
    if normal is None or return_master_weight:
        return _MEGATRON_INIT(weight, output_size, input_size, per_partition_size, partition_dim,
                              init_method, stride, return_master_weight,
                              params_dtype=params_dtype, rank=rank, world_size=world_size,
                              skip_set_tensor_parallel_attributes=skip_set_tensor_parallel_attributes)
    if not skip_set_tensor_parallel_attributes:
        _layers.set_tensor_model_parallel_attributes(tensor=weight, is_parallel=True,
                                                     dim=partition_dim, stride=stride)
    if rank is None:
        rank = _layers.get_tensor_model_parallel_rank()
        world_size = _layers.get_tensor_model_parallel_world_size()
    # One draw from the global CPU stream per weight, in construction order: the same draws at
    # every TP degree (and a different weight for every layer).
    weight_seed = int(torch.randint(0, 2**62, (1,)).item())
    chunk = per_partition_size // stride
    pieces = []
    for k in range(stride):
        lo = (rank + k * world_size) * chunk
        span = (lo, lo + chunk)
        rows, cols = (span, (0, input_size)) if partition_dim == 0 else ((0, output_size), span)
        pieces.append(generate_region(weight_seed, rows, cols, *normal))
    with torch.no_grad():
        weight.data.copy_(torch.cat(pieces, dim=partition_dim).to(params_dtype))
    return None


@contextlib.contextmanager
def shard_only_initialization():
    """While active, megatron-core's CPU initialisation (its tensor-parallel layers, and
    Transformer Engine's layers where TE is loaded) generates only each rank's shard."""
    modules = [_layers] + [sys.modules[name] for name in
                           ("megatron.core.extensions.transformer_engine",
                            "megatron.core.transformer.moe.experts")
                           if name in sys.modules]
    saved = [(m, m._initialize_affine_weight_cpu) for m in modules
             if hasattr(m, "_initialize_affine_weight_cpu")]
    for m, _ in saved:
        m._initialize_affine_weight_cpu = initialize_shard
    try:
        yield
    finally:
        for m, original in saved:
            m._initialize_affine_weight_cpu = original
