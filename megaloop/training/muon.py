"""Muon for the hidden matrices, AdamW for everything else ("What Makes Recurrence Effective in
Looped Language Models?" (arXiv 2609.36636), section 2 / App. D.1).

megatron-core 0.16.1 ships a Muon (``megatron.core.optimizer.muon.get_megatron_muon_optimizer``)
but its update rule lives in the separate ``emerging_optimizers`` package, whose releases need
Python >= 3.12; megaloop runs on 3.11, so that import fails and megatron-core refuses Muon. What
megaloop adds is therefore only the update rule, ``Muon`` below (~60 lines); everything around it
is megatron-core's and is composed the way its own ``get_megatron_muon_optimizer`` does it:
``_get_param_groups`` (weight-decay groups, LR fields for ``OptimizerParamScheduler``),
``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params`` (``main_grad`` -> ``grad``, fp32 master
weights under bf16), ``get_megatron_optimizer`` for the AdamW part, and ``ChainedOptimizer``
(one global grad norm and clipping over both parts, one ``sharded_state_dict`` for checkpoints).

Tensor parallelism: Muon orthogonalises the *whole* matrix, and a TP shard is not the matrix.
megaloop all-gathers the shards of the momentum-combined update over the TP group, runs
Newton-Schulz on the full matrix on every TP rank (duplicated compute, as megatron-core's
``duplicated`` mode), and keeps its own slice. Shards are concatenated along ``partition_dim``
in rank order; where megatron interleaves (SwiGLU's [gate; up], grouped QKV) that is a row
permutation of the TP=1 matrix, and Newton-Schulz commutes with row and column permutations
(``NS(P G Q) = P NS(G) Q``), so the slice kept is exactly the TP=1 result for those rows.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

# Keller Jordan's quintic Newton-Schulz coefficients: they push every singular value of the
# (Frobenius-normalised) input into roughly [0.7, 1.2] in 5 steps rather than converging exactly.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximate U V^T of G = U S V^T (the nearest semi-orthogonal matrix), in fp32."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    transposed = x.size(0) > x.size(1)
    if transposed:  # iterate on the wide orientation: X X^T is the smaller Gram matrix
        x = x.mT
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if transposed else x


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """Megatron-LM's --muon-scale-mode values: `spectral` sqrt(max(rows, cols)), `unit_rms_norm`
    sqrt(rows / cols), `shape_scaling` (Jordan et al. 2024) sqrt(max(1, rows / cols)); megaloop's
    `rms-match` (Liu et al. 2025, the Muon of What Makes Recurrence Effective) 0.2
    sqrt(max(rows, cols)) gives the update the RMS of an AdamW update, so AdamW's LR and weight
    decay carry over."""
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    if mode == "rms-match":
        return 0.2 * max(rows, cols) ** 0.5
    raise ValueError(f"unknown --muon-scale-mode {mode!r}")


def _full_matrix(t: torch.Tensor, param, group) -> tuple[torch.Tensor, int]:
    """All-gather a TP shard into the full matrix; returns (matrix, partition dim or -1)."""
    if not getattr(param, "tensor_model_parallel", False) or group is None or \
            torch.distributed.get_world_size(group) == 1:
        return t, -1
    parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, param.partition_dim), param.partition_dim


class Muon(torch.optim.Optimizer):
    """Momentum (Nesterov) -> Newton-Schulz orthogonalisation of the full matrix -> scaled step,
    with decoupled weight decay. Parameters must be 2-D; group keys `lr` and `weight_decay`
    follow megatron-core's param groups so ``OptimizerParamScheduler`` drives them."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.0,
                 momentum: float = 0.9, nesterov: bool = False, ns_steps: int = 5,
                 scale_mode: str = "spectral", extra_scale_factor: float = 1.0):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, scale_mode=scale_mode,
                        extra_scale_factor=extra_scale_factor)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        group_tp = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
        for group in self.param_groups:
            beta = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dim() != 2:
                    raise ValueError(f"Muon got a {p.dim()}-D parameter of shape "
                                     f"{tuple(p.shape)}; it only updates 2-D matrices")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                grad = p.grad.to(buf.dtype)
                buf.lerp_(grad, 1 - beta)  # buf = beta buf + (1 - beta) g
                update = grad.lerp(buf, beta) if group["nesterov"] else buf
                full, dim = _full_matrix(update, p, group_tp)
                ortho = newton_schulz(full, group["ns_steps"])
                ortho = ortho * (scale_factor(full.size(0), full.size(1), group["scale_mode"])
                                 # a group loaded from an older checkpoint has no factor
                                 * group.get("extra_scale_factor", 1.0))
                if dim >= 0:
                    rank = torch.distributed.get_rank(group_tp)
                    ortho = ortho.chunk(torch.distributed.get_world_size(group_tp), dim)[rank]
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(ortho.to(p.dtype), alpha=-group["lr"])


def is_muon_param(name: str, param: torch.nn.Parameter) -> bool:
    """Hidden matrices: 2-D, both sides > 1 (the exit gate's [1, h] row is a vector), and not
    the embedding or the LM head."""
    return (param.dim() == 2 and min(param.shape) > 1
            and not getattr(param, "is_embedding_or_output_parameter", False)
            and "embedding" not in name and "output_layer" not in name)


def get_muon_optimizer(config, model_chunks: list, *, momentum: float, nesterov: bool,
                       ns_steps: int, scale_mode: str, extra_scale_factor: float = 1.0,
                       config_overrides=None):
    """megatron-core ``ChainedOptimizer`` of [Muon on the hidden matrices, megatron AdamW on
    the rest], built like megatron-core's ``get_megatron_muon_optimizer``.
    ``config_overrides``: the AdamW part's parameter groups (megatron-core's ParamKey overrides;
    the Muon part holds no embedding or output layer, so no decoupled LR)."""
    from megatron.core.optimizer import ChainedOptimizer, _get_param_groups, get_megatron_optimizer
    from megatron.core.optimizer.optimizer import (Float16OptimizerWithFloat16Params,
                                                   FP32Optimizer)

    # (With --use-distributed-optimizer it is refused by RunConfig.validate.)
    assert not config.use_distributed_optimizer, "Muon needs whole matrices"
    matrices, others = [], []
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if p.requires_grad:
                (matrices if is_muon_param(name, p) else others).append(p)

    def init_state(opt, config=None):  # checkpoint loading builds the state before filling it
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    opt.state[p]["momentum_buffer"] = torch.zeros_like(p.data)

    # megatron-core's idiom: param groups come from requires_grad, so hide one part at a time.
    try:
        for p in others:
            p.requires_grad = False
        groups = _get_param_groups(model_chunks, config, None)
        muon = Muon(groups, lr=config.lr, weight_decay=config.weight_decay, momentum=momentum,
                    nesterov=nesterov, ns_steps=ns_steps, scale_mode=scale_mode,
                    extra_scale_factor=extra_scale_factor)
        muon = Float16OptimizerWithFloat16Params(muon, config, None, init_state) if config.bf16 \
            else FP32Optimizer(muon, config, init_state)
        for p in others:
            p.requires_grad = True
        for p in matrices:
            p.requires_grad = False
        adam = get_megatron_optimizer(config, model_chunks, config_overrides=config_overrides)
    finally:
        for p in others + matrices:
            p.requires_grad = True
    return ChainedOptimizer([muon] + list(getattr(adam, "chained_optimizers", [adam])))
