"""No silent CPU run on a GPU node: without CUDA, a training command whose node or command line
says a GPU was meant is refused before any process group, naming what said so; the machines
meant for the CPU (these tests, the demo) set nothing and are not refused; MEGALOOP_ALLOW_CPU=1
opts in. (torch.cuda.is_available() is False on this machine: every case below is the "CUDA does
not start" case.)"""

import os
import subprocess
import sys

import pytest
import torch

from megaloop.device import gpu_signs, refuse_cpu_fallback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
        "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--max-position-embeddings", "8", "--train-iters", "1",
        "--global-batch-size", "1", "--micro-batch-size", "1"]


@pytest.fixture
def no_dev(tmp_path):
    return str(tmp_path / "dev")  # a /dev without NVIDIA device files


@pytest.mark.parametrize("env,argv,sign", [
    ({"NVIDIA_VISIBLE_DEVICES": "all"}, [], "NVIDIA_VISIBLE_DEVICES=all"),
    ({"SLURM_JOB_GPUS": "0,1"}, [], "SLURM_JOB_GPUS=0,1"),
    ({"SLURM_GPUS_ON_NODE": "8"}, [], "SLURM_GPUS_ON_NODE=8"),
    ({"CUDA_VISIBLE_DEVICES": "0"}, [], "CUDA_VISIBLE_DEVICES=0"),
    ({}, ["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine"),
    ({}, ["--transformer-impl=transformer_engine"], "--transformer-impl transformer_engine"),
    ({}, ["--transformer-impl", "local", "--transformer-impl", "transformer_engine"],
     "--transformer-impl transformer_engine"),
])
def test_each_sign_of_a_gpu_node_is_refused_by_name(env, argv, sign, no_dev):
    with pytest.raises(ValueError) as exc:
        refuse_cpu_fallback(argv, env, no_dev)
    text = str(exc.value)
    assert f"this run was meant for a GPU ({sign})" in text, text
    assert "MEGALOOP_ALLOW_CPU=1" in text and "\n" not in text
    refuse_cpu_fallback(argv, dict(env, MEGALOOP_ALLOW_CPU="1"), no_dev)  # opted in


def test_nvidia_device_files_are_a_sign(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidiactl").write_text("")  # the control node alone names no GPU
    assert gpu_signs([], {}, str(dev)) == []
    (dev / "nvidia3").write_text("")
    (dev / "nvidia0").write_text("")
    assert gpu_signs([], {}, str(dev)) == [f"{dev}/nvidia0 exists"]
    with pytest.raises(ValueError, match="nvidia0 exists"):
        refuse_cpu_fallback([], {}, str(dev))


@pytest.mark.parametrize("env,argv", [
    ({}, []),  # this machine, the tests, the demo
    ({"CUDA_VISIBLE_DEVICES": ""}, []),  # GPUs hidden on purpose
    ({"CUDA_VISIBLE_DEVICES": "-1"}, []),
    ({"NVIDIA_VISIBLE_DEVICES": "void"}, []),
    ({"SLURM_GPUS_ON_NODE": "0"}, []),  # a CPU partition
    ({}, ["--transformer-impl", "local"]),
    ({}, ["--transformer-impl", "transformer_engine", "--transformer-impl", "local"]),
])
def test_a_machine_meant_for_the_cpu_is_not_refused(env, argv, no_dev):
    assert gpu_signs(argv, env, no_dev) == []
    refuse_cpu_fallback(argv, env, no_dev)


def test_the_message_names_the_cuda_build_and_likely_causes(monkeypatch, no_dev):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(ValueError) as exc:
        refuse_cpu_fallback([], {"CUDA_VISIBLE_DEVICES": "0"}, no_dev)
    assert f"torch {torch.__version__} (CUDA 13.0) finds no usable GPU: a driver older" \
        in str(exc.value)


# (train_rl.py's flags say no dropout: RL refuses Megatron-LM's default 0.1, and a flag mistake
# is reported before the device is looked at)
@pytest.mark.parametrize("entry,flags", [("pretrain_looplm.py", TINY), (
    "train_rl.py", ["--hidden-dropout", "0", "--attention-dropout", "0"])])
def test_the_entry_points_refuse_before_any_process_group(entry, flags):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    env.pop("MEGALOOP_ALLOW_CPU", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, entry), *flags,
                           "--transformer-impl", "transformer_engine", "--bf16"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: CUDA is not available but this run "
                                                   "was meant for a GPU (CUDA_VISIBLE_DEVICES=0;"
                                                   " --transformer-impl transformer_engine)"), \
        proc.stderr
    assert "CPU development mode" not in proc.stdout  # nothing started


def test_opting_in_configures_the_cpu_run(monkeypatch):
    """With MEGALOOP_ALLOW_CPU=1 the same command gets past the check (here: configured)."""
    from megaloop.training.run import configure

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ValueError, match="meant for a GPU"):
        configure(TINY)
    monkeypatch.setenv("MEGALOOP_ALLOW_CPU", "1")
    assert configure(TINY).model.num_layers == 1
