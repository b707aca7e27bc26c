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


# One call of every factory the shim lists, with the device left to the caller. The shim's list
# must equal this table's keys: a factory dropped from the list fails its call here (torch
# refuses "cuda" without CUDA), and one added to it needs a call here.
_A = torch.ones(2, 3)
FACTORY_CALLS = {
    "empty": lambda device: torch.empty(2, device=device),
    "zeros": lambda device: torch.zeros(2, device=device),
    "ones": lambda device: torch.ones(2, device=device),
    "full": lambda device: torch.full((2,), 3.0, device=device),
    "tensor": lambda device: torch.tensor([1, 2], device=device),
    "arange": lambda device: torch.arange(3, device=device),
    "range": lambda device: torch.range(0, 2, device=device),
    "rand": lambda device: torch.rand(2, device=device),
    "randn": lambda device: torch.randn(2, device=device),
    "randint": lambda device: torch.randint(0, 5, (2,), device=device),
    "randperm": lambda device: torch.randperm(4, device=device),
    "linspace": lambda device: torch.linspace(0, 1, 3, device=device),
    "logspace": lambda device: torch.logspace(0, 1, 3, device=device),
    "eye": lambda device: torch.eye(2, device=device),
    "empty_like": lambda device: torch.empty_like(_A, device=device),
    "zeros_like": lambda device: torch.zeros_like(_A, device=device),
    "ones_like": lambda device: torch.ones_like(_A, device=device),
    "full_like": lambda device: torch.full_like(_A, 2.0, device=device),
    "rand_like": lambda device: torch.rand_like(_A, device=device),
    "randn_like": lambda device: torch.randn_like(_A, device=device),
    "randint_like": lambda device: torch.randint_like(_A, 5, device=device),
    "as_tensor": lambda device: torch.as_tensor([1.0, 2.0], device=device),
    "asarray": lambda device: torch.asarray([1.0, 2.0], device=device),
    "empty_strided": lambda device: torch.empty_strided((2, 2), (2, 1), device=device),
    "scalar_tensor": lambda device: torch.scalar_tensor(1.0, device=device),
    "tril_indices": lambda device: torch.tril_indices(3, 3, device=device),
    "triu_indices": lambda device: torch.triu_indices(3, 3, device=device),
    "normal": lambda device: torch.normal(0.0, 1.0, (2,), device=device),
}
# torch.frombuffer takes no device (it wraps host memory): listed, it is called without one.
NO_DEVICE = {"frombuffer": lambda: torch.frombuffer(bytearray(8), dtype=torch.float32)}
TENSOR_FACTORY_CALLS = {
    "new_empty": lambda device: _A.new_empty(2, device=device),
    "new_zeros": lambda device: _A.new_zeros(2, device=device),
    "new_ones": lambda device: _A.new_ones(2, device=device),
    "new_full": lambda device: _A.new_full((2,), 1.0, device=device),
    "new_tensor": lambda device: _A.new_tensor([1.0], device=device),
    "new_empty_strided": lambda device: _A.new_empty_strided((2, 2), (2, 1), device=device),
}


def test_every_listed_factory_takes_cuda_as_cpu():
    """Each factory the shim lists (torch's and Tensor's) and each of this test's own table of
    the common ones, called with device "cuda", "cuda:0", torch.device("cuda", 0) and the
    ordinal 0, gives a CPU tensor; the list and the table name the same factories."""
    assert not torch.cuda.is_available() and cpu_shim.is_enabled()
    listed = set(cpu_shim.FACTORIES) | set(cpu_shim.TENSOR_FACTORIES)
    calls = {**FACTORY_CALLS, **TENSOR_FACTORY_CALLS}
    for name in sorted(listed | set(calls) | set(NO_DEVICE)):
        if name in NO_DEVICE:
            assert NO_DEVICE[name]().device.type == "cpu"
            continue
        assert name in calls, f"the shim lists {name}: add a call of it to FACTORY_CALLS"
        for device in ("cuda", "cuda:0", torch.device("cuda", 0), 0):
            try:
                made = calls[name](device)
            except (AssertionError, RuntimeError) as error:  # torch's "not compiled with CUDA"
                raise AssertionError(f"torch.{name}(device={device!r}): {error}") from None
            assert made.device.type == "cpu", (name, device)
    assert set(cpu_shim.FACTORIES) == set(FACTORY_CALLS) | set(NO_DEVICE)
    assert set(cpu_shim.TENSOR_FACTORIES) == set(TENSOR_FACTORY_CALLS)
    # and the factories with pin_memory drop it (no pinned allocator without CUDA)
    assert not torch.zeros(2, device="cuda", pin_memory=True).is_pinned()
    assert not torch.empty(2, pin_memory=True).is_pinned()
