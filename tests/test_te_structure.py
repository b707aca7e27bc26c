"""The looped model built with Transformer Engine's layers, executed on CPU up to TE's kernels
(marker ``te_structure``: the TE venv, bash tools/setup_te_venv.sh; skipped elsewhere).

TE's modules are really constructed (megaloop.te_structure.te_modules_constructible), sharded,
saved and loaded; no forward runs (TE's kernels need a driver). For every variant and layout, at
TP=1 and TP=2 on gloo:

- the core's layers are TE's (fused-norm linears, TE attention), and every parameter equals the
  local spec's parameter of the same name (TE's fused input norms under the local names) drawn
  from the same seed: megaloop's sharded initialisation reaches TE's linears, shard for shard;
- the sharded state dict has the local spec's tensor keys and shapes (one checkpoint format);
- saved with megaloop's checkpoint package, it loads into a TE model drawn from another seed and
  every parameter comes back, with TE's load hook for ``core_attention._extra_state`` and with it
  removed (TE says the hook will be phased out; megaloop.checkpoint.load must not need it);
- FP8: the TransformerConfig a GPU node would build for every --fp8-format and --fp8-recipe,
  TE's recipe object and autocast context made from it (not entered: that asks the GPU), and
  the looped model built with it.

One test needs no TE and runs in the main venv too: the load's tolerance is for missing
``_extra_state`` only.
"""

import dataclasses

import pytest
import torch

from distributed import run_distributed, setup_parallel
from flags import llama_style

TABLE = 128
V = 100
# TE's fused input norms -> the local spec's separate norms (LayerNorm has a bias too).
FUSED = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
         "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
         "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
         "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}

# name -> (ModelConfig overrides, LoopConfig overrides): every norm scheme, step norm, injection,
# conditioning form, LoRA, SpiralFormer topology and P + K x T + C layout the model builds.
VARIANTS = {
    "ouro": ({}, {}),
    "pre": ({"norm_scheme": "pre"}, {}),
    "post": ({"norm_scheme": "post"}, {}),
    "sandwich": ({"norm_scheme": "sandwich"}, {}),
    "magic": ({"norm_scheme": "magic"}, {}),
    "dense": ({"norm_scheme": "pre"}, {"num_loops": 1}),
    "prelude+coda+untied+gqa": ({"untie_embeddings_and_output_weights": True,
                                 "num_query_groups": 2},
                                {"num_prelude_layers": 1, "num_coda_layers": 1}),
    "megatron-defaults": ({"swiglu": False, "normalization": "LayerNorm",
                           "disable_bias_linear": False, "position_embedding_type":
                           "learned_absolute", "qk_layernorm": False}, {}),
    "step-norm-frms-readout": ({}, {"step_norm": "frms", "step_norm_placement": "readout"}),
    "step-norm-identity+last": ({}, {"step_norm": "identity", "exit_loss": "last"}),
    "scalar-mix-prelude": ({}, {"num_prelude_layers": 1, "input_injection": "scalar-mix",
                                "injection_source": "prelude"}),
    "scalar": ({}, {"input_injection": "scalar"}),
    "channel-wise": ({}, {"input_injection": "channel-wise"}),
    "residual-channel-wise": ({}, {"input_injection": "residual-channel-wise"}),
    "dense-injection+history-dense": ({}, {"input_injection": "dense",
                                           "history_injection": "dense"}),
    "concat-linear+history-scalar": ({}, {"input_injection": "concat-linear",
                                          "history_injection": "scalar"}),
    "history-channel-wise": ({}, {"history_injection": "channel-wise"}),
    "loop-gating": ({}, {"timestep_conditioning": "loop-gating"}),
    "branch-gating": ({}, {"timestep_conditioning": "branch-gating"}),
    "adaln": ({}, {"timestep_conditioning": "adaln"}),
    "adaln+post": ({"norm_scheme": "post"}, {"timestep_conditioning": "adaln"}),
    "lora": ({}, {"lora_rank": 2}),
    "parcae": ({"norm_scheme": "pre", "swiglu": False, "squared_relu": True,
                "qk_layernorm": True, "qk_layernorm_scale_free": True, "value_embeddings": True,
                "rotary_interleaved": True},
               {"num_prelude_layers": 1, "num_coda_layers": 1, "input_injection": "parcae",
                "injection_source": "prelude", "injection_source_norm": True,
                "state_init": "noise", "readout_projection": True, "step_norm": "identity",
                "step_norm_placement": "readout", "exit_loss": "last"}),
    "spiral-anchor": ({}, {"loop_resolutions": "1/4,1/2,1", "loop_topology": "anchor"}),
    "spiral-mesh": ({}, {"loop_resolutions": "coarse-to-fine", "loop_topology": "mesh",
                         "num_prelude_layers": 1, "num_coda_layers": 1}),
}
# Sequence parallelism needs TE's norms (the local spec refuses it): TP=2 only.
SEQUENCE_PARALLEL = ("ouro", "pre", "adaln")


