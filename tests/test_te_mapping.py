"""Checkpoints move between Transformer Engine's layers and the local ones by tensor name, built
with TE's own modules (marker ``te_structure``: a venv with Transformer Engine; its modules are
constructed on CPU, no forward runs).

- TE -> local: a TE-spec model (TP=1 and TP=2 on gloo), every parameter drawn at random, saved
  with megaloop's checkpoint package, is loaded the way tools/serve.py loads (``--transformer-impl``
  left out: the local layers, which the batching engine accepts), and every tensor of the local
  model equals the TE tensor it comes from by a map written out here: TE's fused input norms
  (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) are the local spec's
  separate ``input_layernorm`` / ``pre_mlp_layernorm``, everything else keeps its name. For the
  default layout and for ``--timestep-conditioning adaln``, whose TE spec keeps its input norms
  separate (AdaLN scales their output).
- local -> TE: a checkpoint of the local layers (a run on CPU) loads into the TE spec, although it
  holds none of TE's extra state (FP8 scaling metadata).
- export-hf of a TE-spec checkpoint writes the tensors of the local checkpoint of the same
  weights; import-hf builds the TE spec where a GPU node would and fills it.

"A GPU node" is the answer of ``megaloop.model.config.use_transformer_engine`` there (every
backend but `local` is TE's); TE's modules are built under the ``gpu_node`` fixture below.
"""

import contextlib
import dataclasses
import io
import zlib

import pytest
import torch

from distributed import run_distributed, setup_parallel
from flags import llama_style

pytestmark = pytest.mark.te_structure
pytest.importorskip("transformer_engine.pytorch")

TABLE = 256
V = 200  # the null tokenizer's ids before EOD
# TE's fused input norms -> the local spec's separate norms (layer-local names); every other
# tensor has the same name in both.
FUSED = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
         "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
LAYOUTS = {"default": {}, "adaln": {"timestep_conditioning": "adaln"}}


def _te_to_local_name(name: str) -> str:
    for fused, separate in FUSED.items():
        if name.endswith("." + fused):
            return name[:-len(fused)] + separate
    return name


