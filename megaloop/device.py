"""Where tensors for the model and for collectives go.

On a GPU machine that is the rank's GPU (``torch.cuda.current_device()``, set from LOCAL_RANK when
the process group starts). Under the CPU shim the same call answers the shim's stand-in for it, so
the move below runs on CPU too, where the shim's placement check can verify it. Without CUDA and
without the shim everything stays on the CPU.
"""

from __future__ import annotations

import torch


def current_device():
    """The accelerator device of this rank (its stand-in under the CPU shim, else "cpu")."""
    from megaloop import cpu_shim

    if torch.cuda.is_available() or cpu_shim.is_enabled():
        return torch.cuda.current_device()
    return "cpu"


def to_device(batch: dict) -> dict:
    """A batch dict with every tensor on ``current_device()``. ``non_blocking``: the copy from
    (pinned) host memory overlaps with the GPU work already queued."""
    device = current_device()
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}