@pytest.fixture
def te_node(monkeypatch):
    """As on a GPU node: megaloop resolves TE's layer spec for every backend but `local`, and
    TE's modules can be constructed (during their base __init__ only). Forked ranks inherit."""
    import megaloop.model.config
    from megaloop.te_structure import te_modules_constructible

    monkeypatch.setattr(megaloop.model.config, "use_transformer_engine",
                        lambda m: m.transformer_impl != "local")
    with te_modules_constructible():
        yield


def _configs(name, impl):
    from megaloop.model.config import LoopConfig

    model_kw, loop_kw = VARIANTS[name]
    model_cfg = llama_style(**{"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
                               "max_position_embeddings": 64, "qk_layernorm": True,
                               "transformer_impl": impl, **model_kw})
    loop = LoopConfig(**{"num_loops": 3, **loop_kw})
    loop.validate(model_cfg.num_layers)
    return model_cfg, loop


def _build(name, impl, seed, world, sequence_parallel=False):
    from megatron.core import parallel_state

    from megaloop.model.looped_gpt import build_model
    from megaloop.parallel.initialize import set_seed

    if parallel_state.model_parallel_is_initialized():
        set_seed(seed)
    else:
        setup_parallel(world, seed=seed)
    model_cfg, loop = _configs(name, impl)
    return build_model(model_cfg, loop, V, tp_size=world,
                       sequence_parallel=sequence_parallel), model_cfg, loop


def _local_name(name):
    for fused, separate in FUSED.items():
        if name.endswith("." + fused):
            return name[:-len(fused)] + separate
    return name


