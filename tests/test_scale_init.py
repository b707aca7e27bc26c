"""Initialisation at scale: each rank draws only its shard of every weight, and the weights are
the same numbers at every TP degree (megaloop.model.sharded_init)."""

import functools

import pytest
import torch
from torch.overrides import TorchFunctionMode

from distributed import run_distributed, setup_parallel
from reference import full_params
from flags import llama_style
from megaloop.model import sharded_init


class CountDraws(TorchFunctionMode):
    """Counts the normal draws made (elements filled by ``Tensor.normal_``)."""

    def __init__(self):
        super().__init__()
        self.drawn = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.normal_:
            self.drawn += args[0].numel()
        return func(*args, **(kwargs or {}))


def _reference_full(weight_seed, rows, cols, std):
    """The full weight by the rule, written out tile by tile (independent of any sharding)."""
    t = sharded_init.TILE
    full = torch.empty(-(-rows // t) * t, -(-cols // t) * t)
    for ti in range(full.shape[0] // t):
        for tj in range(full.shape[1] // t):
            g = torch.Generator().manual_seed(sharded_init._tile_seed(weight_seed, ti, tj))
            full[ti * t:(ti + 1) * t, tj * t:(tj + 1) * t] = torch.empty(t, t).normal_(
                0.0, std, generator=g)
    return full[:rows, :cols]


@pytest.mark.parametrize("partition_dim,stride", [(0, 1), (0, 2), (1, 1)])
def test_shards_at_any_tp_are_slices_of_one_full_weight(partition_dim, stride):
    # Not multiples of the tile: edge tiles, and shard boundaries that cut tiles.
    rows, cols = (2104, 600) if partition_dim == 0 else (600, 2104)
    init = functools.partial(torch.nn.init.normal_, mean=0.0, std=0.02)
    full_size = rows if partition_dim == 0 else cols
    for world in (1, 2, 4):
        per = full_size // world
        shards = []
        for rank in range(world):
            shape = (per, cols) if partition_dim == 0 else (rows, per)
            w = torch.nn.Parameter(torch.empty(shape))
            torch.manual_seed(5)  # every rank of a run draws the same weight seed
            with CountDraws() as count:
                sharded_init.initialize_shard(w, rows, cols, per, partition_dim, init,
                                              stride=stride, rank=rank, world_size=world)
            shards.append(w.detach())
            # Work is the shard's, not the full weight's: at most one extra tile row/column per
            # chunk boundary.
            t = sharded_init.TILE
            budget = (per + 2 * t * stride) * (cols + t) if partition_dim == 0 else \
                (rows + t) * (per + 2 * t * stride)
            assert count.drawn <= budget, (world, rank, count.drawn)
            if world == 4:
                assert count.drawn < 0.75 * rows * cols
        torch.manual_seed(5)
        expected = _reference_full(int(torch.randint(0, 2**62, (1,)).item()), rows, cols, 0.02)
        # megatron-core's layout: chunk c of per/stride along the dim goes to rank c % world.
        chunks = expected.split(per // stride, dim=partition_dim)
        for rank, shard in enumerate(shards):
            want = torch.cat(chunks[rank::world], dim=partition_dim)
            assert torch.equal(shard, want), (world, rank)


def test_other_init_methods_take_megatron_cores_path():
    w = torch.nn.Parameter(torch.empty(8, 4))
    init = torch.nn.init.xavier_normal_  # depends on the full shape: not drawn tile by tile
    torch.manual_seed(3)
    with CountDraws() as count:
        sharded_init.initialize_shard(w, 16, 4, 8, 0, init, rank=1, world_size=2)
    torch.manual_seed(3)
    master = torch.empty(16, 4)
    init(master)
    assert torch.equal(w.detach(), master[8:]) and count.drawn == 16 * 4


def _model_weights(rank, world):
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    setup_parallel(world)
    # Wide enough that shards span several tiles (work per rank ~ 1 / TP).
    model_cfg = llama_style(num_layers=1, hidden_size=512, num_attention_heads=4,
                            num_query_groups=2, ffn_hidden_size=1024, max_position_embeddings=16,
                            untie_embeddings_and_output_weights=True)
    with CountDraws() as count:
        model = build_model(model_cfg, LoopConfig(num_loops=2), 1024, tp_size=world)
    assert sharded_init._layers._initialize_affine_weight_cpu is sharded_init._MEGATRON_INIT
    return full_params(model), count.drawn


def test_looped_model_tp2_initial_weights_equal_tp1():
    (ref, drawn1), = run_distributed(_model_weights, 1)
    for world in (2,):  # TP=4 shards: test_shards_at_any_tp_are_slices_of_one_full_weight
        for params, drawn in run_distributed(_model_weights, world):
            assert params.keys() == ref.keys()
            for k in ref:
                assert torch.equal(params[k], ref[k]), (world, k)
            assert drawn < drawn1 / world * 1.25, (world, drawn, drawn1)