@pytest.fixture
def gpu_node(monkeypatch):
    """As on a GPU node with TE: the backend decision answers TE for every backend but `local`,
    and TE's modules are constructed (their base class asserts a CUDA device in ``__init__``:
    answered yes during that call only; nothing of TE runs). Forked ranks inherit both."""
    from transformer_engine.pytorch.module import base

    import megaloop.model.config

    original = base.TransformerEngineBaseModule.__init__

    def construct(self, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_available", lambda: True)
            original(self, *args, **kwargs)

    monkeypatch.setattr(base.TransformerEngineBaseModule, "__init__", construct)
    monkeypatch.setattr(megaloop.model.config, "use_transformer_engine",
                        lambda m: m.transformer_impl != "local")


def _configs(layout: str, impl: str):
    from megaloop.model.config import LoopConfig

    model_cfg = llama_style(num_layers=4, hidden_size=32, num_attention_heads=4,
                            max_position_embeddings=64, qk_layernorm=True, transformer_impl=impl)
    loop = LoopConfig(num_loops=2, num_prelude_layers=1, num_coda_layers=1, **LAYOUTS[layout])
    return model_cfg, loop


def _is_te(model) -> bool:
    """The looped layers are TE's (the coda's final norm is TE's on any machine with TE
    installed: megatron-core's TransformerBlock default)."""
    return any(type(m).__module__.startswith("transformer_engine")
               for m in model.core.modules())


def _randomize(model) -> dict:
    """Every parameter drawn from a seed of its name (and TP rank, for a TP shard), so that
    replicated tensors agree over ranks and swapped tensors differ; returns them by name."""
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    out = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            seed = zlib.crc32(name.encode()) + (
                1000 * rank if getattr(p, "tensor_model_parallel", False) else 0)
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
            out[name] = p.detach().clone()
    return out


def _save(model, model_cfg, loop, path):
    from megaloop.checkpoint.save import save_weights
    from megaloop.data.config import TokenizerConfig

    run = {"model": dataclasses.asdict(model_cfg), "loop": dataclasses.asdict(loop),
           "tokenizer": dataclasses.asdict(TokenizerConfig("NullTokenizer", None, V))}
    save_weights(path, 1, model, run_config=run)


def _params(model) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _te_to_local(rank, world, layout, path):
    """A TE-spec model saved, then loaded as tools/serve.py loads; (the TE parameters under
    local names, the loaded model's parameters, the announcement)."""
    from megaloop.inference.engine import EngineConfig, InferenceEngine
    from megaloop.inference.loading import check_transformer_impl, load_for_generation
    from megaloop.model.looped_gpt import build_model

    setup_parallel(world)
    model_cfg, loop = _configs(layout, "transformer_engine")
    te = build_model(model_cfg, loop, TABLE, tp_size=world)
    assert _is_te(te)
    want = {_te_to_local_name(k): v for k, v in _randomize(te).items()}
    _save(te, model_cfg, loop, path)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        local, _, _ = load_for_generation(path, world,
                                          transformer_impl=check_transformer_impl(None, True),
                                          purpose="serving")
    assert not _is_te(local)
    InferenceEngine(local, V, config=EngineConfig(max_sequence_length=32))  # accepted
    return want, _params(local), err.getvalue()


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_te_checkpoint_loads_into_the_local_layers(gpu_node, tmp_path, layout, world):
    ranks = run_distributed(_te_to_local, world, layout, str(tmp_path / "ckpt"), timeout=600)
    for want, got, _ in ranks:
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            assert torch.equal(got[name], value), name
    # The run config records the flag, not the layers its run built (local on a CPU machine).
    note = ("serving with --transformer-impl local: the checkpoint's run config says "
            "--transformer-impl transformer_engine, which builds Transformer Engine's layers on a "
            "GPU and the local ones on CPU (which its run built is not recorded); either's "
            "weights map onto local's by name")
    assert "".join(err for _, _, err in ranks).count(note) == 1  # (rank 0 says it)


def _local_to_te(rank, world, layout, path):
    """A checkpoint of the local layers (a run on CPU) read into the TE spec by the checkpoint
    package; (the local parameters, the TE ones under local names)."""
    from megaloop.checkpoint.load import load_weights
    from megaloop.model.looped_gpt import build_model

    setup_parallel(world)
    model_cfg, loop = _configs(layout, "local")
    local = build_model(model_cfg, loop, TABLE, tp_size=world)
    assert not _is_te(local)
    want = _randomize(local)
    _save(local, model_cfg, loop, path)
    te = build_model(dataclasses.replace(model_cfg, transformer_impl="transformer_engine"), loop,
                     TABLE, tp_size=world)
    assert _is_te(te)
    load_weights(path, te)
    return want, {_te_to_local_name(k): v for k, v in _params(te).items()}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_local_checkpoint_loads_into_the_te_layers(gpu_node, tmp_path, layout, world):
    """Fine-tuning or RL on a GPU from a checkpoint trained on CPU: the TE layers' extra state,
    which the checkpoint does not hold, does not stop the load."""
    for want, got in run_distributed(_local_to_te, world, layout, str(tmp_path / "ckpt"),
                                     timeout=600):
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            assert torch.equal(got[name], value), name


def _export(rank, world, path_te, path_local, out_te, out_local):
    """The same weights saved from the TE spec and from the local one, each exported."""
    from megaloop.convert.hf_export import export_hf
    from megaloop.model.looped_gpt import build_model

    setup_parallel(1)
    model_cfg, loop = _configs("default", "transformer_engine")
    te = build_model(model_cfg, loop, TABLE)
    assert _is_te(te)
    weights = {_te_to_local_name(k): v for k, v in _randomize(te).items()}
    _save(te, model_cfg, loop, path_te)
    local_cfg = dataclasses.replace(model_cfg, transformer_impl="local")
    local = build_model(local_cfg, loop, TABLE)
    params = dict(local.named_parameters())
    assert sorted(params) == sorted(weights)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
    _save(local, local_cfg, loop, path_local)
    export_hf(path_te, out_te)  # (the TE spec again, as on a GPU node)
    export_hf(path_local, out_local)


def _safetensors(folder: str) -> dict:
    import os

    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def test_export_of_a_te_checkpoint_equals_the_local_one(gpu_node, tmp_path):
    out_te, out_local = str(tmp_path / "hf_te"), str(tmp_path / "hf_local")
    run_distributed(_export, 1, str(tmp_path / "te"), str(tmp_path / "local"), out_te, out_local,
                    timeout=600)
    got, want = _safetensors(out_te), _safetensors(out_local)
    assert sorted(got) == sorted(want)
    assert any(".input_layernorm." in k for k in want)  # the fused norms were exported
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert open(f"{out_te}/config.json").read() == open(f"{out_local}/config.json").read()


def _llama_folder(folder: str) -> dict:
    """A tiny Llama checkpoint in Hugging Face's layout (GQA), every tensor random."""
    import json
    import os

    from safetensors.torch import save_file

    h, ffn, layers, heads, groups, d = 32, 64, 2, 4, 2, 8
    gen = torch.Generator().manual_seed(3)
    shapes = {"model.embed_tokens.weight": (TABLE, h), "model.norm.weight": (h,),
              "lm_head.weight": (TABLE, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (heads * d, h),
            p + "self_attn.k_proj.weight": (groups * d, h),
            p + "self_attn.v_proj.weight": (groups * d, h),
            p + "self_attn.o_proj.weight": (h, heads * d),
            p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
            p + "mlp.down_proj.weight": (h, ffn)})
    tensors = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    os.makedirs(folder)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "vocab_size": TABLE, "hidden_size": h, "intermediate_size": ffn,
                   "num_hidden_layers": layers, "num_attention_heads": heads,
                   "num_key_value_heads": groups, "max_position_embeddings": 64,
                   "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
                   "tie_word_embeddings": False}, f)
    return tensors