def _check_te_layers(model):
    """Every core layer's linears and attention are TE's (not a silently local model)."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    assert layers
    for layer in layers:
        assert isinstance(layer.self_attention.core_attention, TEDotProductAttention)
        for linear in (layer.self_attention.linear_qkv, layer.self_attention.linear_proj,
                       layer.mlp.linear_fc1, layer.mlp.linear_fc2):
            # (LoRA's adapter-carrying linears subclass megatron-core's TE wrappers)
            mro = [c.__module__ for c in type(linear).__mro__]
            assert "megatron.core.extensions.transformer_engine" in mro, type(linear)
            assert any(m.startswith("transformer_engine.") for m in mro), type(linear)


def _tensors(model):
    """{key: (global shape, this rank's data)} of the model's sharded state dict's tensors."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {t.key: (tuple(t.global_shape), t.data.detach().clone())
            for t in nested_values(model.sharded_state_dict()) if isinstance(t, ShardedTensor)}


def _params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _run_config(model_cfg, loop):
    from megaloop.data.config import TokenizerConfig

    return {"model": dataclasses.asdict(model_cfg), "loop": dataclasses.asdict(loop),
            "tokenizer": dataclasses.asdict(TokenizerConfig("NullTokenizer", None, V))}


def remove_te_attention_load_hook(model) -> int:
    """Remove TE DotProductAttention's load hook that drops a missing
    ``core_attention._extra_state`` (as a TE without it would be); returns how many."""
    from transformer_engine.pytorch import DotProductAttention

    removed = 0
    for module in model.modules():
        if isinstance(module, DotProductAttention):
            hooks = module._load_state_dict_post_hooks
            for key in [k for k, h in hooks.items()
                        if getattr(h, "__name__", "") == "remove_extra_states_check"]:
                del hooks[key]
                removed += 1
    return removed


def _variants_on_ranks(rank, world, names, folder):
    """For each variant (name, sequence parallel): TE layers, the local spec's weights and keys,
    and a save / load round trip with and without TE's attention load hook."""
    from megaloop.checkpoint.load import load_weights
    from megaloop.checkpoint.save import save_weights

    failures = []
    for name, sp in names:
        te, model_cfg, loop = _build(name, "transformer_engine", 7, world, sp)
        _check_te_layers(te)
        local = _build(name, "local", 7, world)[0]
        # Same seed, same TP: the same weights, entry for entry (sharded init through TE).
        want = {_local_name(k): v for k, v in _params(te).items()}
        got = _params(local)
        assert sorted(want) == sorted(got), (name, set(want) ^ set(got))
        for key, value in want.items():
            assert torch.equal(value, got[key]), (name, key)
        te_keys, local_keys = _tensors(te), _tensors(local)
        assert {k: s for k, (s, _) in te_keys.items()} == \
            {k: s for k, (s, _) in local_keys.items()}, name
        for key, (_, data) in te_keys.items():
            assert torch.equal(data, local_keys[key][1]), (name, key)
        folder_v = f"{folder}/{name}{'-sp' if sp else ''}"
        save_weights(folder_v, 1, te, run_config=_run_config(model_cfg, loop))
        saved = _params(te)
        for hook in (True, False):
            other = _build(name, "transformer_engine", 8, world, sp)[0]
            assert any(not torch.equal(p, saved[n]) for n, p in other.named_parameters())
            if not hook:  # one hook per TE attention, all gone
                attentions = [m for m in other.modules()
                              if type(m).__name__ == "TEDotProductAttention"]
                assert remove_te_attention_load_hook(other) == len(attentions) > 0, name
            try:
                load_weights(folder_v, other)
            except Exception as exc:  # collect every variant's failure, not just the first
                failures.append(f"{name} (sp={sp}, TE load hook {'on' if hook else 'off'}): "
                                f"{type(exc).__name__}: {str(exc)[:300]}")
                continue
            for n, p in other.named_parameters():
                assert torch.equal(p, saved[n]), (name, hook, n)
    return failures


@pytest.mark.te_structure
@pytest.mark.parametrize("world", [1, 2])
def test_every_variant_builds_saves_and_loads_with_te_layers(te_node, tmp_path, world):
    names = [(name, False) for name in VARIANTS]
    if world == 2:
        names += [(name, True) for name in SEQUENCE_PARALLEL]
    failures = run_distributed(_variants_on_ranks, world, names, str(tmp_path), timeout=900)
    assert failures == [[]] * world, "\n".join(failures[0])


class _WithExtraState(torch.nn.Module):
    """A module with extra state, as TE's modules have (FP8 metadata)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.extra = None

    def get_extra_state(self):
        return {"amax": 1.0}

    def set_extra_state(self, state):
        self.extra = state


def test_load_forgives_missing_extra_state_only():
    """megaloop.checkpoint.load.load_module_state: a state without ``_extra_state`` loads (a
    strict torch load refuses it); a missing weight or an unexpected key fails as strict does."""
    from megaloop.checkpoint.load import load_module_state

    source, target = torch.nn.Sequential(_WithExtraState()), torch.nn.Sequential(_WithExtraState())
    state = source.state_dict()
    assert "0._extra_state" in state
    del state["0._extra_state"]
    with pytest.raises(RuntimeError, match="_extra_state"):
        torch.nn.Sequential(_WithExtraState()).load_state_dict(state, strict=True)
    load_module_state(target, state)
    assert torch.equal(target[0].linear.weight, source[0].linear.weight)
    assert target[0].extra is None  # nothing was set: TE then keeps its fresh metadata
    weightless = {k: v for k, v in state.items() if k != "0.linear.weight"}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "0.linear.weight"'):
        load_module_state(target, weightless)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "0.stray"'):
        load_module_state(target, {**state, "0.stray": torch.zeros(1)})


FP8_RECIPES = {"delayed": "DelayedScaling", "tensorwise": "Float8CurrentScaling",
               "blockwise": "Float8BlockScaling", "mxfp8": "MXFP8BlockScaling"}


def _fp8_on_rank(rank, world, fmt, recipe):
    from megatron.core.fp8_utils import get_fp8_context, get_fp8_recipe
    from transformer_engine.common.recipe import Format

    from megaloop.model.config import padded_vocab_size, transformer_config
    from megaloop.model.looped_gpt import LoopedGPTModel

    setup_parallel(world)
    model_cfg, loop = _configs("ouro", "transformer_engine")
    model_cfg = dataclasses.replace(model_cfg, fp8_format=fmt, fp8_recipe=recipe, fp8_margin=1,
                                    fp8_amax_history_len=16, fp8_amax_compute_algo="max")
    # The config of a GPU node with TE (cuda=True, te=True), built on this CPU machine.
    cfg = transformer_config(model_cfg, model_cfg.num_layers, tp_size=world, cuda=True, te=True)
    assert (cfg.fp8, cfg.fp8_recipe, cfg.fp8_margin, cfg.fp8_amax_history_len,
            cfg.fp8_amax_compute_algo) == (fmt, recipe, 1, 16, "max")
    made = get_fp8_recipe(cfg)
    assert type(made).__name__ == FP8_RECIPES[recipe] or (
        recipe == "delayed" and type(made).__bases__[0].__name__ == "DelayedScaling"), made
    assert made.fp8_format == {"e4m3": Format.E4M3, "hybrid": Format.HYBRID}[fmt]
    if recipe == "delayed":
        assert (made.margin, made.amax_history_len, made.amax_compute_algo) == (1, 16, "max")
    assert get_fp8_context(cfg) is not None  # fp8_autocast, made but not entered
    model = LoopedGPTModel(cfg, model_cfg, loop, padded_vocab_size(V, 128, world), use_te=True)
    _check_te_layers(model)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.te_structure
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_fp8_configuration_and_recipes_build(te_node, fmt):
    for recipe in FP8_RECIPES:
        sizes = run_distributed(_fp8_on_rank, 2, fmt, recipe)
        assert sizes[0] == sizes[1] > 0


def _setup_script_in(tmp_path, **env):
    """tools/setup_te_venv.sh run from a copy of the repository's tools/ folder in ``tmp_path``
    (no .venv-te there), with ``env`` added."""
    import os
    import shutil
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "tools").mkdir()
    shutil.copy(os.path.join(root, "tools", "setup_te_venv.sh"), tmp_path / "tools")
    return subprocess.run(["bash", str(tmp_path / "tools" / "setup_te_venv.sh")],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=60)


def test_te_setup_says_unavailable_without_the_binding_wheel(tmp_path):
    """.ci/run skips the te_structure tests on exit 3 only, so a machine without the wheel must
    get 3 and one line naming what is missing, before any venv is made."""
    missing = tmp_path / "nowhere" / "transformer_engine_torch.whl"
    proc = _setup_script_in(tmp_path, MEGALOOP_TE_TORCH_WHEEL=str(missing))
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"setup_te_venv: unavailable: TE PyTorch binding wheel not found at {missing} "
        "(set MEGALOOP_TE_TORCH_WHEEL)"]
    assert not (tmp_path / ".venv-te").exists()


def test_te_setup_refuses_a_wheel_with_another_checksum(tmp_path):
    """A different binding (another build, a truncated copy) is a failure, not a skip."""
    wheel = tmp_path / "transformer_engine_torch-2.11.0-cp311-cp311-linux_x86_64.whl"
    wheel.write_bytes(b"not the wheel")
    proc = _setup_script_in(tmp_path, MEGALOOP_TE_TORCH_WHEEL=str(wheel))
    assert proc.returncode == 4, proc.stderr
    assert "expected c976acc6fb7d39d813b85031c946a3c9d947722181699ad67723d7a771dc2e46" in proc.stderr
    assert not (tmp_path / ".venv-te").exists()
