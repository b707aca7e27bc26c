"""Pipeline balance (megaloop/parallel/balance.py) against a hand computation of its cost model.

The schedule replay (``simulate``) is checked first: with equal chunks it must give the closed
form of (interleaved) 1F1B, (V M + P - 1) slots of forward + backward, for several P, V, M; and
one small unequal case is traced by hand in its test. Then, for three layouts (the pipeline
benchmark's shape, where the readout is a fraction of a layer; a large vocabulary with a coda,
whose losses cannot move; the same without coda), the FLOPs per token of every stage's chunks
are written out here from the shapes, every split Megatron-LM's uneven rule allows and every set
of steps whose LM loss the first stage could take is replayed, and the fastest (fewest steps
moved, then the even split, on a tie) must be what ``balance`` picks, with its bubble. A P = 4
layout in `last` mode checks the split alone. Then the flags are refused where they would be
ignored or cannot run.
"""

import itertools

import pytest

from megaloop.model.config import LoopConfig, ModelConfig


def _layer_flops(h, seq, ffn, swiglu):
    """Forward FLOPs per token of one layer (multi-head attention, no GQA), by hand."""
    qkv = 2 * h * 3 * h
    proj = 2 * h * h
    attention = 2 * 2 * seq * h          # QK^T and the weighted sum, full square
    mlp = 2 * (3 if swiglu else 2) * h * ffn
    return qkv + proj + attention + mlp


def _hand_chunks(h, seq, ffn, vocab, T, prelude, coda, exit_loss, split, first=()):
    """[stage][chunk] forward FLOPs per token: core layers everywhere; the prelude in the first
    stage's chunk 1; step t's readout (coda, head, gate) in the last stage's chunk t, or only
    its gate there and its head in the first stage's chunk t + 1 when t is in ``first``."""
    layer = _layer_flops(h, seq, ffn, True)
    gate = 2 * h if T > 1 and exit_loss != "last" else 0
    head = 2 * h * vocab
    chunks = [[n * layer for _ in range(T)] for n in split]
    chunks[0][0] += prelude * layer
    for t in range(1, T + 1):
        if t in first:
            chunks[0][t] += head
            chunks[-1][t - 1] += gate
        elif exit_loss != "last" or t == T:
            chunks[-1][t - 1] += coda * layer + head + gate
    return chunks


def test_replay_with_equal_chunks_is_the_closed_form():
    from megaloop.parallel.balance import simulate

    for P, V, M in [(2, 4, 8), (4, 4, 8), (2, 1, 8), (4, 1, 5), (4, 3, 4), (3, 2, 6)]:
        assert simulate([[1.0] * V for _ in range(P)], M) == (V * M + P - 1) * 3


