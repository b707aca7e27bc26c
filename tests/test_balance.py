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


def _hand(h, seq, ffn, swiglu, vocab, T, prelude, coda, gated, readouts, split, M, first=0):
    """Chunk costs and bubble of ``split`` with the LM head of ``first`` steps on stage 0."""
    layer = _layer_flops(h, seq, ffn, swiglu)
    head = 2 * h * vocab
    readout = readouts * (coda * layer + head + (2 * h if gated else 0))
    costs = [n * layer for n in split]
    costs[0] += (prelude * layer + first * head) / T
    costs[-1] += (readout - first * head) / T
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
    "large vocab 0 + 4 x 4 + 0, vocab 16384": (64, 128, 16384, 4, 0, 0, 4, 2, 8, "expected",
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
    # The first stage can take LM losses only with a tied head, no coda and an objective that
    # reads every step: then 0..T-1 of them, else none.
    firsts = range(T) if coda == 0 and exit_loss == "expected" else [0]
    hand = {(s, n): _hand(h, seq, 4 * h, True, vocab, T, prelude, coda, loop.gated, readouts,
                          s, M, n)
            for s in splits for n in firsts}
    even = (K // P,) * P
    best = min(hand, key=lambda c: (round(max(hand[c][0])), c[1], c[0] != even,
                                    max(c[0]) - min(c[0])))
    got = balance(model, loop, vocab, seq, P, M)
    assert (got.layers, got.first_readouts) == best
    assert got.chunk_cost == pytest.approx(hand[best][0], rel=1e-12)
    assert got.bubble == pytest.approx(hand[best][1], rel=1e-12)
    assert got.theory == pytest.approx((P - 1) / (T * M + P - 1))
    for s in splits:  # the view of any split the flags give, without readouts moved
        assert balance(model, loop, vocab, seq, P, M, layers=s, first_readouts=0).bubble == \
            pytest.approx(hand[s, 0][1], rel=1e-12)
    return got


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_split_is_the_hand_computed_argmin(name):
    _check(name)


def test_the_layouts_choose_differently():
    """The benchmark's shape keeps the even split and moves two of the four LM losses to the
    first stage; the large vocabulary with a coda (whose losses cannot move) moves a layer off
    the last stage; without a coda it moves losses, not layers: the model's answer depends on
    the readout, as it must."""
    chosen = {name: (_check(name).layers, _check(name).first_readouts) for name in LAYOUTS}
    assert chosen["benchmark 0 + 4 x 4 + 0, vocab 1024"] == ((2, 2), 2)
    assert chosen["large vocab 1 + 4 x 4 + 1, vocab 8192"] == ((3, 1), 0)
    assert chosen["large vocab 0 + 4 x 4 + 0, vocab 16384"][1] > 0


def test_flags_refused_where_they_would_be_ignored():
    from megaloop.parallel.config import ParallelConfig

    with pytest.raises(ValueError, match="--pipeline-balance auto and --pipeline-first-stage-"
                                         "readouts need"):
        ParallelConfig(pipeline_balance="auto").validate_pipeline(4)
    with pytest.raises(ValueError, match="--pipeline-balance auto chooses"):
        ParallelConfig(pipeline_model_parallel_size=2, pipeline_balance="auto",
                       decoder_first_pipeline_num_layers=3).validate_pipeline(4)
    # auto accepts a core that does not split evenly (it picks an uneven split)
    ParallelConfig(pipeline_model_parallel_size=2, pipeline_balance="auto").validate_pipeline(5)
    with pytest.raises(ValueError, match="need --pipeline-model-parallel-size > 1"):
        ParallelConfig(pipeline_first_stage_readouts=1).validate_pipeline(4)
    with pytest.raises(ValueError, match="--pipeline-first-stage-readouts -1 must be >= 0"):
        ParallelConfig(pipeline_model_parallel_size=2,
                       pipeline_first_stage_readouts=-1).validate_pipeline(4)


@pytest.mark.parametrize("flags,message", [
    (["--untie-embeddings-and-output-weights"], "tied to the embedding"),
    (["--num-layers", "3", "--num-coda-layers", "1"], "without coda layers"),
    (["--exit-loss", "last"], "--exit-loss expected or smoothed"),
    (["--step-norm-placement", "readout"], "--step-norm-placement recurrent"),
    (["--loop-resolutions", "1/2,1,1"], "SpiralFormer"),
    (["--num-loops", "2", "--pipeline-first-stage-readouts", "2"], "exceeds --num-loops 2 - 1"),
])
def test_first_stage_readouts_refused_where_they_cannot_run(flags, message):
    """Each model the first stage cannot read out for is refused by name, before any process
    group (RunConfig.validate)."""
    from megaloop.training.run_config import parse_args

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--train-iters", "1", "--mock-data", "--num-loops", "3",
            "--pipeline-model-parallel-size", "2", "--pipeline-first-stage-readouts", "1"]
    cfg = parse_args(argv + flags)
    with pytest.raises(ValueError, match=message):
        cfg.validate(world_size=2)
