"""Checkpoints: exact resume (bitwise on CPU fp32), SIGTERM, crash safety, resharding, keys.

The reference is always the uninterrupted run (or the other parallel layout) with the same seed
and data: a resumed run must reproduce its losses exactly, which needs weights, optimizer,
scheduler, RNG streams (dropout) and the data position all restored.
"""

import multiprocessing as mp
import os
import signal

import pytest
import torch

from distributed import free_port, run_distributed
from reference import full_grads, full_params
from run_helpers import build_trainer
from run_helpers import records as _records
from test_training import BASE, assert_after_second_step_close

# Dropout makes the RNG part of the state; validation every 2 iterations makes the validation
# stream's position part of it too.
RESUME = BASE + ["--train-iters", "6", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
                 "--eval-interval", "2", "--eval-iters", "1", "--micro-batch-size", "1",
                 "--lr-warmup-iters", "2"]


def _train(rank, world, flags, signal_at=None):
    """One pretrain_looplm process's trainer (run_helpers), trained; returns why it stopped,
    its JSONL records and its iteration."""
    trainer = build_trainer(flags)
    cfg = trainer.cfg
    if signal_at is not None and rank == world - 1:
        # SIGTERM reaches only the last rank, mid-run: the others must still stop with it.
        step = trainer.train_step

        def step_then_signal():
            out = step()
            if trainer.iteration + 1 == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
            return out

        trainer.train_step = step_then_signal
    reason = trainer.train()
    records = _records(cfg.logging.log_jsonl) if rank == 0 and cfg.logging.log_jsonl else None
    return reason, records, trainer.iteration


def _losses(records):
    return [(r["split"], r["iteration"], r["loss"], tuple(r["step_losses"])) for r in records]


@pytest.mark.parametrize("tp", [1, 2])
def test_stop_and_resume_reproduces_every_loss_bitwise(tmp_path, tp, uninterrupted):
    par = ["--tensor-model-parallel-size", str(tp)]
    straight = uninterrupted(RESUME + par, tp)
    ckpt = str(tmp_path / "ckpt")
    first = RESUME + par + ["--save", ckpt, "--load", ckpt, "--log-jsonl",
                            str(tmp_path / "b.jsonl")]
    reason, _, it = run_distributed(_train, tp, first + ["--exit-interval", "3"])[0]
    assert it == 3 and "exit-interval" in reason
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "3"
    run_distributed(_train, tp, first)
    resumed = _records(tmp_path / "b.jsonl")
    assert [r["iteration"] for r in resumed if r["split"] == "train"] == list(range(1, 7))
    assert _losses(resumed) == _losses(straight)  # exact equality, not a tolerance
    assert [r["consumed_samples"] for r in resumed if r["split"] == "train"] == \
        [r["consumed_samples"] for r in straight if r["split"] == "train"]

    if tp == 1:
        # The same resume without the RNG streams diverges (dropout masks differ): the exact
        # equality above really depends on the restored RNG.
        run_distributed(_train, 1, RESUME + par + ["--load", ckpt, "--ckpt-step", "3",
                                                   "--no-load-rng", "--log-jsonl",
                                                   str(tmp_path / "c.jsonl")])
        no_rng = [r for r in _records(tmp_path / "c.jsonl") if r["split"] == "train"]
        ref = {r["iteration"]: r["loss"] for r in straight if r["split"] == "train"}
        assert any(r["loss"] != ref[r["iteration"]] for r in no_rng)


def test_sigterm_on_one_rank_saves_exits_and_resumes_exactly(tmp_path, uninterrupted):
    flags = RESUME + ["--tensor-model-parallel-size", "2"]
    straight = uninterrupted(flags, 2)
    ckpt = str(tmp_path / "ckpt")
    run = flags + ["--save", ckpt, "--load", ckpt, "--exit-signal-handler",
                   "--log-jsonl", str(tmp_path / "b.jsonl")]
    results = run_distributed(_train, 2, run, 4)
    assert all(it == 4 and "SIGTERM" in reason for reason, _, it in results)
    assert sorted(os.listdir(ckpt)) == ["iter_0000004", "latest_checkpointed_iteration.txt"]
    run_distributed(_train, 2, run)
    assert _losses(_records(tmp_path / "b.jsonl")) == _losses(straight)


