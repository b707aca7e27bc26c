"""Checkpoints across megatron-core versions: a run saved under 0.16.1 resumes under 0.19.x loss for
loss, and the reverse.

Both versions are needed: the test runs under one venv and launches ``pretrain_looplm.py`` with the
other's Python (the main ``.venv`` holds 0.16.1, ``.venv-mc19`` 0.19.x, made by
tools/setup_mc19_venv.sh). ``.ci/run`` runs it in the 0.19 stage, after both venvs exist; where the
other venv is missing it is skipped, naming the script that makes it.

Each direction: the saving version trains 6 iterations straight (TP=2 under torchrun, a checkpoint
at iteration 3); the other version loads that checkpoint at iteration 3 and trains 4..6. Its losses
must equal the straight run's, and its resumed state must be the saved one (the learning rate
and the consumed samples of each logged iteration).
"""

import json
import os
import subprocess

import pytest

from distributed import free_port
from flags import TEST_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = [*TEST_FLAGS, "--tensor-model-parallel-size", "2", "--num-layers", "2", "--num-loops",
         "3", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "6", "--lr", "3e-3", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "200", "--log-interval", "1", "--eval-iters", "1",
         "--eval-interval", "100", "--save-interval", "3", "--transformer-impl", "local"]


def _version(python: str) -> str:
    out = subprocess.run([python, "-c", "import importlib.metadata as m; "
                          "print(m.version('megatron-core'))"], capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def _this_and_other():
    from importlib.metadata import version

    this = version("megatron-core")
    other = ".venv-mc19" if this.startswith("0.16.") else ".venv"
    python = os.path.join(ROOT, other, "bin", "python")
    if not os.path.exists(python):
        pytest.skip(f"needs the other megatron-core's venv {other}/ (bash tools/"
                    f"{'setup_mc19_venv.sh' if other == '.venv-mc19' else 'setup_venv.sh'}); "
                    f".ci/run makes both and runs this in its 0.19 stage")
    return this, python


def _run(python, extra, log, console):
    cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), os.path.join(ROOT, "pretrain_looplm.py"), *FLAGS, *extra,
           "--log-jsonl", str(log)]
    with open(console, "w") as out:
        code = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                              stdout=out, stderr=subprocess.STDOUT, timeout=600).returncode
    assert code == 0, open(console).read()[-3000:]
    return {r["iteration"]: r for r in map(json.loads, open(log)) if r["split"] == "train"}


@pytest.mark.parametrize("direction", ["other saves, this resumes", "this saves, other resumes"])
def test_a_checkpoint_resumes_loss_for_loss_across_versions(tmp_path, direction):
    this, other = _this_and_other()
    import sys

    saver, loader = (other, sys.executable) if direction.startswith("other") else \
        (sys.executable, other)
    assert _version(saver)[:4] != _version(loader)[:4]  # really two versions
    ckpt = tmp_path / "ckpt"
    straight = _run(saver, ["--save", str(ckpt)], tmp_path / "straight.jsonl",
                    tmp_path / "straight.log")
    resumed = _run(loader, ["--load", str(ckpt), "--ckpt-step", "3", "--save",
                            str(tmp_path / "after")], tmp_path / "resumed.jsonl",
                   tmp_path / "resumed.log")
    assert sorted(resumed) == [4, 5, 6], sorted(resumed)
    for it in (4, 5, 6):
        for key in ("lr", "consumed_samples"):
            assert resumed[it].get(key) == straight[it].get(key), (it, key)
        assert resumed[it]["loss"] == straight[it]["loss"], (it, resumed[it], straight[it])
