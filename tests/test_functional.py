"""End to end: torchrun launches pretrain_looplm.py on 2 gloo ranks with tensor parallelism."""

import json
import os
import subprocess
import sys
import types

from distributed import console_of, free_port, run_distributed, run_main
from flags import TEST_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_torchrun_tp2_trains_and_logs_per_step(tmp_path):
    log = tmp_path / "run.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), os.path.join(ROOT, "pretrain_looplm.py"), *TEST_FLAGS,
           "--tensor-model-parallel-size", "2", "--num-layers", "2", "--num-loops", "4",
           "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
           "--max-position-embeddings", "64", "--micro-batch-size", "2",
           "--global-batch-size", "4", "--train-iters", "16", "--lr", "3e-3",
           "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
           "--log-interval", "1", "--eval-iters", "2", "--log-jsonl", str(log)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    valid = [r for r in records if r["split"] == "valid"]
    assert [r["iteration"] for r in train] == list(range(1, 17))
    assert all(len(r["step_losses"]) == 4 and len(r["exit_probs"]) == 4 for r in records)
    for r in train:
        assert abs(sum(r["exit_probs"]) - 1) < 1e-4
        for key in ("grad_norm", "lr", "tokens_per_sec", "tflops_per_gpu", "loss"):
            assert isinstance(r[key], float) and r[key] >= 0, key
    first = sum(r["loss"] for r in train[:3]) / 3
    last = sum(r["loss"] for r in train[-3:]) / 3
    assert last < first - 0.05, (first, last)
    assert len(valid) == 1 and len(valid[0]["step_losses"]) == 4
    assert "effective depth 8" in proc.stdout
    _assert_quiet(proc, train_lines=16)


def _assert_quiet(proc, train_lines):
    """The console of a 2-rank run: each banner once (rank 0), one line per log interval, one per
    evaluation, and no Python warning on either stream (megaloop.runtime.quiet_megatron)."""
    out = proc.stdout.splitlines()
    for line in out:
        assert line.startswith(("> CPU development mode", "> LoopedGPT layout", "> start-up",
                                " iteration ",
                                " validation at iteration ", "> loop geometry",
                                "> pipeline: ")), ("unexpected line", line, out)
    assert sum(line.startswith("> LoopedGPT layout") for line in out) == 1, out
    assert sum(line.startswith("> pipeline: ") for line in out) <= 1, out  # rank 0, PP > 1
    assert sum(line.startswith("> CPU development mode") for line in out) <= 1, out
    assert sum(line.startswith("> start-up (s): ") for line in out) == 1, out  # rank 0 only
    assert sum(line.startswith(" iteration ") for line in out) == train_lines, out
    noisy = [line for line in (proc.stdout + proc.stderr).splitlines()
             if "Warning" in line or "warn" in line]
    assert not noisy, noisy


def _single_stage_run(rank, world, args):
    """The same run on one rank, in a forked process (the plain recurrence, no pipeline)."""
    from megaloop.parallel.initialize import initialize
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer

    cfg = parse_args(args)
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    Trainer(cfg).train()
    return True


def test_pp2_run_matches_single_stage(tmp_path):
    """The foundation's done-when run with --pipeline-model-parallel-size 2 instead of TP=2:
    the same loss and per-step losses (JSONL) as one stage, every iteration. The 2-stage run is
    pretrain_looplm.main on two forked ranks (the launch itself is the TP=2 test's), its console
    checked as a launched run's."""
    args = [*TEST_FLAGS, "--num-layers", "2", "--num-loops", "4", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "16",
            "--lr", "3e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "512", "--log-interval", "1", "--eval-iters", "2"]
    pp_log, ref_log = tmp_path / "pp2.jsonl", tmp_path / "pp1.jsonl"
    codes = run_distributed(run_main, 2, ["--pipeline-model-parallel-size", "2", *args,
                                          "--log-jsonl", str(pp_log)], str(tmp_path),
                            timeout=300)
    assert codes == [0, 0]
    out, err = console_of(tmp_path, 2)
    proc = types.SimpleNamespace(stdout=out, stderr=err)
    assert "PP 2" in proc.stdout and "effective depth 8" in proc.stdout
    _assert_quiet(proc, train_lines=16)

    run_distributed(_single_stage_run, 1, args + ["--log-jsonl", str(ref_log)], timeout=300)
    pp = [json.loads(line) for line in pp_log.read_text().splitlines()]
    ref = [json.loads(line) for line in ref_log.read_text().splitlines()]
    assert [(r["split"], r["iteration"]) for r in pp] == [(r["split"], r["iteration"]) for r in ref]
    assert abs(pp[0]["loss"] - ref[0]["loss"]) < 1e-4  # the done-when figure
    for a, b in zip(pp, ref, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-4, (a["iteration"], a["loss"], b["loss"])
        for key in ("step_losses", "exit_probs"):
            for x, y in zip(a[key], b[key], strict=True):
                assert abs(x - y) < 1e-4, (a["iteration"], key, a[key], b[key])
    train = [r for r in pp if r["split"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"] - 0.05