def _killed_save(rank, world, flags, kill_point):
    """Train with a save every iteration and die by SIGKILL inside the save of iteration 2."""
    from megaloop.training import checkpointing

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if kill_point == "after-write":  # all shards written, not yet renamed
        save = checkpointing.dist_checkpointing.save

        def save_then_die(state, path, **kw):
            save(state, path, **kw)
            if state["iteration"] == 2:
                die()
        checkpointing.dist_checkpointing.save = save_then_die
    else:  # renamed, but the latest file not yet replaced
        replace = checkpointing.os.replace

        def replace_or_die(src, dst):
            if dst.endswith(checkpointing.TRACKER) and open(src).read() == "2":
                die()
            replace(src, dst)
        checkpointing.os.replace = replace_or_die
    return _train(rank, world, flags)


@pytest.mark.parametrize("kill_point", ["after-write", "before-latest"])
def test_run_killed_mid_save_resumes_from_previous_checkpoint(tmp_path, kill_point,
                                                              uninterrupted):
    ckpt = str(tmp_path / "ckpt")
    flags = RESUME + ["--train-iters", "3", "--save", ckpt, "--load", ckpt, "--save-interval", "1",
                      "--log-jsonl", str(tmp_path / "b.jsonl")]
    # A forked single rank (not run_distributed: this one is meant to die without reporting).
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    proc = mp.get_context("fork").Process(target=_killed_save, args=(0, 1, flags, kill_point))
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "1"

    straight = uninterrupted(RESUME + ["--train-iters", "3"], 1)
    reason, _, it = run_distributed(_train, 1, flags)[0]
    assert reason is None and it == 3
    train = [r for r in _records(tmp_path / "b.jsonl") if r["split"] == "train"]
    # Iterations 1 and 2 from the killed run, then 2 (again, from checkpoint 1) and 3.
    assert [r["iteration"] for r in train] == [1, 2, 2, 3]
    ref = {r["iteration"]: r["loss"] for r in straight if r["split"] == "train"}
    assert all(r["loss"] == ref[r["iteration"]] for r in train)
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "iter_0000002", "iter_0000003",
                                        "latest_checkpointed_iteration.txt"]


# --- resharding ---------------------------------------------------------------------------------
RESHARD = BASE + ["--global-batch-size", "4", "--micro-batch-size", "1", "--num-query-groups",
                  "2", "--untie-embeddings-and-output-weights"]


def _logits(trainer, batch):
    """Last-step logits over the whole vocabulary (the TP shards concatenated)."""
    from megatron.core import parallel_state

    from megaloop.device import to_device

    batch = to_device(batch)  # the model is on the accelerator where one exists
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(batch["tokens"], batch["position_ids"])
    trainer.model.train()
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(logits) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, -1)


def _save_or_load(rank, world, flags, ckpt, save):
    trainer = build_trainer(flags + (["--save", ckpt] if save else ["--load", ckpt]))
    if save:
        trainer.train_step()
        trainer.iteration, trainer.consumed_samples = 1, trainer.gbs
        trainer.save()
    assert trainer.iteration == 1
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 200, (2, 32), generator=g)
    batch = {"tokens": tokens, "position_ids": torch.arange(32).expand(2, 32)}
    logits = _logits(trainer, batch)
    stats, _, _ = trainer.train_step()  # the restored Adam moments decide this update
    # The gradients of that step: whole on every loading layout here (DP=1).
    return logits, stats["loss"], full_params(trainer.model), full_grads(trainer.model)


TP2 = ["--tensor-model-parallel-size", "2"]
DIST = ["--use-distributed-optimizer"]


@pytest.mark.parametrize("src,src_world,dst,dst_world", [
    (TP2, 2, [], 1),                  # TP=2 -> TP=1
    ([], 1, TP2, 2),                  # TP=1 -> TP=2
    (DIST, 2, TP2 + DIST, 2),         # DP=2 -> TP=2, distributed optimizer state resharded
    (DIST, 2, DIST, 1),               # DP=2 -> DP=1
])
def test_checkpoint_loads_at_another_layout(tmp_path, src, src_world, dst, dst_world):
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(_save_or_load, src_world, RESHARD + src, ckpt, True)[0]
    loaded = run_distributed(_save_or_load, dst_world, RESHARD + dst, ckpt, False)[0]
    assert torch.allclose(saved[0], loaded[0], atol=1e-6, rtol=0)  # logits
    assert abs(saved[1] - loaded[1]) < 1e-6  # the next step's loss
    # The weights after that step: the Adam moments and step came back.
    assert_after_second_step_close(saved[2], loaded[2], loaded[3])


def _load_other_optimizer(rank, world, flags, ckpt):
    try:
        _save_or_load(rank, world, flags, ckpt, False)
    except ValueError as exc:
        return str(exc)
    return None


def test_switching_optimizer_kind_is_a_clear_error(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_or_load, 1, RESHARD + DIST, ckpt, True)
    message = run_distributed(_load_other_optimizer, 1, RESHARD, ckpt)[0]
    assert "--use-distributed-optimizer" in message and "--no-load-optim" in message


