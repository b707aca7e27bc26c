"""Pipeline parallelism: P stages == one stage for the same weights and global batch.

Every comparison runs the trainer twice from the same seed: once on one rank (the plain
recurrence in LoopedGPTModel.forward, no pipeline code involved) and once pipelined, and checks
the objective, per-step losses, exit probabilities, grad norm, the gradient of every parameter
(gathered over TP shards and pipeline stages), the parameters after one optimizer step and the
loss of the next step (tests/test_training.py::_compare).
"""

import pytest
import torch

from distributed import run_distributed
from test_training import _compare, _one_step, assert_after_second_step_close
from test_training import one_rank_step as _reference  # the single-rank run, cached

MB2 = ["--micro-batch-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]


def _comparable(result):
    """Stats with `last` mode's unread steps (NaN) and missing exit probs checked and removed,
    so _compare sees plain lists."""
    stats = dict(result[0])
    read = [v == v for v in stats["step_losses"]]
    stats["step_losses"] = [v for v, ok in zip(stats["step_losses"], read) if ok]
    stats["exit_probs"] = stats["exit_probs"] or []
    return (stats,) + tuple(result[1:]), read


def _check(extra_ref, extra_pp, world):
    ref, ref_read = _comparable(_reference(tuple(extra_ref)))
    for result in run_distributed(_one_step, world, list(extra_pp)):
        result, read = _comparable(result)
        assert read == ref_read and len(result[0]["exit_probs"]) == len(ref[0]["exit_probs"])
        _compare(ref, result)


@pytest.mark.parametrize("loops", ["2", "3", "4"])
def test_pp2_equals_pp1(loops):
    extra = MB2 + ["--num-loops", loops]
    _check(extra, extra + PP2, 2)


def test_pp2_dense_twin_uses_plain_1f1b():
    extra = MB2 + ["--num-loops", "1"]
    _check(extra, extra + PP2, 2)


def test_dense_twin_pp2_dp2_overlapped_grad_reduce():
    # With one chunk per stage each parameter gets one gradient per micro-batch, so DDP's
    # overlapped bucket reduction applies (refused for T > 1 in validation).
    ref = _comparable(_reference(tuple(MB2 + ["--num-loops", "1"])))[0]
    for stats, gn, _grads, params, nxt in run_distributed(
            _one_step, 4, ["--micro-batch-size", "1", "--num-loops", "1", "--overlap-grad-reduce",
                           "--use-distributed-optimizer"] + PP2):
        _compare(ref, (stats, gn, None, params, nxt))


def test_pp2_with_prelude_coda_and_untied_head():
    extra = MB2 + ["--num-layers", "4", "--num-prelude-layers", "1", "--num-coda-layers", "1",
                   "--untie-embeddings-and-output-weights"]
    _check(extra, extra + PP2, 2)


@pytest.mark.parametrize("mode", [["--exit-loss", "smoothed"], ["--exit-loss", "last"],
                                  ["--step-norm-placement", "readout"]])
def test_pp2_exit_loss_variants(mode):
    _check(MB2 + mode, MB2 + mode + PP2, 2)


def test_pp2_uneven_split():
    extra = MB2 + ["--num-layers", "3", "--num-loops", "2"]
    _check(extra, extra + PP2 + ["--decoder-first-pipeline-num-layers", "1"], 2)


def test_pp2_balanced_split():
    """--pipeline-balance auto on 3 core layers (no even split): the cost model's uneven split
    trains as one stage does."""
    extra = MB2 + ["--num-layers", "3", "--num-loops", "2"]
    _check(extra, extra + PP2 + ["--pipeline-balance", "auto"], 2)


READOUTS = ["--pipeline-first-stage-readouts"]


@pytest.mark.parametrize("loops,readouts,extra", [
    ("4", "1,3", []), ("3", "1,2", ["--exit-loss", "smoothed", "--exit-loss-smoothing", "0.3"]),
    ("2", "1", ["--loop-readout", "chunked", "--input-injection", "channel-wise"])])
def test_pp2_first_stage_readouts(loops, readouts, extra):
    """The LM loss of the named steps computed on the first stage, one step later, from the carried
    state and loss weight: the objective, every per-step loss and exit probability, every
    gradient (the gate's through the carried weight, the tied embedding's from both stages)
    and the next step equal one stage's."""
    run = MB2 + ["--num-loops", loops] + extra
    _check(run, run + PP2 + READOUTS + [readouts], 2)


def test_pp2_first_stage_readouts_with_random_depth_and_truncation():
    """A drawn T keeps the flag's steps below T; a step run without gradient keeps its loss's
    gradient mode where it is read out."""
    from test_random_depth import RANDOM

    ref, _ = _comparable(_reference(tuple(RANDOM)))
    for result in run_distributed(_one_step, 2, RANDOM + PP2 + READOUTS + ["1,2"]):
        result, _ = _comparable(result)
        assert result[0]["depth"] == ref[0]["depth"]
        _compare(ref, result)


def test_pp4_equals_pp1():
    extra = ["--micro-batch-size", "1", "--num-layers", "4", "--num-loops", "2"]
    _check(extra, extra + ["--pipeline-model-parallel-size", "4"], 4)


@pytest.mark.parametrize("pp_only", [[], READOUTS + ["1"]])
def test_tp2_pp2_equals_tp1_pp1(pp_only):
    """(With a moved LM loss: the first stage's head is vocab-parallel over its TP pair.)"""
    _check(MB2, MB2 + PP2 + ["--tensor-model-parallel-size", "2"] + pp_only, 4)


def test_pp2_dp2_equals_pp1_dp1():
    _check(MB2, ["--micro-batch-size", "1"] + PP2, 4)


def test_pp2_dp2_distributed_optimizer_equals_one_rank():
    ref = _comparable(_reference(tuple(MB2)))[0]
    results = run_distributed(_one_step, 4, ["--micro-batch-size", "1",
                                             "--use-distributed-optimizer"] + PP2)
    for stats, gn, _grads, params, nxt in results:
        # The distributed optimizer keeps only its shard of gradients; compare the rest.
        _compare(ref, (stats, gn, None, params, nxt))


def test_pp2_bf16_forward_is_exact():
    """bf16 pipeline dtype: the activations travel in bf16 and the fp32 log-survival bit for bit,
    so the forward (per-step losses, exit probs; the objective up to summation order) equals
    one stage exactly. Gradients differ at bf16 resolution: one stage sums a shared weight's T
    contributions in bf16 inside autograd, the pipeline adds each chunk's into the fp32 main
    grad."""
    extra = MB2 + ["--bf16"]
    ref, _ = _comparable(_reference(tuple(extra)))
    for result in run_distributed(_one_step, 2, extra + PP2):
        result, _ = _comparable(result)
        assert abs(result[0]["loss"] - ref[0]["loss"]) < 1e-6  # shares summed in another order
        assert result[0]["step_losses"] == ref[0]["step_losses"]
        assert result[0]["exit_probs"] == ref[0]["exit_probs"]
        assert abs(result[1] - ref[1]) < 1e-3 * ref[1]


@pytest.mark.parametrize("recompute", [
    ["--recompute-granularity", "full", "--recompute-method", "uniform",
     "--recompute-num-layers", "1"],
    ["--recompute-granularity", "full", "--recompute-method", "block",
     "--recompute-num-layers", "1"],
    ["--recompute-granularity", "selective"],
])
def test_recomputation_with_and_without_pipeline(recompute):
    # Recomputation must not change a thing: compare against the run that stores activations.
    extra = MB2 + ["--num-layers", "3", "--num-prelude-layers", "1"]
    _check(extra, extra + recompute, 1)
    _check(extra, extra + recompute + PP2, 2)


def test_pp2_carries_the_injection_source():
    extra = MB2 + ["--num-layers", "3", "--num-prelude-layers", "1", "--input-injection",
                   "scalar-mix", "--injection-source", "prelude", "--injection-init-weight", "0.7"]
    _check(extra, extra + PP2, 2)


def test_pp2_stepwise_lora_with_recompute():
    # Each stage's core layers carry their own adapters; a chunk selects its step's adapters,
    # also when recomputation reruns the core in the backward pass.
    extra = MB2 + ["--num-layers", "4", "--lora-rank", "2", "--recompute-granularity", "full",
                   "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    _check(MB2 + ["--num-layers", "4", "--lora-rank", "2"], extra + PP2, 2)


@pytest.mark.parametrize("spiral", [
    # Anchor; the coarse steps' latents cross the stage boundary padded to L.
    ["--loop-resolutions", "1/4,1/2,1", "--loop-topology", "anchor"],
    # MeSH (slots, entering state and routers split over stages), learned operators, injection.
    ["--loop-resolutions", "coarse-to-fine", "--loop-topology", "mesh", "--input-injection",
     "scalar-mix", "--injection-init-weight", "0.7"],
    # Fine-to-coarse with mean / broadcast, prelude and coda, a 2 + 1 split of the core.
    ["--loop-resolutions", "1,1/2,1/4", "--loop-topology", "mesh", "--mesh-slots", "3",
     "--resolution-down", "mean", "--resolution-up", "broadcast", "--num-layers", "5",
     "--num-prelude-layers", "1", "--num-coda-layers", "1",
     "--decoder-first-pipeline-num-layers", "2"],
])
def test_pp2_spiralformer_equals_pp1(spiral):
    extra = MB2 + spiral
    ref = extra[:]
    if "--decoder-first-pipeline-num-layers" in ref:  # a pipeline-only flag
        i = ref.index("--decoder-first-pipeline-num-layers")
        del ref[i:i + 2]
    _check(ref, extra + PP2, 2)
    # The comparison covered the spiral's own parameters, each with a nonzero gradient.
    grads = _reference(tuple(ref))[2]
    names = [k for k in grads if k.startswith("spiral.")]
    if "mesh" in spiral:
        assert {"spiral.mesh.write.0.weight", "spiral.mesh.read.3.weight",
                "spiral.mesh.final_read.weight"} <= set(names)
    if "--resolution-down" not in spiral:
        assert {"spiral.steps.0.scorer.weight", "spiral.steps.0.allocator.weight"} <= set(names)
    # (weights only: a scorer's bias shifts a softmax and has no gradient.)
    assert all(grads[k].abs().max() > 0 for k in names if k.endswith("weight"))


@pytest.mark.parametrize("variant", [
    # The window (h_1, h_2) travels round the ring; loop gating reads the state entering the
    # step on the last stage; initial-state injection reads the source on the first.
    ["--num-loops", "4", "--history-injection", "channel-wise", "--history-window", "2",
     "--timestep-conditioning", "loop-gating", "--input-injection", "channel-wise"],
    ["--num-loops", "3", "--history-injection", "dense", "--history-window", "1",
     "--num-layers", "3", "--num-prelude-layers", "1"],
])
def test_pp2_history_injection_and_loop_gating(variant):
    _check(MB2 + variant, MB2 + variant + PP2, 2)
    grads = _reference(tuple(MB2 + variant))[2]
    names = [k for k in grads if k.startswith(("history_injection.", "timestep."))]
    assert names and all(grads[k].abs().max() > 0 for k in names)


def test_pp2_random_depth_and_truncated_backprop():
    """The drawn T selects the first T chunks (the same T on every rank); the first step runs
    without gradient on every stage."""
    from test_random_depth import RANDOM

    ref, _ = _comparable(_reference(tuple(RANDOM)))
    assert ref[0]["depth"] > 1
    for result in run_distributed(_one_step, 2, RANDOM + PP2):
        result, _ = _comparable(result)
        assert result[0]["depth"] == ref[0]["depth"]
        _compare(ref, result)


def _train_then_eval(rank, world, extra):
    from megaloop.parallel.initialize import initialize
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer
    from test_training import BASE

    cfg = parse_args(BASE + extra + ["--eval-iters", "1"])
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    trainer = Trainer(cfg)
    trainer.train_step()
    return trainer.evaluate(), trainer.evaluate()


@pytest.mark.parametrize("pp_only", [[], ["--pipeline-first-stage-readouts", "1,2"]])
def test_pp2_evaluation_equals_pp1(pp_only):
    ref = run_distributed(_train_then_eval, 1, MB2)[0]
    for result in run_distributed(_train_then_eval, 2, MB2 + PP2 + pp_only):
        for a, b in zip(ref, result, strict=True):
            assert abs(a["loss"] - b["loss"]) < 2e-5
            for key in ("step_losses", "exit_probs"):
                for x, y in zip(a[key], b[key], strict=True):
                    assert abs(x - y) < 2e-5, key


# --- the carry's p2p layout (no processes needed) -------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_carry_crosses_stages_exactly(dtype):
    """Every declared slot of the carry crosses a stage boundary unchanged, in any pipeline
    dtype: the hidden blocks as ordinary tensors, the fp32 side values (log-survival, previous
    loss) bit for bit; their gradients take the same way back. A list slot's unfilled entries
    travel as zeros, a block shorter than the sequence (coarse latents) zero-padded at the end."""
    from megaloop.model.carry import SIDE, Carry, CarryLayout, Slot

    s, b, h = 8, 2, 16
    slots = (Slot("source"), Slot("history", count=2), Slot("entering"),
             Slot("memory", count=2), Slot("log_survival", SIDE), Slot("previous_loss", SIDE))
    layout = CarryLayout(slots, seq_local=s, seq_full=s, hidden_size=h, dtype=dtype)

    def block(rows=s):
        return torch.randn(rows, b, h, dtype=dtype, requires_grad=True)

    state, source, past, entering = block(5), block(), block(), block()
    memory = [block(), block()]
    # Values whose bit halves are NaN / denormal patterns when read as bf16.
    survival = torch.tensor([[-1e-30, -3.0e38, -7.1e-39, -0.0] * 2,
                             [-12.5, -1.17549435e-38, -2.0 ** -20, -5.0] * 2],
                            requires_grad=True)
    previous = torch.tensor([[3.4e38, 1e-40, 2.5, 0.0] * 2, [1.0, -2.0, 6e-39, 9.0] * 2],
                            requires_grad=True)
    carry = Carry(state, slots, source=source, history=[past], entering=entering, memory=memory,
                  log_survival=survival, previous_loss=previous)
    payload = layout.pack(carry)
    assert payload.shape == (layout.seq_length, b, h) and payload.dtype == dtype
    assert layout.seq_length == 7 * s + layout.side_rows
    received = payload.detach().requires_grad_()  # what the next stage's buffer holds
    got = layout.unpack(received)
    for x, y in ((got.log_survival, survival), (got.previous_loss, previous)):
        assert torch.equal(x.view(torch.int32), y.detach().view(torch.int32))
    assert torch.equal(got.h[5:], torch.zeros(3, b, h, dtype=dtype))
    assert len(got.history) == 2 and torch.equal(got.history[1], torch.zeros(s, b, h, dtype=dtype))
    pairs = [(got.h[:5], state), (got.source, source), (got.entering, entering),
             (got.history[0], past)]
    pairs += list(zip(got.memory, memory, strict=True))
    for x, y in pairs:
        assert torch.equal(x, y)

    grads = [torch.randn_like(y) for _, y in pairs]
    g_side = [torch.tensor([[3.0e38, -1e-30, 1.0, 2.0] * 2, [7e-39, 0.5, -0.25, 1e-3] * 2]),
              torch.tensor([[1.0, 2.0, -1e-39, 4.0] * 2, [0.0, -0.5, 8.0, 1e30] * 2])]
    torch.autograd.backward([x for x, _ in pairs] + [got.log_survival, got.previous_loss],
                            grads + g_side)
    payload.backward(received.grad)  # the gradient travels back to the sending stage
    assert torch.equal(survival.grad.view(torch.int32), g_side[0].view(torch.int32))
    assert torch.equal(previous.grad.view(torch.int32), g_side[1].view(torch.int32))
    for (_, y), g in zip(pairs, grads, strict=True):
        assert torch.equal(y.grad, g)


def test_carry_refuses_undeclared_slots():
    """A slot nobody declared can be neither written nor read (a variant that forgot its
    declaration would otherwise lose its state between pipeline stages); index_rows keeps every
    slot, on the batch dimension of its kind."""
    from megaloop.model.carry import SIDE, Carry, Slot, merge_slots

    slots = (Slot("window", count=3), Slot("acc", SIDE))
    carry = Carry(torch.arange(24.).view(2, 3, 4), slots)
    assert carry.window == [] and carry.acc is None
    with pytest.raises(AttributeError, match="no slot 'anchor'"):
        carry.anchor = carry.h
    with pytest.raises(AttributeError, match="no slot 'anchor'"):
        carry.anchor
    carry.window = [carry.h, 2 * carry.h]
    carry.acc = torch.arange(6.).view(3, 2)
    rows = torch.tensor([2, 0])
    picked = carry.index_rows(rows)
    assert torch.equal(picked.h, carry.h[:, [2, 0]])
    assert torch.equal(picked.window[1], 2 * carry.h[:, [2, 0]])
    assert torch.equal(picked.acc, carry.acc[[2, 0]])
    assert merge_slots([Slot("e"), Slot("e")]) == (Slot("e"),)
    with pytest.raises(ValueError, match="declared twice differently"):
        merge_slots([Slot("e"), Slot("e", count=2)])


# --- checkpoints across pipeline sizes -----------------------------------------------------
def _checkpoint_roundtrip(rank, world, extra, save_dir, save):
    """save: one step, save, then one more step; load: load, then that next step."""
    from megaloop.parallel.initialize import initialize
    from megaloop.training.checkpointing import load_checkpoint, save_checkpoint
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer
    from reference import full_grads, full_params
    from test_training import BASE

    cfg = parse_args(BASE + extra)
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    trainer = Trainer(cfg)
    if save:
        trainer.train_step()
        save_checkpoint(save_dir, 1, trainer.model, trainer.optimizer, trainer.scheduler,
                        run_config=cfg.to_dict(), consumed_samples=trainer.gbs)
    else:
        assert load_checkpoint(save_dir, trainer.model, trainer.optimizer, trainer.scheduler)
    params = full_params(trainer.model)
    if not save:  # the next step reads the next batch: skip the one the saving run consumed
        for _ in range(trainer.num_microbatches):
            next(trainer.train_iter)
    stats, grad_norm, _ = trainer.train_step()
    return params, stats, float(grad_norm), full_params(trainer.model), full_grads(trainer.model)


@pytest.mark.parametrize("variant,pp_only", [
    ([], []),
    # SpiralFormer + MeSH: operators and routers live on different stages at P=2.
    (["--loop-resolutions", "coarse-to-fine", "--loop-topology", "mesh"], []),
    # The first stage's weightless head adds nothing to the checkpoint.
    ([], ["--pipeline-first-stage-readouts", "1,2"]),
])
def test_pp2_checkpoint_loads_at_pp1(tmp_path, variant, pp_only):
    saved = run_distributed(_checkpoint_roundtrip, 2, MB2 + PP2 + variant + pp_only,
                            str(tmp_path), True)
    loaded = run_distributed(_checkpoint_roundtrip, 1, MB2 + variant, str(tmp_path), False)[0]
    params_pp, stats_pp, gn_pp, after_pp, _ = saved[0]
    params_1, stats_1, gn_1, after_1, grads_1 = loaded
    # One key per parameter, core layers by global number: the single-stage model gets them all.
    assert params_pp.keys() == params_1.keys()
    for k in params_pp:
        assert torch.equal(params_pp[k], params_1[k]), k
    # Optimizer state and LR schedule came along: the next step is the same step.
    assert abs(stats_pp["loss"] - stats_1["loss"]) < 2e-5
    assert abs(gn_pp - gn_1) < 1e-4 * max(1.0, gn_1)
    assert_after_second_step_close(after_pp, after_1, grads_1)


def test_tp2_pp2_and_pp2_dp2_spiralformer_mesh_equal_one_rank():
    spiral = ["--loop-resolutions", "coarse-to-fine", "--loop-topology", "mesh"]
    _check(MB2 + spiral, MB2 + spiral + PP2 + ["--tensor-model-parallel-size", "2"], 4)
    _check(MB2 + spiral, ["--micro-batch-size", "1"] + spiral + PP2, 4)
