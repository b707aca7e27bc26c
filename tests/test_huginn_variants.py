"""Huginn's pieces as megaloop flags, from scratch: each refuses what it cannot mean, naming the
flag; and --qk-bias trains the q and k rows of the fused QKV bias while its value rows stay
exactly zero (Huginn's attention has no value bias), through megaloop's trainer at TP=2 with the
distributed optimizer, together with the other Huginn flags and its sampled recurrence."""

import pytest

from distributed import run_distributed
from test_training import BASE

HUGINN = ["--num-layers", "4", "--num-prelude-layers", "1", "--num-coda-layers", "1",
          "--norm-scheme", "sandwich", "--normalization", "RMSNorm", "--swiglu",
          "--disable-bias-linear", "--position-embedding-type", "rope", "--rotary-interleaved",
          "--qk-bias", "--embedding-scale", "5.65685", "--input-injection", "concat-linear",
          "--injection-source", "prelude", "--state-init", "noise", "--share-final-norm",
          "--step-norm-placement", "readout", "--exit-loss", "last",
          "--random-depth-mean", "3", "--backprop-last-steps", "2"]


@pytest.mark.parametrize("flags,needle", [
    (["--qk-bias", "--add-qkv-bias"], "--qk-bias is a q/k bias"),
    (["--rotary-interleaved", "--position-embedding-type", "learned_absolute"],
     "--rotary-interleaved is a RoPE layout"),
    (["--embedding-scale", "0"], "--embedding-scale 0.0 must be positive"),
    (["--state-init", "noise"], "--state-init noise starts the loop from random numbers"),
    (["--state-init-scale", "0.5"], "--state-init-scale scales the initial noise"),
    (["--share-final-norm"], "--share-final-norm makes the step norm the coda's final norm"),
    (["--backprop-last-steps", "2", "--truncated-backprop-steps", "1"],
     "--backprop-last-steps counts the steps that train from the end"),
    (["--backprop-last-steps", "-1"], "--backprop-last-steps -1 must be >= 0"),
])
def test_refusals_name_the_flag(flags, needle):
    from megaloop.training.run_config import parse_args

    cfg = parse_args(BASE + flags)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        cfg.validate(world_size=1)


def _train(rank, world, extra):
    from run_helpers import build_trainer

    trainer = build_trainer(BASE + HUGINN + extra)
    model = trainer.model.module
    bias = model.core.layers[0].self_attention.linear_qkv.bias
    before = bias.detach().clone()
    depths = []
    for _ in range(2):
        stats, _, ok = trainer.train_step()
        assert ok
        depths.append(trainer.depth(trainer.iteration))
    return before, bias.detach().clone(), depths


def test_qk_bias_trains_q_and_k_and_holds_v_at_zero():
    """Per rank the fused bias is [group: its q head (8 rows), its k head (8), its v head (8)]
    (4 heads, one per group, head size 8; two groups per rank at TP=2): after two Adam steps of
    the distributed optimizer the q and k rows moved and the v rows are still exactly 0."""
    extra = ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
             "--micro-batch-size", "2"]
    for before, after, depths in run_distributed(_train, 2, extra, timeout=240):
        rows = after.view(-1, 3, 8)  # [groups on this rank, (q, k, v), head size]
        assert not before.view(-1, 3, 8)[:, 2].any() and not rows[:, 2].any()
        assert (rows[:, :2] != before.view(-1, 3, 8)[:, :2]).all(dim=-1).any()
        assert all(d >= 1 for d in depths)


def test_cuda_graphs_refuse_a_state_drawn_per_forward():
    """A replayed decode graph would repeat one draw of Huginn's initial state: refused by flag
    (the other refusals: tests/test_cuda_graphs.py)."""
    from megaloop.inference.cuda_graphs import check_cuda_graphs

    check_cuda_graphs(True, None, "", "full", 1, True)  # the rest graphs
    with pytest.raises(ValueError, match="--cuda-graphs with a model whose loop starts from "
                                         "noise drawn afresh per forward"):
        check_cuda_graphs(True, None, "", "full", 1, True, random_state=True)
