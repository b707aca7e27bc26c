"""A decoding step's host-built numbers on the device in one copy that does not block the host.

A decode step needs a few small host-built tensors on the device: the fed token ids, their
positions, the rows' cached lengths (for the padding mask), the pool slots to gather and to
write back, the sampling settings. Copied one by one from pageable memory, each copy waits for
the GPU to finish the work queued before it, so the host can never run ahead of the device,
which is exactly what bounds decoding at small batch. ``to_device`` packs tensors of one dtype
into one host buffer, pinned on a GPU, and copies it with ``non_blocking=True``: one transfer,
queued behind the GPU's work without waiting for it. The packed buffer must stay alive until
the copy has run; it is kept with the device tensor (``_host``), which the step holds.
"""

from __future__ import annotations

import torch

from megaloop import cpu_shim


def to_device(tensors: list, device, dtype=torch.long) -> list:
    """``tensors`` (host, any shapes, values exact in ``dtype``) on ``device`` in one copy,
    each with its own shape; marked as staged (megaloop/inference/paged_kv.py reads the mark)."""
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
    if cpu_shim.names_accelerator(device) and (torch.cuda.is_available()
                                               or cpu_shim.placement_check_enabled()):
        flat = flat.pin_memory()  # (under the CPU shim's check: marked pinned, for its counter)
    moved = flat.to(device, non_blocking=True)
    out, start = [], 0
    for t in tensors:
        part = moved[start:start + t.numel()].view(t.shape)
        part._megaloop_staged = True
        part._host = flat  # the copy reads it until it has run
        out.append(part)
        start += t.numel()
    return out
