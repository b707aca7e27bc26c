"""Independent computations the tests compare megaloop against (written plainly, no log space)."""

from __future__ import annotations

import math
import re

import torch
from megatron.core import parallel_state


def reference_objective(losses, lambdas, mode="expected", beta=0.0, eps=0.0):
    """Per-token objective from step losses [T, N] and halting probabilities [T-1, N]."""
    T = losses.shape[0]
    assert lambdas.shape[0] == T - 1 and lambdas.shape[1:] == losses.shape[1:], \
        (lambdas.shape, losses.shape)
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


def _named_parameters(model):
    """(single-stage name, parameter): a pipeline stage's core layers renamed by their global
    index; the last stage's copy of a tied embedding (marked `shared`) left out, as the
    single-stage model has one such parameter."""
    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    for name, p in model.named_parameters():
        if getattr(p, "shared", False):
            continue
        name = name.replace("module.", "")
        m = re.match(r"core\.layers\.(\d+)\.(.*)", name)
        if m:
            name = f"core.layers.{inner.core.layers[int(m.group(1))].layer_number - 1}.{m.group(2)}"
        yield name, p


def gather_pp(local: dict) -> dict:
    """Union of every pipeline stage's tensors (each name lives on one stage)."""
    group = parallel_state.get_pipeline_model_parallel_group()
    if torch.distributed.get_world_size(group) == 1:
        return local
    parts = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(parts, local, group=group)
    out = {}
    for part in parts:
        for k, v in part.items():
            assert k not in out, f"{k} on two pipeline stages"
            out[k] = v
    return out


def full_grads(model) -> dict:
    """name -> full (TP-gathered, all stages) gradient, from .main_grad (megatron DDP) or .grad."""
    out = {}
    for name, p in _named_parameters(model):
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
        if g is None:
            continue
        out[name] = gather_tp(g.detach().clone(), p)
    return gather_pp(out)


def full_params(model) -> dict:
    return gather_pp({n: gather_tp(p.detach().clone(), p) for n, p in _named_parameters(model)})


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:  # a broadcast difference would compare the wrong elements
        assert a[k].shape == b[k].shape, (k, a[k].shape, b[k].shape)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def kl_uniform(p) -> float:
    T = len(p)
    return sum(x * math.log(x * T) for x in p if x > 0)


def lm_batch(vocab: int, seq: int, batch: int, seed: int = 0):
    """(token ids, position ids, labels) drawn from a private generator: the same on every rank
    and in every test process, without touching the global RNG streams."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    return ids, torch.arange(seq).expand(batch, seq), labels


def against_plain(model, plain, batch, new_params: dict):
    """A variant at initialisation against the plain model given the variant's shared weights:
    (max |objective difference|, {new parameter: max |gradient|} after backward of the mean)."""
    missing, _ = plain.load_state_dict(model.state_dict(), strict=False)
    assert not missing, missing
    ids, pos, labels = batch
    out = model(ids, pos, None, labels=labels)
    out.objective.mean().backward()
    ref = plain(ids, pos, None, labels=labels).objective.detach()
    grads = {n: p.grad.abs().max().item() for n, p in new_params.items()}
    return (out.objective.detach() - ref).abs().max().item(), grads


def embed_by_hand(model, ids, position_ids):
    """RoPE, the embedding e and h_0 (e through the prelude, if any), module by module."""
    rope = model.rotary_pos_emb(ids.size(1))
    e = model.embedding(input_ids=ids, position_ids=position_ids)
    h = e if model.prelude is None else model.prelude(hidden_states=e, attention_mask=None,
                                                      rotary_pos_emb=rope)
    return rope, e, h

