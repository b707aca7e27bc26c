"""Where tensors for the model and for collectives go.

On a GPU machine that is the rank's GPU (``torch.cuda.current_device()``, set from LOCAL_RANK when
the process group starts). Under the CPU shim the same call answers the shim's stand-in for it, so
the move below runs on CPU too, where the shim's placement check can verify it. Without CUDA and
without the shim everything stays on the CPU.

``refuse_cpu_fallback`` keeps that CPU mode for machines meant for it: a training job on a GPU node
whose CUDA does not start is refused instead.
"""

from __future__ import annotations

import os

import torch


def current_device():
    """The accelerator device of this rank (its stand-in under the CPU shim, else "cpu")."""
    from megaloop import cpu_shim

    if torch.cuda.is_available() or cpu_shim.is_enabled():
        return torch.cuda.current_device()
    return "cpu"


def device_of(t: torch.Tensor):
    """The device to put tensors that meet ``t`` in an op on: ``t``'s own, or under the CPU shim
    (where every tensor is on the CPU) its accelerator stand-in, unless ``t`` would live on the
    host of a GPU machine."""
    from megaloop import cpu_shim

    if t.device.type == "cpu" and cpu_shim.is_enabled() and not cpu_shim.is_host(t):
        return current_device()
    return t.device


def to_device(batch: dict) -> dict:
    """A batch dict with every tensor on ``current_device()``. ``non_blocking``: the copy from
    (pinned) host memory overlaps with the GPU work already queued."""
    device = current_device()
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


ALLOW_CPU_ENV = "MEGALOOP_ALLOW_CPU"


def _explicit_transformer_engine(argv) -> bool:
    """Whether the command line itself names ``--transformer-impl transformer_engine`` (its last
    value, as argparse takes it), as opposed to the flag's default."""
    value = None
    for i, arg in enumerate(argv):
        if arg == "--transformer-impl" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--transformer-impl="):
            value = arg.split("=", 1)[1]
    return value == "transformer_engine"


def gpu_signs(argv, environ=None, dev_dir: str = "/dev") -> list:
    """What says this process was meant to run on a GPU: NVIDIA device files, a container
    runtime's or SLURM's GPU variables, a CUDA_VISIBLE_DEVICES naming devices, or a command line
    that asks for Transformer Engine. Each as a short phrase for the refusal."""
    import glob

    env = os.environ if environ is None else environ
    signs = [f"{p} exists" for p in sorted(glob.glob(os.path.join(dev_dir, "nvidia[0-9]*")))[:1]]
    nvidia = env.get("NVIDIA_VISIBLE_DEVICES", "")
    if nvidia and nvidia not in ("void", "none"):
        signs.append(f"NVIDIA_VISIBLE_DEVICES={nvidia}")
    for name in ("SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE"):
        if env.get(name, "") not in ("", "0"):
            signs.append(f"{name}={env[name]}")
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    if visible and visible != "-1":  # "" and -1 hide every GPU on purpose
        signs.append(f"CUDA_VISIBLE_DEVICES={visible}")
    if _explicit_transformer_engine(argv):
        signs.append("--transformer-impl transformer_engine")
    return signs


def refuse_cpu_fallback(argv, environ=None, dev_dir: str = "/dev") -> None:
    """Without CUDA, megaloop trains in its CPU development mode (gloo, local layers, the CPU
    shim). Where the node or the command says a GPU was meant (``gpu_signs``), that would be a
    cluster job training for hours on the host's cores: refused (ValueError, before any process
    group) with the cause, unless MEGALOOP_ALLOW_CPU=1 says the CPU run is meant. A machine
    without GPUs and a command that asks for none (the tests, the demo) set nothing."""
    env = os.environ if environ is None else environ
    if torch.cuda.is_available():
        return
    signs = gpu_signs(argv, env, dev_dir)
    if not signs or env.get(ALLOW_CPU_ENV) == "1":
        return
    if torch.version.cuda is None:
        why = f"this torch ({torch.__version__}) is a CPU-only build"
    else:
        why = (f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU: a "
               f"driver older than this CUDA needs, a container started without its GPUs, or a "
               f"CUDA_VISIBLE_DEVICES that names no device")
    raise ValueError(
        f"CUDA is not available but this run was meant for a GPU ({'; '.join(signs)}): {why}. "
        f"It would train on the CPU (the development mode). Fix the node's CUDA, or set "
        f"{ALLOW_CPU_ENV}=1 to train on the CPU on purpose")