def test_replay_of_a_small_unequal_schedule_traced_by_hand():
    """P = 2, V = 2, M = 2, forward costs stage 0 [1, 1], stage 1 [1, 3] (backward twice).
    Stage 0 runs all 4 forwards in its warm-up: (m0,c0) 0-1, (m1,c0) 1-2, then (m0,c1) once
    stage 1 has run (m0,c0) (1-2): 2-3, (m1,c1) 3-4. Stage 1 warms up with (m0,c0) 1-2, (m1,c0)
    2-3, then steps F(m0,c1) 3-6, B(m0,c1) 6-12, F(m1,c1) 12-15, B(m1,c1) 15-21 and cools down
    with B(m0,c0) 21-23 (stage 0's B(m0,c1) ran 12-14), B(m1,c0) 23-25 (after stage 0's
    B(m1,c1) 21-23). Stage 0 then runs B(m0,c0) 23-25 and B(m1,c0) 25-27: 27 in all; busy 12
    and 24, so the bubble is 1 - 18 / 27."""
    from megaloop.parallel.balance import predicted_bubble, simulate

    assert simulate([[1, 1], [1, 3]], 2) == 27
    assert predicted_bubble([[1, 1], [1, 3]], 2) == pytest.approx(1 - 18 / 27)


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
    from megaloop.parallel.balance import balance, predicted_bubble, simulate, valid_splits

    h, seq, vocab, T, prelude, coda, K, P, M, exit_loss, splits = LAYOUTS[name]
    model = ModelConfig(num_layers=prelude + K + coda, hidden_size=h, num_attention_heads=4,
                        max_position_embeddings=seq, swiglu=True)
    loop = LoopConfig(num_loops=T, num_prelude_layers=prelude, num_coda_layers=coda,
                      exit_loss=exit_loss)
    assert sorted(valid_splits(K, P)) == sorted(splits)
    # The first stage can take LM losses only with a tied head, no coda and an objective that
    # reads every step: then any set of steps before the last, else none.
    steps = range(1, T)
    sets = [c for n in range(T) for c in itertools.combinations(steps, n)] \
        if coda == 0 and exit_loss == "expected" else [()]
    hand = {(s, f): _hand_chunks(h, seq, 4 * h, vocab, T, prelude, coda, exit_loss, s, f)
            for s in splits for f in sets}
    times = {c: simulate(chunks, M) for c, chunks in hand.items()}
    fastest = min(times.values())
    even = (K // P,) * P
    best = min((c for c in hand if times[c] <= fastest * (1 + 1e-9)),
               key=lambda c: (len(c[1]), c[0] != even, max(c[0]) - min(c[0])))
    got = balance(model, loop, vocab, seq, P, M)
    assert (got.layers, got.first_readouts) == best
    assert got.chunk_cost == pytest.approx([sum(c) / T for c in hand[best]], rel=1e-12)
    assert got.bubble == pytest.approx(predicted_bubble(hand[best], M), rel=1e-12)
    assert got.theory == pytest.approx((P - 1) / (T * M + P - 1))
    for s in splits:  # the view of any split the flags give, without readouts moved
        assert balance(model, loop, vocab, seq, P, M, layers=s, first_readouts=()).bubble == \
            pytest.approx(predicted_bubble(hand[s, ()], M), rel=1e-12)
    return got


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_choice_is_the_hand_computed_fastest(name):
    _check(name)


def test_the_layouts_choose_differently():
    """The benchmark's shape keeps the even split and moves the LM losses of steps 1 and 3 (not
    1 and 2, which pair heavy chunks with light ones); the large vocabulary with a coda (whose
    losses cannot move) moves a layer off the last stage; without a coda it moves losses: the
    answer depends on the readout, as it must."""
    chosen = {name: (_check(name).layers, _check(name).first_readouts) for name in LAYOUTS}
    assert chosen["benchmark 0 + 4 x 4 + 0, vocab 1024"] == ((2, 2), (1, 3))
    assert chosen["large vocab 1 + 4 x 4 + 1, vocab 8192"] == ((3, 1), ())
    assert chosen["large vocab 0 + 4 x 4 + 0, vocab 16384"][1] != ()


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
        ParallelConfig(pipeline_first_stage_readouts="1").validate_pipeline(4)
    for bad in ("0", "1,x", "-1"):
        with pytest.raises(ValueError, match="give loop steps >= 1, comma-separated"):
            ParallelConfig(pipeline_model_parallel_size=2,
                           pipeline_first_stage_readouts=bad).validate_pipeline(4)


@pytest.mark.parametrize("flags,message", [
    (["--untie-embeddings-and-output-weights"], "tied to the embedding"),
    (["--num-layers", "3", "--num-coda-layers", "1"], "without coda layers"),
    (["--exit-loss", "last"], "--exit-loss expected or smoothed"),
    (["--step-norm-placement", "readout"], "--step-norm-placement recurrent"),
    (["--loop-resolutions", "1/2,1,1"], "SpiralFormer"),
    (["--num-loops", "3", "--pipeline-first-stage-readouts", "1,3"],
     "step 3 is not before the last"),
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


def test_plan_writes_the_choice_into_the_flags_and_keeps_given_steps():
    """Under auto, ``plan`` (what the trainer runs before building the stages) writes the chosen
    split and steps into the run's flags; steps given on the command line (here none, "") are
    kept and only the split is chosen; under even the flags' own layout is viewed."""
    from megaloop.parallel.balance import balance, plan
    from megaloop.training.run_config import parse_args

    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
            "--global-batch-size", "8", "--train-iters", "1", "--mock-data", "--num-loops", "4",
            "--swiglu", "--pipeline-model-parallel-size", "2", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "16384"]
    vocab = 16384
    auto = parse_args(argv + ["--pipeline-balance", "auto"])
    auto.validate(world_size=2)
    chosen = plan(auto, vocab, 8)
    best = balance(auto.model, auto.loop, vocab, 128, 2, 8)
    assert (chosen.layers, chosen.first_readouts) == (best.layers, best.first_readouts)
    assert chosen.first_readouts and auto.parallel.first_stage_readout_steps() == \
        chosen.first_readouts
    split_only = parse_args(argv + ["--pipeline-balance", "auto",
                                    "--pipeline-first-stage-readouts", ""])
    split_only.validate(world_size=2)
    assert plan(split_only, vocab, 8).first_readouts == ()
    assert split_only.parallel.first_stage_readout_steps() == ()
    assert split_only.parallel.decoder_first_pipeline_num_layers == 3  # layers alone: 3/1
    given = parse_args(argv + ["--pipeline-first-stage-readouts", "2"])
    given.validate(world_size=2)
    view = plan(given, vocab, 8)
    assert (view.layers, view.first_readouts) == ((2, 2), (2,))


def test_the_cost_model_reads_the_flop_model_from_below():
    """balance.py (megaloop/parallel) counts with megaloop/model/flops.py, the formulas the
    throughput line counts with too (metrics.py re-exports the same functions): no import of
    megaloop.training, a higher layer, at the top or inside a function."""
    import os

    from test_layering import ROOT, imported_modules

    from megaloop.model import flops
    from megaloop.training import metrics

    found = imported_modules(os.path.join(ROOT, "megaloop/parallel/balance.py"))
    assert not [m for _, m in found if m.split(".")[:2] == ["megaloop", "training"]], found
    assert ("megaloop.model.flops" in [m for _, m in found])
    for name in ("flops_per_iteration", "layer_flops_per_token", "core_flops_per_token",
                 "core_step_flops_per_token", "readouts_per_forward"):
        assert getattr(metrics, name) is getattr(flops, name), name
