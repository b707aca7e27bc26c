"""A diverging run saves nothing while its steps are being skipped: `latest` stays on the weights
from before the skipped steps (or there is no checkpoint), and the stop message says which
checkpoint that is and how to resume from it with a lower LR.

Non-finite steps are made as in tests/test_reliability.py (the loss of chosen iterations times
NaN), and for real with --lr 1e10 (the first step is applied, every later one is NaN).
"""

import json
import os

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from distributed import run_distributed
from test_checkpoint import _train
from test_reliability import _main, _records
from test_training import BASE

TINY = BASE + ["--micro-batch-size", "2"]


def _model_tensors(folder, out):
    """The model's tensors of a checkpoint folder, read back without megaloop or a process group."""
    dcp_to_torch_save(folder, out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items()
            if isinstance(v, torch.Tensor) and not k.startswith("optimizer.")}


def test_latest_stays_on_the_weights_from_before_the_skipped_steps(tmp_path):
    flags = TINY + ["--train-iters", "10", "--save-interval", "2", "--eval-interval", "2",
                    "--eval-iters", "1", "--max-skipped-steps-in-a-row", "3"]
    ckpt, log, status = tmp_path / "ckpt", tmp_path / "log.jsonl", tmp_path / "status.json"
    code = run_distributed(_main, 1, flags + ["--save", str(ckpt), "--log-jsonl", str(log),
                                              "--exit-status-file", str(status)],
                           set(range(4, 11)))[0]
    assert code == 1
    # Iterations 4..6 were skipped: the save at 4 did not happen, the run stopped at 6.
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    reason = json.loads(status.read_text())["reason"]
    assert "iterations 4..6" in reason and "names iteration 2" in reason
    assert f"--load {ckpt} --lr 0.001 --override-opt_param-scheduler" in reason, reason
    # The checkpoint holds what an unpoisoned run had at iteration 2: finite, the same weights,
    # the same validation loss.
    clean, clean_log = tmp_path / "clean", tmp_path / "clean.jsonl"
    run_distributed(_train, 1, flags + ["--save", str(clean), "--log-jsonl", str(clean_log),
                                        "--exit-interval", "2"])
    kept = _model_tensors(str(ckpt / "iter_0000002"), str(tmp_path / "kept.pt"))
    want = _model_tensors(str(clean / "iter_0000002"), str(tmp_path / "want.pt"))
    assert kept.keys() == want.keys() and kept
    for k in kept:
        assert torch.isfinite(kept[k]).all() and torch.equal(kept[k], want[k]), k

    def valid_at_2(path):
        return [r["loss"] for r in _records(path) if r["split"] == "valid"
                and r["iteration"] == 2]

    assert valid_at_2(log) == valid_at_2(clean_log) and valid_at_2(log)[0] < 10


def test_a_save_on_a_skipped_step_is_made_after_the_next_applied_one(tmp_path):
    ckpt, status = tmp_path / "ckpt", tmp_path / "status.json"
    flags = TINY + ["--train-iters", "8", "--save", str(ckpt), "--save-interval", "3",
                    "--exit-status-file", str(status)]
    assert run_distributed(_main, 1, flags, {3, 8})[0] == 0
    # 3 skipped: saved after 4 instead; 6 as planned; 8 (the end) skipped: not saved.
    assert sorted(os.listdir(ckpt)) == ["iter_0000004", "iter_0000006",
                                        "latest_checkpointed_iteration.txt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    result = json.loads(status.read_text())
    assert result["status"] == "completed" and result["checkpoint_iteration"] == 6


@pytest.mark.parametrize("extra", [[], ["--async-save"]], ids=["sync", "async-save"])
def test_lr_1e10_leaves_no_checkpoint_and_says_so(tmp_path, extra):
    """The issue's run: the first step (finite gradients) takes the weights to ~1e10, every later
    step is NaN. Iteration 1's checkpoint holds the weights that diverge: set aside (with
    --async-save once its background save is published)."""
    ckpt, status = tmp_path / "ckpt", tmp_path / "status.json"
    flags = TINY + extra + ["--train-iters", "10", "--lr", "1e10", "--save", str(ckpt),
                            "--save-interval", "1", "--max-skipped-steps-in-a-row", "3",
                            "--exit-status-file", str(status)]
    assert run_distributed(_main, 1, flags, set())[0] == 1
    assert sorted(os.listdir(ckpt)) == ["iter_0000001.diverged"]
    reason = json.loads(status.read_text())["reason"]
    assert "iterations 2..4" in reason and "No checkpoint was saved before them" in reason \
        and "--lr 1e+09" in reason, reason
