"""Independent computations the tests compare megaloop against (written plainly, no log space)."""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state


def reference_objective(losses, lambdas, mode="expected", beta=0.0, eps=0.0):
    """Per-token objective from step losses [T, N] and halting probabilities [T-1, N]."""
    T = losses.shape[0]
    p, survival = [], torch.ones_like(losses[0])
    for t in range(T - 1):
        p.append(survival * lambdas[t])
        survival = survival * (1 - lambdas[t])
    p.append(survival)
    p = torch.stack(p)
    kl = (p * torch.log(p * T)).sum(0)
    if mode == "last":
        return losses[-1], p
    expected = (p * losses).sum(0)
    if mode == "smoothed":
        expected = (1 - eps) * expected + eps * losses.mean(0)
    return expected + beta * kl, p


def gather_tp(tensor: torch.Tensor, param) -> torch.Tensor:
    """Reassemble a tensor-parallel shard (honouring megatron's partition_dim/stride)."""
    if not getattr(param, "tensor_model_parallel", False):
        return tensor
    group = parallel_state.get_tensor_model_parallel_group()
    world = torch.distributed.get_world_size(group)
    if world == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world)]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    if stride == 1:
        return torch.cat(parts, dim)
    chunks = [p.chunk(stride, dim) for p in parts]
    return torch.cat([chunks[r][s] for s in range(stride) for r in range(world)], dim)


def full_grads(model) -> dict:
    """name -> full (TP-gathered) gradient, from .main_grad (megatron DDP) or .grad."""
    out = {}
    for name, p in model.named_parameters():
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
        if g is None:
            continue
        out[name.replace("module.", "")] = gather_tp(g.detach().clone(), p)
    return out


def full_params(model) -> dict:
    return {n.replace("module.", ""): gather_tp(p.detach().clone(), p)
            for n, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def kl_uniform(p) -> float:
    T = len(p)
    return sum(x * math.log(x * T) for x in p if x > 0)
