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
backend but `local` is TE's); TE's modules are built with ``te_construction`` below.
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
    # (rank 0 only)
    assert "".join(err for _, _, err in ranks).count("serving with --transformer-impl local: the checkpoint was saved with "
                     "transformer_engine; weights map by name") == 1
