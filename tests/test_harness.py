"""The rank harness itself (tests/distributed.py): fork on CPU, spawn with one GPU per rank."""

import os

import pytest
import torch

import distributed
from distributed import run_distributed


def _rank_info(rank, world):
    from megatron.core import parallel_state

    distributed.setup_parallel(tp=world)
    t = torch.ones(1) * (rank + 1)
    torch.distributed.all_reduce(t)
    return os.getpid(), t.item(), parallel_state.get_tensor_model_parallel_rank()


def test_spawned_ranks_run_module_level_test_bodies():
    """The GPU path's start (spawn: the body is pickled by reference and imported afresh),
    exercised on CPU ranks."""
    results = run_distributed(_rank_info, 2, start_method="spawn")
    assert [r[1] for r in results] == [3.0, 3.0] and [r[2] for r in results] == [0, 1]
    assert os.getpid() not in {r[0] for r in results}


def test_parent_never_initialises_cuda():
    run_distributed(_rank_info, 1)
    assert os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1"
    assert not torch.cuda.is_initialized()


def test_more_ranks_than_gpus_is_a_skip(monkeypatch):
    monkeypatch.setattr(distributed, "gpu_count", lambda: 1)
    with pytest.raises(pytest.skip.Exception, match="needs 2 GPUs"):
        run_distributed(_rank_info, 2)


def test_single_gpu_mode_caps_the_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert distributed.gpu_count() == 4
    monkeypatch.setenv("MEGALOOP_TEST_GPUS", "1")
    assert distributed.gpu_count() == 1


def _count_run(rank, world, path):
    with open(path, "a") as f:
        f.write(f"{rank}\n")
    return rank


@pytest.mark.skipif(distributed.gpu_count() > 0, reason="forked gloo ranks only")
def test_a_port_taken_before_rank_0_listens_is_retried(monkeypatch, tmp_path):
    # The port chosen for the store is taken (here: held listening by this test) before rank 0
    # binds it. The ranks are started again on another port; the body runs once per rank.
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    ports = iter([held.getsockname()[1]])
    real = distributed.free_port
    monkeypatch.setattr(distributed, "free_port", lambda: next(ports, None) or real())
    path = tmp_path / "ran"
    try:
        assert run_distributed(_count_run, 2, str(path)) == [0, 1]
    finally:
        held.close()
    assert sorted(path.read_text().split()) == ["0", "1"]