def _keys(rank, world, flags):
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from megaloop.model.looped_gpt import build_model
    from megaloop.parallel.initialize import initialize
    from megaloop.training.run_config import parse_args

    cfg = parse_args(flags)
    initialize(cfg.parallel, cfg.training.seed)
    model = build_model(cfg.model, cfg.loop, 200)
    index = {id(p): name for name, p in model.named_parameters()}
    entries = []  # (key, offset or None, global shape or None, parameter name)
    for v in nested_values(model.sharded_state_dict()):
        if isinstance(v, ShardedTensor):
            entries.append((v.key, v.global_offset, v.global_shape, index.get(id(v.data))))
        elif isinstance(v, ShardedTensorFactory):  # SwiGLU's fc1, stored as its two halves
            entries.append((v.key, None, None, index.get(id(v.data))))
    return entries, list(index.values())


def test_every_parameter_has_exactly_one_checkpoint_entry():
    flags = BASE + ["--num-layers", "4", "--num-prelude-layers", "1", "--num-coda-layers", "1",
                    "--num-loops", "4"]
    entries, names = run_distributed(_keys, 1, flags)[0]
    # Each parameter is referenced by exactly one entry: the core once, not once per loop
    # step, and the tied LM head not at all (it is the embedding).
    assert sorted(name for *_, name in entries) == sorted(names)
    assert not any(key.startswith("output_layer") for key, *_ in entries)
    # megatron-core stacks a block's layers into one tensor per weight (leading dim = layers):
    # the core's is K = 4 - 1 - 1, whatever T.
    core = {shape[0] for key, _, shape, _ in entries if key.startswith("core.layers.") and shape}
    assert core == {2}
    placed = [(key, offset) for key, offset, _, _ in entries if offset is not None]
    assert len(placed) == len(set(placed))


