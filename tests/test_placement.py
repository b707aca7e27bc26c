"""Device placement, checked on CPU: the shim's placement check (megaloop.cpu_shim) fails where a
GPU run would put a host tensor next to a GPU one or into an NCCL collective.

The trainer runs under the check at TP=2, PP=2 and DP=2 with evaluation, diagnostics and a
checkpoint saved and loaded; the negative tests prove that the check fires for the mistakes it
exists to catch (a batch not moved, a model not moved, a host tensor in a collective).
"""

import pytest
import torch

from distributed import run_distributed
from test_training import BASE

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the placement check is a CPU mode (real devices on GPU)")

# Evaluation every 2 iterations and at the end, a save at the end: every path of train().
# --exit-duration-in-mins makes the exit check a collective every iteration.
RUN = BASE + ["--train-iters", "3", "--eval-interval", "2", "--eval-iters", "1",
              "--hidden-dropout", "0.1", "--exit-duration-in-mins", "1000"]


def check_placement() -> None:
    """Turn the shim's placement check on in this rank: the RL, generation and evaluation tests'
    rank bodies call it first, as the trainer's runs here do (on a GPU the devices are real and
    there is nothing to check)."""
    from megaloop import cpu_shim

    if cpu_shim.is_enabled():
        cpu_shim.enable_placement_check()


def _checked_run(rank, world, flags, ckpt, check=True):
    """Train with --save (evaluating on the way), then build a second trainer that --loads the
    checkpoint, trains one more step and evaluates; returns the logged losses and what the
    resumed trainer computed."""
    from megatron.core import parallel_state

    from megaloop import cpu_shim
    from megaloop.parallel.initialize import initialize
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer

    cpu_shim.enable_placement_check(check)
    cfg = parse_args(flags + ["--save", ckpt, "--log-jsonl", ckpt + ".jsonl"])
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    assert Trainer(cfg).train() is None
    losses = _losses(ckpt + ".jsonl") if rank == 0 else None

    parallel_state.destroy_model_parallel()  # a second trainer in this process builds them anew
    # (one more iteration than saved: the new schedule is taken explicitly)
    cfg = parse_args(flags + ["--load", ckpt, "--train-iters", "4",
                              "--override-opt_param-scheduler"])
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    resumed = Trainer(cfg)
    stats, _, ok = resumed.train_step()
    return losses, resumed.iteration, stats["loss"], resumed.evaluate()["loss"], ok


def _losses(path):
    import json

    with open(path) as f:
        return [(r["split"], r["iteration"], r["loss"]) for r in map(json.loads, f)
                if "loss" in r]


DIAGNOSTICS = ["--log-grad-norm-per-step", "--log-loop-geometry"]


@pytest.mark.parametrize("layout,world", [
    (["--tensor-model-parallel-size", "2", "--micro-batch-size", "2"] + DIAGNOSTICS, 2),
    (["--micro-batch-size", "1", "--use-distributed-optimizer"] + DIAGNOSTICS, 2),
    (["--pipeline-model-parallel-size", "2", "--micro-batch-size", "1"] + DIAGNOSTICS, 2),
    # LM losses moved to the first stage: its head reads the tied embedding there.
    (["--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
      "--pipeline-first-stage-readouts", "1,2"], 2),
], ids=["tp2", "dp2", "pp2", "pp2-moved-losses"])
def test_trainer_places_every_tensor(tmp_path, layout, world):
    """The whole trainer under the check; its losses equal the unchecked run's (the check
    observes, it changes nothing)."""
    flags = RUN + layout
    checked = run_distributed(_checked_run, world, flags, str(tmp_path / "a"))
    plain = run_distributed(_checked_run, world, flags, str(tmp_path / "b"), False)
    losses, iteration, step_loss, eval_loss, ok = checked[0]
    assert ok and iteration == 3  # loaded from the checkpoint
    assert {s for s, _, _ in losses} == {"train", "valid"}
    assert checked[0] == plain[0]


