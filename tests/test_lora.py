"""Stepwise LoRA: identity at init, gradients reach every adapter, TP=2 == TP=1, recompute-safe."""

import torch

from distributed import run_distributed, setup_parallel
from reference import full_grads, full_params, lm_batch, max_diff
from flags import llama_style

VOCAB, SEQ, BATCH, T = 256, 16, 2, 3


def _model(rank_r, recompute=None, seed=11, swiglu=True):
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model
    from megaloop.parallel.initialize import set_seed

    set_seed(seed)
    model_cfg = llama_style(num_layers=2, hidden_size=32, num_attention_heads=4,
                            num_query_groups=2, max_position_embeddings=SEQ, swiglu=swiglu)
    loop = LoopConfig(num_loops=T, lora_rank=rank_r, lora_alpha=8.0,
                      input_injection="scalar-mix")
    return build_model(model_cfg, loop, VOCAB, tp_size=torch.distributed.get_world_size(),
                       recompute=recompute)


def _loss(model):
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    return model(ids, pos, None, labels=labels).objective.mean()


def _lora_names(model):
    return [n for n, _ in model.named_parameters() if ".lora_" in n]


def _identity_at_init(rank, world):
    setup_parallel(world, 11)
    plain = _model(0)
    with_lora = _model(4)
    base = {k: v for k, v in full_params(with_lora).items() if ".lora_" not in k}
    weights_equal = max_diff(base, full_params(plain)) == 0.0
    return weights_equal, (_loss(plain) - _loss(with_lora)).abs().item()


def test_lora_starts_as_the_model_without_it():
    for weights_equal, diff in run_distributed(_identity_at_init, 2):
        assert weights_equal  # building the adapters does not shift the base weights' RNG
        assert diff == 0.0, diff


def _built_from_the_spec(rank, world):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    setup_parallel(world, 11)
    model = _model(4)
    hooked = [n for n, m in model.core.named_modules() if m._forward_hooks]
    layer = model.core.layers[0]
    kinds = {name: (type(m).__name__, isinstance(m, base)) for name, m, base in (
        ("qkv", layer.self_attention.linear_qkv, ColumnParallelLinear),
        ("proj", layer.self_attention.linear_proj, RowParallelLinear),
        ("fc1", layer.mlp.linear_fc1, ColumnParallelLinear),
        ("fc2", layer.mlp.linear_fc2, RowParallelLinear))}
    return hooked, kinds, type(model.output_layer).__name__


def test_lora_adapters_are_built_from_the_layer_spec():
    # The adapters live in subclasses of the spec's linear classes: no forward hook anywhere in
    # the core, and the head (outside the core) keeps megatron-core's plain class.
    hooked, kinds, head = run_distributed(_built_from_the_spec, 1)[0]
    assert hooked == [], hooked
    assert kinds == {"qkv": ("LoRAColumnParallelLinear", True),
                     "proj": ("LoRARowParallelLinear", True),
                     "fc1": ("LoRAColumnParallelLinear", True),
                     "fc2": ("LoRARowParallelLinear", True)}, kinds
    assert head == "ColumnParallelLinear"


def _grads_reach_every_adapter(rank, world):
    setup_parallel(world, 11)
    model = _model(4)
    names = _lora_names(model)
    # 2 layers x 4 linears x T steps x (A, B)
    assert len(names) == 2 * 4 * T * 2, names
    params = dict(model.named_parameters())
    _loss(model).backward()
    first = {n: params[n].grad.abs().max().item() for n in names}
    with torch.no_grad():  # one plain SGD step: B_t becomes non-zero
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    model.zero_grad()
    _loss(model).backward()
    second = {n: params[n].grad.abs().max().item() for n in names}
    return first, second


def test_every_adapter_gets_gradient():
    first, second = run_distributed(_grads_reach_every_adapter, 1)[0]
    for name, g in first.items():
        if ".lora_B." in name:
            assert g > 0, name  # every step's B learns from the first step
        else:
            assert g == 0.0, name  # dL/dA = B^T (...) = 0 while B = 0
    for name, g in second.items():
        assert g > 0, name  # after one step B != 0, so A learns too


def _two_steps(rank, world, recompute, swiglu=True):
    setup_parallel(world, 11)
    model = _model(4, recompute, swiglu=swiglu)
    _loss(model).backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    model.zero_grad()
    loss = _loss(model)
    loss.backward()
    return loss.item(), full_grads(model)


def test_lora_tp2_equals_tp1():
    (l1, g1), = run_distributed(_two_steps, 1, None)
    for l2, g2 in run_distributed(_two_steps, 2, None):
        assert abs(l1 - l2) < 1e-5, (l1, l2)
        assert g1.keys() == g2.keys()
        assert any(".linear_fc1.lora_B.2" in k for k in g1)
        for k in g1:
            assert torch.allclose(g1[k], g2[k], atol=1e-5, rtol=1e-4), k


def test_lora_tp2_equals_tp1_gelu_mlp():
    (l1, g1), = run_distributed(_two_steps, 1, None, False)
    for l2, g2 in run_distributed(_two_steps, 2, None, False):
        assert abs(l1 - l2) < 1e-5, (l1, l2)
        for k in g1:
            assert torch.allclose(g1[k], g2[k], atol=1e-5, rtol=1e-4), k


def test_lora_full_recompute_matches():
    # Recomputation re-runs the core during backward, after the forward has moved on to the last
    # step: each step must still recompute with its own adapters.
    recompute = dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1)
    (l0, g0), = run_distributed(_two_steps, 1, None)
    (l1, g1), = run_distributed(_two_steps, 1, recompute)
    assert abs(l0 - l1) < 1e-6
    assert max_diff(g0, g1) < 1e-6


def _save_trained(rank, world, path):
    from megaloop.training.checkpointing import save_checkpoint

    setup_parallel(world, 11)
    model = _model(4)
    _loss(model).backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    save_checkpoint(path, 1, model, run_config={})
    return full_params(model)


def _load(rank, world, path):
    from megaloop.training.checkpointing import load_checkpoint

    setup_parallel(world, 11)
    model = _model(4, seed=99)  # other initial weights: everything must come from the file
    load_checkpoint(path, model, load_optim=False, load_rng=False)
    return full_params(model)


def test_lora_checkpoint_reshards_tp2_to_tp1(tmp_path):
    saved = run_distributed(_save_trained, 2, str(tmp_path))[0]
    loaded, = run_distributed(_load, 1, str(tmp_path))
    assert any(".linear_fc1.lora_B.0" in k for k in saved)
    assert max_diff(saved, loaded) == 0.0
