"""The CPU development mode: what it rewrites, and the trace that lists megatron-core's sites."""

import torch

from distributed import run_distributed
from megaloop import cpu_shim
from flags import TEST_FLAGS


def test_shim_active_without_cuda():
    assert not torch.cuda.is_available() and cpu_shim.is_enabled()
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(1).cuda().device.type == "cpu"
    assert torch.ones(1).to("cuda").device.type == "cpu"
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(1).type(torch.float64).dtype == torch.float64  # conversions untouched


def test_rng_tracker_streams_follow_cpu_generator():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    tracker.add("a", 11)
    tracker.add("b", 12)
    torch.manual_seed(0)
    outside = torch.rand(3)
    with tracker.fork("a"):
        a1 = torch.rand(3)
    with tracker.fork("b"):
        b1 = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(3), outside)  # the default stream is restored after forks
    assert not torch.equal(a1, b1)  # distinct named streams
    # The stream "a" is the CPU generator seeded with 11.
    assert torch.equal(a1, torch.rand(3, generator=torch.Generator().manual_seed(11)))


def _traced_step(rank, world):
    from megaloop.parallel.initialize import initialize
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer

    cpu_shim.enable(trace=True)
    cfg = parse_args([*TEST_FLAGS, "--num-layers", "1", "--num-loops", "2", "--hidden-size", "16",
                      "--num-attention-heads", "2", "--seq-length", "8",
                      "--max-position-embeddings", "8", "--micro-batch-size", "1",
                      "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
                      "--vocab-size", "64", "--eval-iters", "0"])
    initialize(cfg.parallel, 1)
    Trainer(cfg).train_step()
    return cpu_shim.call_sites()


def test_trace_lists_megatron_call_sites():
    sites = run_distributed(_traced_step, 1)[0]
    files = {where.split(":")[0] for where, _, _ in sites}
    # Each level of the shim is exercised by the megatron-core code that needs it.
    assert "megatron/core/optimizer/clip_grads.py" in files           # type strings, devices
    assert "megatron/core/pipeline_parallel/schedules.py" in files    # device="cuda"
    assert any(what == "torch.cuda.current_device" for _, what, _ in sites)
    assert any(what == "Tensor.type()" for _, what, _ in sites)
    assert all(n > 0 for _, _, n in sites)


def test_backward_pass_runs_inside_the_shim():
    """Activation recomputation reruns forward code (with its device="cuda" literals) inside the
    backward pass; torch.autograd.backward is itself intercepted by the mode, so the shim must
    re-enter there."""
    class Recreate(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * torch.full_like(g, 2.0, device="cuda")

    x = torch.ones(3, requires_grad=True)
    torch.autograd.backward(Recreate.apply(x).sum())
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    y = torch.ones(3, requires_grad=True)
    Recreate.apply(y).sum().backward()
    assert torch.equal(y.grad, torch.full((3,), 2.0))
