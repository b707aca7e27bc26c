"""Never lose or poison a checkpoint: architecture checks on --load, checksums, damaged files,
unwritable or full disks, stale partial saves, and how a stopped run tells its launcher.

Damage is made by hand on real checkpoints (bytes flipped, a shard cut short or deleted, a
tracker overwritten); every failure must be one message that names the file and the way out.
"""

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys

import pytest

from distributed import run_distributed
from test_checkpoint import _train
from test_reliability import _main
from test_training import BASE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(ROOT, "examples", "slurm", "pretrain_looplm.sbatch")
TINY = BASE + ["--micro-batch-size", "2"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(tmp_path, iters=1)``: checkpoints of iterations 1..iters of TINY's 2-iteration
    schedule (the loads below keep that schedule, so none needs a scheduler flag) in
    ``tmp_path/ckpt``, for the test to damage: trained once per ``iters`` in this module, then
    copied (the tests differ in what they do to the files, not in the run that wrote them)."""
    trained = {}

    def save(tmp_path, iters=1):
        if iters not in trained:
            trained[iters] = str(tmp_path_factory.mktemp(f"saved{iters}") / "ckpt")
            run_distributed(_train, 1, TINY + ["--save", trained[iters], "--save-interval", "1",
                                               "--exit-interval", str(iters)])
        ckpt = str(tmp_path / "ckpt")
        shutil.copytree(trained[iters], ckpt)
        return ckpt

    return save


def _start(rank, world, flags):
    """Build a Trainer (which loads --load); returns (error message or None, printed lines)."""
    from megaloop.parallel.initialize import initialize
    from megaloop.training import metrics
    from megaloop.training.checkpointing import CheckpointError
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer

    lines = []
    metrics.MetricsLogger.print = lambda self, text: lines.append(text)
    cfg = parse_args(flags)
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    try:
        trainer = Trainer(cfg)
    except CheckpointError as exc:
        return str(exc), lines
    trainer.save_lock.release()  # what the process's exit does (atexit, which forked ranks skip)
    return None, lines + [f"iteration {trainer.iteration}"]


def _largest_shard(path):
    shards = [os.path.join(path, n) for n in os.listdir(path) if n.endswith(".distcp")]
    return max(shards, key=os.path.getsize)


# --- architecture -------------------------------------------------------------------------------
def test_architecture_mismatch_is_refused_by_name_even_with_finetune(tmp_path, saved):
    from megaloop.training.checkpointing import CheckpointError, check_resume
    from megaloop.training.run_config import parse_args

    ckpt = saved(tmp_path)
    heads = TINY + ["--num-attention-heads", "2", "--load", ckpt]  # same shapes, other model
    with pytest.raises(CheckpointError, match=r"--num-attention-heads 4 in the checkpoint, 2 in "
                                              r"this run"):
        check_resume(ckpt, None, parse_args(heads).to_dict())  # before any process group
    for extra in ([], ["--finetune"]):
        error, _ = run_distributed(_start, 1, heads + extra)[0]
        assert error is not None and "--num-attention-heads 4" in error, extra
    # A changed loop count is allowed, and said.
    error, lines = run_distributed(_start, 1, TINY + ["--num-loops", "2", "--load", ckpt])[0]
    assert error is None and "iteration 1" in lines
    assert any("--num-loops 3, this run uses 2" in line for line in lines), lines
    # ... but not where parameters exist per loop step.
    with pytest.raises(CheckpointError, match="--num-loops 3 in the checkpoint"):
        check_resume(ckpt, None, parse_args(TINY + ["--num-loops", "2", "--lora-rank", "2"])
                     .to_dict())


# --- checksums and damaged files ------------------------------------------------------------------
def test_flipped_bytes_are_found_by_the_checksum_manifest(tmp_path, saved):
    ckpt = saved(tmp_path)
    shard = _largest_shard(os.path.join(ckpt, "iter_0000001"))
    with open(shard, "r+b") as f:  # same size, a few bytes inside the tensor data changed
        f.seek(os.path.getsize(shard) // 2)
        data = f.read(8)
        f.seek(os.path.getsize(shard) // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    error, _ = run_distributed(_start, 1, TINY + ["--load", ckpt])[0]
    assert error is not None and shard in error and "checksum" in error
    # The flag skips the verification (for checkpoints too large to read twice).
    error, lines = run_distributed(_start, 1, TINY + ["--load", ckpt,
                                                      "--ckpt-checksums", "false"])[0]
    assert error is None and "iteration 1" in lines


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_damaged_shard_names_folder_file_and_previous_checkpoint(tmp_path, damage, saved):
    ckpt = saved(tmp_path, iters=2)
    folder = os.path.join(ckpt, "iter_0000002")
    shard = _largest_shard(folder)
    if damage == "truncated":
        os.truncate(shard, os.path.getsize(shard) // 3)
    else:
        os.remove(shard)
    error, _ = run_distributed(_start, 1, TINY + ["--load", ckpt])[0]
    assert error is not None and folder in error and shard in error \
        and "--ckpt-step 1" in error, error
    # Without the manifest, megatron-core's failure is wrapped the same way.
    error, _ = run_distributed(_start, 1, TINY + ["--load", ckpt, "--ckpt-checksums", "false"])[0]
    assert error is not None and folder in error and "--ckpt-step 1" in error, error
    assert "\n" not in error
    # The fallback it names works.
    error, lines = run_distributed(_start, 1, TINY + ["--load", ckpt, "--ckpt-step", "1"])[0]
    assert error is None and "iteration 1" in lines


def test_tracker_with_invalid_bytes_names_the_file_and_the_fallback(tmp_path, saved):
    from megaloop.training.checkpointing import CheckpointError, check_resume
    from megaloop.training.run_config import parse_args

    ckpt = saved(tmp_path, iters=2)
    tracker = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
    with open(tracker, "wb") as f:
        f.write(b"\xff\xfe\x00garbage")
    with pytest.raises(CheckpointError) as info:
        check_resume(ckpt, None, parse_args(TINY).to_dict())
    assert tracker in str(info.value) and "--ckpt-step 2" in str(info.value)


# --- saving ---------------------------------------------------------------------------------------
def test_unwritable_save_folder_is_found_at_start_up(tmp_path):
    from megaloop.training.run_config import parse_args

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="--save .*is not a folder"):
        parse_args(TINY + ["--save", str(blocker / "ckpt")]).validate(world_size=1)
    if os.geteuid() != 0:  # root writes anywhere: the permission case only as a user
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
        with pytest.raises(ValueError, match="--save .*cannot write"):
            parse_args(TINY + ["--save", str(locked / "ckpt")]).validate(world_size=1)
    # A folder that does not exist yet but can be created is fine, and is not created by the check.
    parse_args(TINY + ["--save", str(tmp_path / "new" / "ckpt")]).validate(world_size=1)
    assert not (tmp_path / "new").exists()


def _disk_full_main(rank, world, flags, wrapped):
    """pretrain_looplm.main whose save of iteration 2 writes part of a shard, then hits ENOSPC
    (``wrapped``: inside torch DCP's CheckpointException, as its writer reports it); the file
    system then has 123456789 bytes free."""
    import collections
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from megaloop.training import checkpointing

    save = checkpointing.dist_checkpointing.save

    def save_until_full(state, path, **kw):
        if state["iteration"] == 2:
            with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
                f.write(b"\0" * 1000)
            full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if wrapped:
                raise CheckpointException("write failed", {0: (full, traceback.StackSummary())})
            raise full
        return save(state, path, **kw)

    usage = collections.namedtuple("usage", "total used free")
    checkpointing.dist_checkpointing.save = save_until_full
    checkpointing.shutil.disk_usage = lambda path: usage(10**10, 10**10 - 123456789, 123456789)
    return _main(rank, world, flags, set())


@pytest.mark.parametrize("wrapped", [False, True], ids=["oserror", "dcp-wrapped"])
def test_failed_save_leaves_nothing_partial_and_exits_nonzero(tmp_path, wrapped):
    ckpt, status = tmp_path / "ckpt", tmp_path / "status.json"
    flags = TINY + ["--train-iters", "3", "--save", str(ckpt), "--save-interval", "1",
                    "--exit-status-file", str(status)]
    assert run_distributed(_disk_full_main, 1, flags, wrapped)[0] == 1
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    reason = json.loads(status.read_text())["reason"]
    assert "saving iteration 2" in reason and "No space left on device" in reason \
        and "still names iteration 1" in reason
    # It says the disk is full, how full, and which one.
    assert f"the disk is full: 123,456,789 bytes free on the file system of {ckpt}" in reason, \
        reason


def test_shards_of_another_model_name_the_tensor_and_both_shapes(tmp_path):
    """A checkpoint folder whose shards (and .metadata) were copied from a model with another FFN
    size, without a manifest: its common.pt says this architecture, its tensors do not."""
    ckpt, other = str(tmp_path / "ckpt"), str(tmp_path / "other")
    run_distributed(_train, 1, TINY + ["--save", ckpt, "--train-iters", "1"])
    run_distributed(_train, 1, TINY + ["--save", other, "--train-iters", "1",
                                       "--ffn-hidden-size", "64"])
    mine, theirs = os.path.join(ckpt, "iter_0000001"), os.path.join(other, "iter_0000001")
    for name in os.listdir(mine):
        if name.endswith(".distcp") or name in (".metadata", "megaloop_manifest.json"):
            os.remove(os.path.join(mine, name))
    for name in os.listdir(theirs):
        if name.endswith(".distcp") or name == ".metadata":
            shutil.copy(os.path.join(theirs, name), mine)
    error, _ = run_distributed(_start, 1, TINY + ["--load", ckpt, "--train-iters", "1"])[0]
    # FFN 64 vs this model's default 4 x hidden = 128: linear_fc2 is [hidden, ffn] per layer.
    assert error is not None and "core.layers.mlp.linear_fc2.weight (2, 32, 64) in the " \
        "checkpoint, (2, 32, 128) in this model" in error, error
    assert "\n" not in error


def test_stale_partial_saves_are_removed_at_the_next_start(tmp_path, saved):
    ckpt = saved(tmp_path)
    stale = os.path.join(ckpt, "iter_0000007.tmp")  # a save killed (SIGKILL) half-way
    os.makedirs(stale)
    with open(os.path.join(stale, "__0_0.distcp"), "wb") as f:
        f.write(b"\0" * 100)
    error, lines = run_distributed(_start, 1, TINY + ["--save", ckpt, "--load", ckpt])[0]
    assert error is None and not os.path.exists(stale)
    assert any(stale in line and "removed" in line for line in lines), lines
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


# --- stopped by a signal: what the launcher is told -----------------------------------------------
def test_sigterm_run_reports_saved_and_stopped(tmp_path):
    ckpt, status = str(tmp_path / "ckpt"), tmp_path / "status.json"
    flags = TINY + ["--train-iters", "6", "--save", ckpt, "--exit-signal-handler",
                    "--exit-status-file", str(status)]
    reason, _, it = run_distributed(_train, 1, flags, 3)[0]
    assert it == 3 and "SIGTERM" in reason
    result = json.loads(status.read_text())
    assert result["status"] == "saved-and-stopped" and result["checkpoint_iteration"] == 3
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "3"


SRUN_STUB = """#!/bin/bash
# srun stand-in: writes the run's status as rank 0 would, then exits like torchrun.
while [[ $# -gt 0 ]]; do
    if [[ "$1" == "--exit-status-file" ]]; then file=$2; fi
    shift
done
if [[ -n "$STUB_STATUS" ]]; then
    echo "{\\"status\\": \\"$STUB_STATUS\\", \\"reason\\": \\"stub\\"}" > "$file"
fi
exit $STUB_RC
"""


@pytest.mark.parametrize("status,srun_rc,expected", [
    ("saved-and-stopped", 1, 0),  # torchrun signalled: exit 1, yet the run saved and stopped
    ("completed", 0, 0),
    ("failed", 1, 1),
    ("", 1, 1),                   # died before saying anything
])
def test_sbatch_exit_code_follows_the_run_status(tmp_path, status, srun_rc, expected):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("srun", SRUN_STUB), ("scontrol", "#!/bin/bash\necho 127.0.0.1\n"),
                       ("squeue", "#!/bin/bash\nexit 1\n")):  # no controller: no time limit
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", MOCK_DATA="true",
               SLURM_JOB_ID="7", SLURM_JOB_NODELIST="node0", SLURM_NNODES="1",
               OUTPUT_DIR=str(tmp_path / "out"), CHECKPOINT_DIR=str(tmp_path / "ckpt"),
               MEGALOOP_DIR=ROOT, STUB_STATUS=status, STUB_RC=str(srun_rc))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "exit_status.json").write_text('{"status": "completed"}\n')  # old job's
    proc = subprocess.run(["bash", SBATCH], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == expected, proc.stdout + proc.stderr


def _writer_full_main(rank, world, flags, partial):
    """pretrain_looplm.main whose checkpoint writer (megatron-core's, in the processes it forks)
    hits ENOSPC in a shard of iteration 2, having written part of it (``partial``) or before
    the file could be kept; the file system then has 123456789 bytes free."""
    import collections
    import functools

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    real = filesystem_async._write_item

    @functools.wraps(real)  # megatron-core inspects its signature
    def write_until_full(*args, **kwargs):
        stream = next(a for a in args if hasattr(a, "fileno") and hasattr(a, "name"))
        if "iter_0000002" in str(stream.name):
            if partial:
                stream.write(b"\0" * 1000)
            else:
                os.remove(stream.name)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    usage = collections.namedtuple("usage", "total used free")
    filesystem_async._write_item = write_until_full
    shutil.disk_usage = lambda path: usage(10**10, 10**10 - 123456789, 123456789)
    return _main(rank, world, flags, set())


@pytest.mark.parametrize("partial", [True, False], ids=["partial-shard", "no-shard"])
@pytest.mark.parametrize("mode", [[], ["--async-save"]], ids=["sync", "async"])
def test_disk_full_in_the_writer_is_one_message_and_no_partial_folder(tmp_path, mode, partial,
                                                                      capfd):
    """ENOSPC where it really happens, in megatron-core's writer (on both of two ranks): the
    synchronous and the asynchronous save both remove the partial folder, say the disk is full
    (not megatron-core's "Worker failure", nor the empty CheckpointException it raises on the
    rank that did not gather the failures) and stop the run with exit code 1, without a
    traceback."""
    ckpt, status = tmp_path / "ckpt", tmp_path / "status.json"
    flags = TINY + ["--train-iters", "3", "--save", str(ckpt), "--save-interval", "1",
                    "--exit-status-file", str(status)] + mode
    assert run_distributed(_writer_full_main, 2, flags, partial) == [1, 1]
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert open(ckpt / "latest_checkpointed_iteration.txt").read() == "1"
    result = json.loads(status.read_text())
    reason = result["reason"]
    assert result["status"] == "failed" and result["checkpoint_iteration"] == 1, result
    assert "saving iteration 2" in reason and "still names iteration 1" in reason and \
        f"the disk is full: 123,456,789 bytes free on the file system of {ckpt}" in reason, reason
    assert "CheckpointException" not in reason and "Worker failure" not in reason, reason
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("error:")] == \
        [f"error: {reason}"], err


def _rename_fails_main(rank, world, flags):
    """pretrain_looplm.main whose rename of iteration 2's complete folder into place fails."""
    from megaloop.checkpoint import save

    rename = save.os.rename

    def rename_or_fail(src, dst):
        if str(src).endswith("iter_0000002.tmp"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), src)
        return rename(src, dst)

    save.os.rename = rename_or_fail
    return _main(rank, world, flags, set())


def test_latest_is_replaced_only_after_the_folder_is_in_place(tmp_path):
    """The tracker names a checkpoint only once its folder has its final name: a rename that
    fails leaves `latest` on the previous checkpoint (written before the rename, it would name
    a folder that does not exist)."""
    ckpt, status = tmp_path / "ckpt", tmp_path / "status.json"
    flags = TINY + ["--train-iters", "3", "--save", str(ckpt), "--save-interval", "1",
                    "--exit-status-file", str(status)]
    assert run_distributed(_rename_fails_main, 1, flags)[0] == 1
    assert open(ckpt / "latest_checkpointed_iteration.txt").read() == "1"
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    reason = json.loads(status.read_text())["reason"]
    assert "saving iteration 2" in reason and "Input/output error" in reason and \
        "still names iteration 1" in reason, reason


def test_checkpoint_args_take_the_position_limit_and_qkv_bias(tmp_path, saved):
    """--use-checkpoint-args takes every model argument Megatron-LM's flag takes, also those a
    load does not compare (--max-position-embeddings with RoPE, --add-qkv-bias, --rotary-base),
    and the other settings that change the computation but no tensor (RoPE scaling, the norm
    epsilon)."""
    from megaloop.training.checkpointing import apply_checkpoint_args
    from megaloop.training.run_config import parse_args

    ckpt = saved(tmp_path)  # TINY: --max-position-embeddings 32, no QKV bias
    cfg = parse_args(TINY + ["--load", ckpt, "--use-checkpoint-args",
                             "--max-position-embeddings", "64", "--add-qkv-bias"])
    changed = apply_checkpoint_args(cfg)
    assert (cfg.model.max_position_embeddings, cfg.model.add_qkv_bias) == (32, False)
    assert "--max-position-embeddings 32" in changed and "--add-qkv-bias False" in changed
    cfg = parse_args(TINY + ["--load", ckpt, "--use-checkpoint-args", "--rotary-base", "500000",
                             "--use-rope-scaling", "--rope-scaling-factor", "4",
                             "--norm-epsilon", "1e-3"])
    saved_model = parse_args(TINY).model  # what the checkpoint was saved with
    changed = apply_checkpoint_args(cfg)
    for name in ("rotary_base", "use_rope_scaling", "rope_scaling_factor", "norm_epsilon"):
        assert getattr(cfg.model, name) == getattr(saved_model, name), name
        assert f"--{name.replace('_', '-')} {getattr(saved_model, name)}" in changed


def _signal_during_startup(rank, world, flags):
    """pretrain_looplm.main where the last rank gets SIGTERM while it starts up (after its flags
    are parsed, before the trainer is built): the handler is the one run() installs then."""
    from megaloop.training import trainer as trainer_mod
    from run_helpers import main_in_rank

    real = trainer_mod.Trainer.__init__

    def init_then_signal(self, *args, **kwargs):
        if rank == world - 1:
            os.kill(os.getpid(), signal.SIGTERM)  # fatal unless already caught
        real(self, *args, **kwargs)

    trainer_mod.Trainer.__init__ = init_then_signal
    return main_in_rank(flags)


def test_sigterm_during_startup_stops_every_rank_before_training(tmp_path):
    """One rank's SIGTERM during the start-up (a short SLURM job's --signal can land there):
    every rank stops before its first step (one all-reduce decides), with nothing to save; from
    a checkpoint, the run's state stays that checkpoint, which the next start resumes."""
    ckpt, status = tmp_path / "ckpt", tmp_path / "status.json"
    log = tmp_path / "run.jsonl"
    flags = TINY + ["--train-iters", "4", "--save", str(ckpt), "--load", str(ckpt),
                    "--exit-signal-handler", "--exit-status-file", str(status),
                    "--log-jsonl", str(log)]
    assert [c for c in run_distributed(_signal_during_startup, 2, flags)] == [0, 0]
    result = json.loads(status.read_text())
    assert result["status"] == "saved-and-stopped" and result["iteration"] == 0, result
    assert "during the start-up" in result["reason"] and "no checkpoint yet" in result["reason"]
    assert "before the first step after iteration 0" in result["reason"], result
    assert not log.exists() or not [r for r in _records_of(log) if r["split"] == "train"]
    assert not (ckpt / "latest_checkpointed_iteration.txt").exists()

    # From a checkpoint: trained to 2, then a start-up signal; the checkpoint stays iteration 2.
    run_distributed(_train, 2, flags + ["--exit-interval", "2"])
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    mtime = os.path.getmtime(ckpt / "iter_0000002")
    assert [c for c in run_distributed(_signal_during_startup, 2, flags)] == [0, 0]
    result = json.loads(status.read_text())
    assert result["status"] == "saved-and-stopped" and result["checkpoint_iteration"] == 2
    assert f"the run's state is checkpoint iteration 2 in {ckpt}" in result["reason"], result
    assert os.path.getmtime(ckpt / "iter_0000002") == mtime
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"


def _records_of(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_sigterm_without_the_handler_still_ends_the_process():
    """Without --exit-signal-handler nothing is caught: SIGTERM ends the run as before (the
    save lock's own handler releases and re-raises it)."""
    from megaloop.training import sigterm

    code = ("import os, signal, sys; sys.path.insert(0, %r)\n"
            "from megaloop.training import sigterm\n"
            "sigterm.catch(); os.kill(os.getpid(), signal.SIGTERM)\n"
            "assert sigterm.received() == signal.SIGTERM\n"
            "sigterm.release(); os.kill(os.getpid(), signal.SIGTERM)\n"
            "print('not reached')\n") % ROOT
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGTERM and "not reached" not in proc.stdout, proc.stderr
    assert sigterm.received() is None  # this process never caught anything


class _FullFile:
    """A shard file on a disk that fills up: its first ``budget`` bytes are written, then
    every write raises ENOSPC (as the kernel's write does)."""

    def __init__(self, stream, budget=1000):
        self.stream, self.budget = stream, budget

    def write(self, data):
        n = memoryview(data).nbytes
        if n > self.budget:
            self.budget = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.budget -= n
        return self.stream.write(data)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _stream_full_main(rank, world, flags):
    """pretrain_looplm.main whose shard files of iteration 2 fill the disk part-way through a
    tensor (``_FullFile``). torch.save turns the ENOSPC into its RuntimeError "[enforce fail at
    inline_container.cc] unexpected pos ..." (what a real full tmpfs gave, under --async-save
    and without); the file system then has 123456789 bytes free."""
    import collections
    import functools

    import torch
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    real = filesystem_async._write_item

    @functools.wraps(real)  # megatron-core inspects its signature
    def write_until_full(*args, **kwargs):
        at = next(i for i, a in enumerate(args) if hasattr(a, "fileno") and hasattr(a, "name"))
        if "iter_0000002" in str(args[at].name) and isinstance(args[at + 1], torch.Tensor):
            args = args[:at] + (_FullFile(args[at]),) + args[at + 1:]
        return real(*args, **kwargs)

    usage = collections.namedtuple("usage", "total used free")
    filesystem_async._write_item = write_until_full
    shutil.disk_usage = lambda path: usage(10**10, 10**10 - 123456789, 123456789)
    return _main(rank, world, flags, set())


@pytest.mark.parametrize("mode", [[], ["--async-save"]], ids=["sync", "async"])
def test_disk_full_inside_torch_save_says_the_disk_is_full(tmp_path, mode, capfd):
    """A full disk met inside torch.save (a tensor's bytes): torch raises "unexpected pos", the
    ENOSPC only its context, which megatron-core's writer processes lose on the way back. The
    message must still say the disk is full, with the folder and its free space."""
    import io

    import torch

    # The simulation is the case it stands for: torch.save itself hides the ENOSPC.
    with pytest.raises(RuntimeError, match="unexpected pos") as hidden:
        torch.save(torch.zeros(1000), _FullFile(io.BytesIO()))
    assert isinstance(hidden.value.__context__, OSError)
    ckpt, status = tmp_path / "ckpt", tmp_path / "status.json"
    flags = TINY + ["--train-iters", "3", "--save", str(ckpt), "--save-interval", "1",
                    "--exit-status-file", str(status)] + mode
    assert run_distributed(_stream_full_main, 1, flags) == [1]
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    reason = json.loads(status.read_text())["reason"]
    assert "saving iteration 2" in reason and "still names iteration 1" in reason and \
        f"the disk is full: 123,456,789 bytes free on the file system of {ckpt}" in reason and \
        "No space left on device" in reason, reason
    assert "unexpected pos" not in reason and "inline_container" not in reason, reason
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