def _import(rank, world, hf_dir, save):
    """import-hf as on a GPU node (the TE spec: the converted config keeps Megatron-LM's
    default backend), then the checkpoint loaded into the local layers; (whether the
    checkpoint holds TE's extra state, the loaded parameters, the Llama tensors by local name)."""
    from torch.distributed.checkpoint import FileSystemReader

    from megaloop.checkpoint.tracker import checkpoint_dir
    from megaloop.convert.hf_import import import_hf
    from megaloop.inference.loading import load_for_generation
    from megaloop.model.config import LoopConfig

    setup_parallel(1)
    import_hf(hf_dir, save, LoopConfig(num_loops=2, exit_loss="last"), progress=False)
    keys = FileSystemReader(checkpoint_dir(save, 0)).read_metadata().state_dict_metadata
    te_saved = any(k.endswith("._extra_state/shard_0_1") for k in keys)
    local, _, _ = load_for_generation(save, transformer_impl="local")
    return te_saved, _params(local)


def test_import_hf_into_the_te_layers(gpu_node, tmp_path):
    hf = _llama_folder(str(tmp_path / "llama"))
    te_saved, got = run_distributed(_import, 1, str(tmp_path / "llama"), str(tmp_path / "ckpt"),
                                    timeout=600)[0]
    assert te_saved  # the TE spec was filled and saved
    # Hugging Face's names (the norms and linears that map one to one; the fused q/k/v and
    # gate/up are compared by their parts).
    for i in range(2):
        ours, theirs = f"core.layers.{i}.", f"model.layers.{i}."
        assert torch.equal(got[ours + "input_layernorm.weight"],
                           hf[theirs + "input_layernorm.weight"])
        assert torch.equal(got[ours + "pre_mlp_layernorm.weight"],
                           hf[theirs + "post_attention_layernorm.weight"])
        assert torch.equal(got[ours + "self_attention.linear_proj.weight"],
                           hf[theirs + "self_attn.o_proj.weight"])
        assert torch.equal(got[ours + "mlp.linear_fc1.weight"],
                           torch.cat([hf[theirs + "mlp.gate_proj.weight"],
                                      hf[theirs + "mlp.up_proj.weight"]]))
        qkv = got[ours + "self_attention.linear_qkv.weight"].reshape(2, 4, 8, 32)
        # per KV group: its 2 query heads, its key head, its value head
        assert torch.equal(qkv[:, :2].reshape(-1, 32), hf[theirs + "self_attn.q_proj.weight"])
        assert torch.equal(qkv[:, 2].reshape(-1, 32), hf[theirs + "self_attn.k_proj.weight"])
        assert torch.equal(qkv[:, 3].reshape(-1, 32), hf[theirs + "self_attn.v_proj.weight"])
    assert torch.equal(got["embedding.word_embeddings.weight"], hf["model.embed_tokens.weight"])
    assert torch.equal(got["step_norm.weight"], hf["model.norm.weight"])
    assert torch.equal(got["output_layer.weight"], hf["lm_head.weight"])