# --- the check fires --------------------------------------------------------------------------
def _step_with(rank, world, flags, sabotage):
    from megaloop import cpu_shim
    from megaloop.parallel.initialize import initialize
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer

    cpu_shim.enable_placement_check()
    if sabotage == "batch":  # the data iterator forgets to move its batches
        import megaloop.data.datasets as datasets

        datasets.to_device = lambda batch: batch
    elif sabotage == "model":  # the trainer forgets to move the model
        torch.nn.Module.cuda = lambda self, device=None: self
    cfg = parse_args(flags)
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    trainer = Trainer(cfg)
    try:
        trainer.train_step()
    except cpu_shim.PlacementError as exc:
        return str(exc)
    except RuntimeError as exc:  # a pipeline peer waiting for the stage that failed
        if rank == 0:
            raise
        return f"peer failed: {exc}"
    return None


@pytest.mark.parametrize("sabotage", ["batch", "model"])
@pytest.mark.parametrize("layout,world", [
    (["--micro-batch-size", "2"], 1),
    (["--pipeline-model-parallel-size", "2", "--micro-batch-size", "1"], 2),
], ids=["single", "pp2"])
def test_unplaced_batch_or_model_fails(sabotage, layout, world):
    messages = run_distributed(_step_with, world, BASE + layout, sabotage)
    assert messages[0] is not None and messages[0].startswith("placement check:"), messages
    if sabotage == "batch" or world == 1:
        # The first stage embeds the tokens: there a host tensor meets a GPU one. (Under
        # pipeline parallelism megatron-core moves the tied embedding to the GPU itself, so an
        # unmoved model first fails in the first layer's norm.)
        assert "embedding" in messages[0], messages
    if sabotage == "batch":
        assert "batch left on the host" in messages[0]
    assert run_distributed(_step_with, world, BASE + layout, None)[0] is None  # the control


def _collectives(rank, world):
    from megatron.core import parallel_state

    from megaloop import cpu_shim
    from megaloop.device import current_device
    from distributed import setup_parallel

    cpu_shim.enable_placement_check()
    setup_parallel(tp=1)
    errors = {}
    cases = {
        "all_reduce": lambda: torch.distributed.all_reduce(torch.zeros(2)),
        "all_gather_into_tensor": lambda: torch.distributed.all_gather_into_tensor(
            torch.zeros(2 * world, device="cuda"), torch.zeros(2)),
        "broadcast": lambda: torch.distributed.broadcast(torch.ones(3).cpu(), src=0),
        # a tensor computed from host tensors only is still on the host
        "derived": lambda: torch.distributed.all_reduce(torch.arange(4.0) * 2 + 1),
        # .cuda() without keeping the result leaves the original on the host
        "unassigned move": lambda: (lambda t: (t.cuda(), torch.distributed.all_reduce(t)))(
            torch.zeros(2)),
    }
    for name, call in cases.items():
        try:
            call()
        except cpu_shim.PlacementError as exc:
            errors[name] = str(exc)
    # What a GPU run does: these pass.
    torch.distributed.all_reduce(torch.zeros(2, device=current_device()))
    torch.distributed.all_reduce(torch.zeros(2).cuda())
    torch.distributed.all_reduce(torch.zeros(2).to(torch.cuda.current_device()) + 1)
    torch.distributed.all_reduce(torch.zeros(2), group=parallel_state.get_data_parallel_group_gloo())
    return errors


def test_host_tensor_into_collective_fails():
    errors = run_distributed(_collectives, 2)[0]
    assert set(errors) == {"all_reduce", "all_gather_into_tensor", "broadcast", "derived",
                           "unassigned move"}
    assert "torch.distributed.all_reduce got a host tensor (2,)" in errors["all_reduce"]


