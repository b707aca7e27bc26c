"""--async-save (megatron-core's asynchronous torch_dist save): ``latest`` names a save only once
it is finalised on every rank, a kill -9 during one leaves the previous checkpoint loadable and
the resumed run reproduces the uninterrupted one bitwise, and the manifest (hashed by the
writers, off the training path) verifies."""

import json
import multiprocessing as mp
import os
import signal

import torch

import distributed
from distributed import free_port, run_distributed
from reference import full_params
from test_checkpoint import RESUME, _records, _train

TRACKER = "latest_checkpointed_iteration.txt"


def _save_in_background(rank, world, flags, ckpt):
    from megaloop.parallel.initialize import initialize
    from megaloop.training import checkpointing
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer

    cfg = parse_args(flags + ["--save", ckpt, "--async-save"])
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    trainer = Trainer(cfg)
    trainer.train_step()
    trainer.iteration, trainer.consumed_samples = 1, trainer.gbs
    saved = full_params(trainer.model)
    trainer.save()
    # Scheduled, maybe even written, but not finalised: nothing names it or shows it.
    seen_before = (os.path.exists(os.path.join(ckpt, TRACKER)),
                   os.path.isdir(os.path.join(ckpt, "iter_0000001")),
                   os.path.isdir(os.path.join(ckpt, "iter_0000001.tmp")))
    torch.distributed.barrier()
    trainer.train_step()  # training goes on while the writers write
    trainer.finalize_saves(blocking=True)
    path = os.path.join(ckpt, "iter_0000001")
    problems = checkpointing._verify_manifest(path)
    manifest = json.load(open(os.path.join(path, checkpointing.MANIFEST)))["files"]
    return seen_before, checkpointing.read_tracker(ckpt), problems, sorted(manifest), saved


def _load_params(rank, world, flags, ckpt):
    from megaloop.parallel.initialize import initialize
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer

    cfg = parse_args(flags + ["--load", ckpt])
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed + 1)  # other initial weights: all from the file
    return full_params(Trainer(cfg).model)


def test_async_save_is_published_only_when_finalised_on_every_rank(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    flags = RESUME + ["--use-distributed-optimizer"]  # DP=2: each rank writes its shards
    results = run_distributed(_save_in_background, 2, flags, ckpt)
    for seen_before, latest, problems, files, _ in results:
        assert seen_before == (False, False, True)
        assert latest == 1 and problems is None
        assert not any(".megaloop_sha256" in f for f in files)  # the writers' notes folded in
        assert any(f.endswith(".distcp") for f in files) and ".metadata" in files
    loaded = run_distributed(_load_params, 1, flags, ckpt)[0]
    saved = results[0][4]
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)


def _killed_during_async_save(rank, world, flags):
    """Train with --async-save; SIGKILL right after the save of iteration 4 is scheduled (its
    writers may run on, orphaned: nothing finalises it)."""
    from megaloop.training import async_checkpointing

    schedule = async_checkpointing.AsyncSaver.schedule

    def schedule_then_die(self, request, iteration, *args):
        schedule(self, request, iteration, *args)
        if iteration == 4:
            os.kill(os.getpid(), signal.SIGKILL)

    async_checkpointing.AsyncSaver.schedule = schedule_then_die
    return _train(rank, world, flags)


def test_kill_during_async_save_resumes_bitwise_from_the_previous_checkpoint(tmp_path,
                                                                            uninterrupted):
    ckpt = str(tmp_path / "ckpt")
    flags = RESUME + ["--tensor-model-parallel-size", "2", "--save", ckpt, "--load", ckpt,
                      "--save-interval", "2", "--async-save",
                      # the second save of each process reuses the first one's plan
                      "--ckpt-assume-constant-structure",
                      "--log-jsonl", str(tmp_path / "b.jsonl")]
    # Two forked ranks meant to die without reporting (not run_distributed).
    ctx, port = mp.get_context("fork"), free_port()
    procs = [ctx.Process(target=distributed._child,
                         args=(r, 2, port, _killed_during_async_save, (flags,), ctx.Queue()))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [-signal.SIGKILL] * 2
    assert open(os.path.join(ckpt, TRACKER)).read() == "2"  # iteration 4 was never published
    assert not os.path.isdir(os.path.join(ckpt, "iter_0000004"))

    straight = uninterrupted(RESUME + ["--tensor-model-parallel-size", "2"], 2)
    reason, _, it = run_distributed(_train, 2, flags)[0]
    assert reason is None and it == 6
    train = [r for r in _records(tmp_path / "b.jsonl") if r["split"] == "train"]
    # 1-4 from the killed run, then 3-6 again from checkpoint 2, each loss bit for bit.
    assert [r["iteration"] for r in train] == [1, 2, 3, 4, 3, 4, 5, 6]
    ref = {r["iteration"]: r["loss"] for r in straight if r["split"] == "train"}
    assert all(r["loss"] == ref[r["iteration"]] for r in train)
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004", "iter_0000006",
                                        TRACKER]
    assert open(os.path.join(ckpt, TRACKER)).read() == "6"


def test_sigterm_exit_waits_for_the_pending_async_save(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run = RESUME + ["--save", ckpt, "--load", ckpt, "--exit-signal-handler", "--async-save"]
    (reason, _, it), = run_distributed(_train, 1, run, 4)
    assert it == 4 and "SIGTERM" in reason
    # The exit save was scheduled in the background and published before the process left.
    assert sorted(os.listdir(ckpt)) == ["iter_0000004", TRACKER]
    assert open(os.path.join(ckpt, TRACKER)).read() == "4"


def test_async_flags_refused_where_they_cannot_work(tmp_path):
    import pytest

    from megaloop.training.run_config import parse_args

    for flags, needle in ((["--async-save"], "--async-save needs --save DIR"),
                          (["--ckpt-fully-parallel-load"], "--ckpt-fully-parallel-load is not "
                                                           "supported")):
        cfg = parse_args(["--mock-data"] + flags)
        with pytest.raises(ValueError, match=needle):
            cfg.checkpoint.validate()
    # Megatron-LM's defaults and spellings
    ck = parse_args(["--mock-data"]).checkpoint
    assert (ck.async_save, ck.ckpt_fully_parallel_save, ck.ckpt_fully_parallel_load,
            ck.ckpt_assume_constant_structure) == (False, True, False, False)
    assert not parse_args(["--mock-data", "--no-ckpt-fully-parallel-save"]).checkpoint \
        .ckpt_fully_parallel_save