def test_exit_duration_stops_saves_and_says_why(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # Any positive budget is already spent once the first step is done (the clock starts
    # before it), so the run must stop, save and report after iteration 1.
    reason, _, it = run_distributed(_train, 2, RESUME + TP2 + [
        "--save", ckpt, "--exit-duration-in-mins", "1e-9", "--log-jsonl",
        str(tmp_path / "b.jsonl")])[0]
    assert it == 1 and "--exit-duration-in-mins" in reason
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "1"


def _train_started_earlier(rank, world, flags, seconds):
    """A trainer whose process started ``seconds`` before it was built (its StartupTimer's
    origin), trained; returns why it stopped and its iteration."""
    from megaloop.training.startup import StartupTimer

    startup = StartupTimer(from_process_start=False)
    startup.start -= seconds
    trainer = build_trainer(flags, startup)
    return trainer.train(), trainer.iteration


def test_exit_duration_counts_from_the_process_start(tmp_path):
    """Megatron-LM's meaning, which the SLURM script's value (the job's end time less a margin)
    relies on: the start-up counts. A process started 2 minutes ago with a 1-minute budget stops
    after its first step, though training itself has taken well under a minute."""
    flags = RESUME + ["--save", str(tmp_path / "ckpt"), "--exit-duration-in-mins", "1"]
    reason, it = run_distributed(_train_started_earlier, 1, flags, 120.0)[0]
    assert it == 1 and "--exit-duration-in-mins 1.0 exceeded at iteration 1" in reason, reason
    reason, it = run_distributed(_train_started_earlier, 1, flags, 0.0)[0]
    assert reason is None and it > 1


@pytest.mark.parametrize("flags,needle", [
    (["--save-interval", "5"], "--save-interval needs --save"),
    (["--finetune"], "--finetune needs --load"),
    (["--ckpt-step", "3"], "--ckpt-step needs --load"),
    (["--save", "x", "--save-interval", "0"], "--save-interval 0 must be >= 1"),
    (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins 0.0 must be > 0"),
])
def test_checkpoint_flag_errors_name_the_flag(flags, needle):
    from megaloop.training.run_config import parse_args

    with pytest.raises(ValueError, match=needle):
        parse_args(BASE + flags).validate(world_size=1)


def test_finetune_from_a_folder_without_a_checkpoint_is_refused(tmp_path):
    """A mistyped --load with --finetune must not start from random weights."""
    from megaloop.training.run_config import parse_args

    with pytest.raises(ValueError, match="no checkpoint there"):
        parse_args(BASE + ["--load", str(tmp_path), "--finetune"]).validate(world_size=1)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    parse_args(BASE + ["--load", str(tmp_path), "--finetune"]).validate(world_size=1)


def test_unreadable_latest_file_is_a_clear_error(tmp_path):
    from megaloop.training.checkpointing import read_tracker

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release\n")
    with pytest.raises(ValueError, match="--ckpt-step"):
        read_tracker(str(tmp_path))


def _loaded_state(rank, world, flags):
    trainer = build_trainer(flags)
    g = torch.Generator().manual_seed(3)
    batch = {"tokens": torch.randint(0, 200, (2, 32), generator=g),
             "position_ids": torch.arange(32).expand(2, 32)}
    adam_steps = {float(s["step"]) for s in trainer.optimizer.chained_optimizers[0]
                  .optimizer.state.values() if "step" in s}
    return (trainer.iteration, trainer.consumed_samples, _logits(trainer, batch),
            trainer.scheduler.num_steps, adam_steps)


def test_finetune_takes_the_weights_and_starts_a_new_run(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_train, 1, RESUME + ["--train-iters", "2", "--lr-warmup-iters", "1",
                                         "--save", ckpt])
    # (the saved schedule differs from RESUME's: a resume must say whose to follow)
    resumed = run_distributed(_loaded_state, 1, RESUME + ["--load", ckpt,
                                                          "--use-checkpoint-opt_param-scheduler"])[0]
    finetune = run_distributed(_loaded_state, 1, RESUME + ["--load", ckpt, "--finetune"])[0]
    fresh = run_distributed(_loaded_state, 1, RESUME)[0]
    assert resumed[:2] == (2, 8) and resumed[3] == 2 and resumed[4] == {2.0}
    assert finetune[:2] == (0, 0) and finetune[3] == 0 and finetune[4] == set()
    assert torch.equal(finetune[2], resumed[2])  # the trained weights...
    assert not torch.allclose(finetune[2], fresh[2])  # ...not the initial ones


# --- resuming with a changed schedule -----------------------------------------------------
SCHED = BASE + ["--micro-batch-size", "2", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine",
                "--min-lr", "1e-3"]


def _lrs(rank, world, flags, steps):
    """The LR each of ``steps`` training steps applies (after a --load: from its iteration)."""
    try:
        trainer = build_trainer(flags)
    except ValueError as exc:  # a refusal, from the resume check or from the load
        return str(exc)
    out = []
    for _ in range(steps):
        trainer.train_step()
        out.append(trainer.lr)
    return out


def test_resume_with_a_longer_run_needs_a_schedule_choice(tmp_path):
    """megatron-core would silently keep the checkpoint's decay horizon (LR at its minimum for
    the whole extension); as in Megatron-LM, a changed schedule needs one of two flags."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_train, 1, SCHED + ["--train-iters", "2", "--save", ckpt])
    longer = SCHED + ["--train-iters", "4", "--load", ckpt]
    refused = run_distributed(_lrs, 1, longer, 1)[0]
    assert isinstance(refused, str) and "--override-opt_param-scheduler" in refused \
        and "--use-checkpoint-opt_param-scheduler" in refused
    straight = run_distributed(_lrs, 1, SCHED + ["--train-iters", "4"], 3)[0]
    override = run_distributed(_lrs, 1, longer + ["--override-opt_param-scheduler"], 1)[0]
    keep = run_distributed(_lrs, 1, longer + ["--use-checkpoint-opt_param-scheduler"], 1)[0]
    assert override == [straight[2]]  # the 4-iteration schedule at its third step
    assert keep == [1e-3] and straight[2] > 1e-3  # the 2-iteration schedule has ended: min LR
    same = run_distributed(_lrs, 1, SCHED + ["--train-iters", "2", "--load", ckpt], 1)[0]
    assert isinstance(same, list)  # an unchanged schedule resumes without a flag


def test_checkpoint_modules_import_no_circle():
    """The checkpoint modules' imports (lazy ones too) form no circle: training's
    checkpointing builds on its async saver, never the other way round."""
    from test_layering import ROOT as REPO, imported_modules, python_files

    files = python_files("megaloop/checkpoint") + [
        os.path.join(REPO, "megaloop", "training", f"{name}.py")
        for name in ("checkpointing", "async_checkpointing", "checkpoint_fit", "save_lock")]
    name = {f: os.path.relpath(f, REPO)[:-3].replace(os.sep, ".") for f in files}
    graph = {name[f]: {m for _, m in imported_modules(f)} & set(name.values()) - {name[f]}
             for f in files}

    def circle(node, path):
        for nxt in sorted(graph[node]):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            found = circle(nxt, path + [nxt])
            if found:
                return found
        return None

    circles = [c for start in sorted(graph) if (c := circle(start, [start]))]
    assert not circles, " -> ".join(circles[0])
