"""Pipeline balance (megaloop/parallel/balance.py) against a hand computation of its cost model.

For two layouts (the pipeline benchmark's shape, where the readout is a fraction of a layer, and a
large vocabulary against a small hidden size, where it outweighs several layers) and a P = 4 one,
the FLOPs per token of a layer and of the readout are written out here from the shapes, every
split Megatron-LM's uneven rule allows is listed by hand, and the split with the smallest slowest
stage (the even one on a tie) must be the one ``balance`` picks, with the bubble of the formula
1 - mean(t) V M / ((V M + P - 1) max(t)). Then a PP = 2 run under ``--pipeline-balance auto``
builds the stages with that split, and the flags are refused where they would be ignored.
"""

import pytest

from megaloop.model.config import LoopConfig, ModelConfig


def _layer_flops(h, seq, ffn, swiglu):
    """Forward FLOPs per token of one layer (multi-head attention, no GQA), by hand."""
    qkv = 2 * h * 3 * h
    proj = 2 * h * h
    attention = 2 * 2 * seq * h          # QK^T and the weighted sum, full square
    mlp = 2 * (3 if swiglu else 2) * h * ffn
    return qkv + proj + attention + mlp


def _hand(h, seq, ffn, swiglu, vocab, T, prelude, coda, gated, readouts, split, M):
    layer = _layer_flops(h, seq, ffn, swiglu)
    readout = readouts * (coda * layer + 2 * h * vocab + (2 * h if gated else 0))
    costs = [n * layer for n in split]
    costs[0] += prelude * layer / T
    costs[-1] += readout / T
    chunks = T * M
    p = len(split)
    bubble = 1 - (sum(costs) / p) * chunks / ((chunks + p - 1) * max(costs))
    return costs, bubble


LAYOUTS = {
    # name: (hidden, seq, vocab, T, prelude, coda, core K, P, M, exit loss, splits by hand)
    "benchmark 0 + 4 x 4 + 0, vocab 1024": (128, 128, 1024, 4, 0, 0, 4, 2, 8, "expected",
                                            [(1, 3), (2, 2), (3, 1)]),
    "large vocab 1 + 4 x 4 + 1, vocab 8192": (64, 64, 8192, 4, 1, 1, 4, 2, 8, "expected",
                                              [(1, 3), (2, 2), (3, 1)]),
    "P = 4, 8 core layers, last-step readout": (128, 128, 16384, 3, 0, 0, 8, 4, 4, "last",
                                                [(1, 3, 3, 1), (2, 2, 2, 2), (1, 2, 2, 3),
                                                 (3, 2, 2, 1), (1, 1, 1, 5), (5, 1, 1, 1),
                                                 (2, 1, 1, 4), (4, 1, 1, 2), (3, 1, 1, 3)]),
}


def _check(name):
    from megaloop.parallel.balance import balance, valid_splits

    h, seq, vocab, T, prelude, coda, K, P, M, exit_loss, splits = LAYOUTS[name]
    model = ModelConfig(num_layers=prelude + K + coda, hidden_size=h, num_attention_heads=4,
                        max_position_embeddings=seq, swiglu=True)
    loop = LoopConfig(num_loops=T, num_prelude_layers=prelude, num_coda_layers=coda,
                      exit_loss=exit_loss)
    assert sorted(valid_splits(K, P)) == sorted(splits)
    readouts = 1 if exit_loss == "last" else T
    hand = {s: _hand(h, seq, 4 * h, True, vocab, T, prelude, coda, loop.gated, readouts, s, M)
            for s in splits}
    even = (K // P,) * P
    best = min(splits, key=lambda s: (round(max(hand[s][0])), s != even, max(s) - min(s)))
    got = balance(model, loop, vocab, seq, P, M)
    assert got.layers == best
    assert got.chunk_cost == pytest.approx(hand[best][0], rel=1e-12)
    assert got.bubble == pytest.approx(hand[best][1], rel=1e-12)
    assert got.theory == pytest.approx((P - 1) / (T * M + P - 1))
    for s in splits:  # the view of any split the flags give
        assert balance(model, loop, vocab, seq, P, M, layers=s).bubble == \
            pytest.approx(hand[s][1], rel=1e-12)
    return got


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_split_is_the_hand_computed_argmin(name):
    _check(name)


def test_the_layouts_choose_differently():
    """The benchmark's shape keeps the even split, the large vocabulary moves layers off the
    last stage: the model's answer depends on the readout, as it must."""
    chosen = {name: _check(name).layers for name in LAYOUTS}
    assert chosen["benchmark 0 + 4 x 4 + 0, vocab 1024"] == (2, 2)
    assert chosen["large vocab 1 + 4 x 4 + 1, vocab 8192"] == (3, 1)


def test_flags_refused_where_they_would_be_ignored():
    from megaloop.parallel.config import ParallelConfig

    with pytest.raises(ValueError, match="--pipeline-balance auto need"):
        ParallelConfig(pipeline_balance="auto").validate_pipeline(4)
    with pytest.raises(ValueError, match="--pipeline-balance auto chooses"):
        ParallelConfig(pipeline_model_parallel_size=2, pipeline_balance="auto",
                       decoder_first_pipeline_num_layers=3).validate_pipeline(4)
    # auto accepts a core that does not split evenly (it picks an uneven split)
    ParallelConfig(pipeline_model_parallel_size=2, pipeline_balance="auto").validate_pipeline(5)