def _marks(rank, world):
    from megaloop import cpu_shim

    cpu_shim.enable_placement_check()
    host = torch.zeros(3)
    placed = host.cuda()
    out = {
        "factory": cpu_shim.is_host(host),
        "moved": cpu_shim.is_host(placed),
        "device=cuda": cpu_shim.is_host(torch.zeros(3, device="cuda")),
        "current_device": cpu_shim.is_host(torch.zeros(3, device=torch.cuda.current_device())),
        "from placed": cpu_shim.is_host(placed * 2),
        "like placed": cpu_shim.is_host(torch.zeros_like(placed)),
        "to cpu": cpu_shim.is_host(placed.cpu()),
        "scalar mix": cpu_shim.is_host(placed + torch.tensor(1.0)),
    }
    try:
        placed + host
        out["mixed"] = None
    except cpu_shim.PlacementError as exc:
        out["mixed"] = str(exc)
    cpu_shim.enable_placement_check(False)
    out["off"] = (placed + host).shape == (3,)
    return out


def test_marks_follow_cuda_semantics():
    m = run_distributed(_marks, 1)[0]
    assert m["factory"] and not m["moved"] and not m["device=cuda"] and not m["current_device"]
    assert not m["from placed"] and not m["like placed"] and m["to cpu"]
    assert not m["scalar mix"]  # a 0-d host tensor is a scalar to a CUDA kernel
    assert m["mixed"] is not None and "add mixes accelerator tensors" in m["mixed"]
    assert m["off"]


def test_environment_variable_turns_the_check_on():
    """MEGALOOP_SHIM_CHECK_PLACEMENT=1 checks a whole run (pretrain_looplm.py enables the shim)."""
    import os
    import subprocess
    import sys

    code = ("import torch; from megaloop import cpu_shim; cpu_shim.enable(); "
            "print(cpu_shim.placement_check_enabled()); "
            "x = torch.zeros(2, device='cuda') + torch.ones(2)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MEGALOOP_SHIM_CHECK_PLACEMENT="1", PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.startswith("True"), out.stdout + out.stderr
    assert out.returncode != 0 and "PlacementError: placement check: add" in out.stderr


def _module_moves(rank, world):
    from megaloop import cpu_shim

    cpu_shim.enable_placement_check()

    def params_on_host(module):
        return [cpu_shim.is_host(p) for p in module.parameters()]

    out = {"built": params_on_host(torch.nn.Linear(3, 2))}
    for name, move in (("current_device", lambda m: m.to(torch.cuda.current_device())),
                       ("cuda", lambda m: m.to("cuda")),
                       ("device keyword", lambda m: m.to(device=torch.device("cuda"))),
                       ("with dtype", lambda m: m.to(torch.cuda.current_device(),
                                                     torch.float64)),
                       ("like a placed tensor", lambda m: m.to(torch.zeros(1).cuda())),
                       ("cpu", lambda m: m.cuda().to("cpu")),
                       ("dtype only", lambda m: m.to(torch.float64))):
        module = move(torch.nn.Linear(3, 2))
        out[name] = (params_on_host(module), module.weight.dtype)
    module = torch.nn.Linear(3, 2).to(torch.cuda.current_device())
    module(torch.zeros(4, 3, device=torch.cuda.current_device()))  # what a GPU run does
    try:
        module(torch.zeros(4, 3))
        out["fed a host batch"] = None
    except cpu_shim.PlacementError as exc:
        out["fed a host batch"] = str(exc)
    return out


def test_module_to_the_accelerator_moves_its_parameters():
    """``model.to(torch.cuda.current_device())`` (tools/generate.py's load) moves a model on a
    GPU as ``model.cuda()`` does; the check must see it so (it kept the host marks before)."""
    m = run_distributed(_module_moves, 1)[0]
    assert m["built"] == [True, True]
    for name in ("current_device", "cuda", "device keyword", "like a placed tensor"):
        assert m[name] == ([False, False], torch.float32), name
    assert m["with dtype"] == ([False, False], torch.float64)
    assert m["cpu"] == ([True, True], torch.float32)
    assert m["dtype only"] == ([True, True], torch.float64)  # still on the host
    message = m["fed a host batch"]  # the control: the check still fires on a real mistake
    assert message is not None and "mixes accelerator tensors" in message, message
