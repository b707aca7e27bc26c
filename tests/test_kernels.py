"""Fusions, attention backend and FP8 on CPU: the flag -> TransformerConfig translation for a GPU
and a CPU machine and for both layer specs (megaloop.model.config.kernel_settings is pure, so a
GPU's config is checked here), every refused combination with its fix, and the call pattern of
Transformer Engine's ``is_first_microbatch`` across loop steps and micro-batches under
megatron-core's own schedule (a fake TE-like linear in the core's layer spec)."""

import dataclasses

import pytest
import torch

from distributed import run_distributed, setup_parallel
from reference import lm_batch
from flags import TEST_FLAGS, llama_style

FUSIONS = ("bias_activation_fusion", "masked_softmax_fusion", "bias_dropout_fusion",
           "apply_rope_fusion", "persist_layer_norm", "gradient_accumulation_fusion",
           "cross_entropy_loss_fusion")


def _model(**kw):
    return llama_style(**kw)


def _settings(cuda, te, **kw):
    from megaloop.model.config import kernel_settings

    return kernel_settings(_model(**kw), cuda=cuda, te=te)


def test_help_lists_megatron_lm_flag_names():
    from megaloop.training.run_config import build_parser

    text = build_parser().format_help()
    for flag in ("--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
                 "--no-bias-dropout-fusion", "--no-rope-fusion",
                 "--no-gradient-accumulation-fusion", "--gradient-accumulation-fusion",
                 "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl",
                 "--attention-backend", "--fp8-format", "--fp8-recipe", "--fp8-margin",
                 "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather",
                 "--first-last-layers-bf16", "--num-layers-at-start-in-bf16",
                 "--num-layers-at-end-in-bf16"):
        assert flag in text, flag


def test_megatron_lm_defaults():
    from megaloop.training.run_config import parse_args

    m = parse_args([]).model
    assert (m.fp8_format, m.fp8_recipe, m.fp8_margin, m.fp8_amax_history_len,
            m.fp8_amax_compute_algo) == (None, "delayed", 0, 1, "most_recent")
    assert (m.num_layers_at_start_in_bf16, m.num_layers_at_end_in_bf16) == (1, 1)
    assert m.attention_backend == "auto" and not m.cross_entropy_loss_fusion
    m = parse_args(["--no-rope-fusion", "--fp8-format", "e4m3", "--attention-backend",
                    "fused"]).model
    assert m.no_rope_fusion and m.fp8_format == "e4m3" and m.attention_backend == "fused"


@pytest.mark.parametrize("te", [False, True])
def test_cpu_keeps_every_fusion_and_fp8_off(te):
    flags = dict(cross_entropy_loss_fusion=True, gradient_accumulation_fusion=True,
                 fp8_format="hybrid", fp8_recipe="tensorwise")
    s = _settings(False, te, **flags)
    assert not any(s[k] for k in FUSIONS)
    assert "fp8" not in s


# (flags, te) -> the fusions that must be on with a GPU (all others off)
GPU_CASES = [
    ({}, False, {"bias_activation_fusion", "masked_softmax_fusion", "bias_dropout_fusion"}),
    ({}, True, {"bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion"}),
    ({"no_bias_swiglu_fusion": True, "no_bias_dropout_fusion": True, "no_rope_fusion": True,
      "no_masked_softmax_fusion": True}, True, set()),
    ({"no_masked_softmax_fusion": True}, False, {"bias_activation_fusion",
                                                 "bias_dropout_fusion"}),
    ({"swiglu": False}, False, {"masked_softmax_fusion", "bias_dropout_fusion"}),
    ({"position_embedding_type": "learned_absolute"}, True, {"bias_activation_fusion",
                                                             "bias_dropout_fusion"}),
    ({"cross_entropy_loss_fusion": True}, True, {"bias_activation_fusion", "bias_dropout_fusion",
                                                 "apply_rope_fusion",
                                                 "cross_entropy_loss_fusion"}),
    ({"gradient_accumulation_fusion": True}, False, {"bias_activation_fusion",
                                                     "masked_softmax_fusion",
                                                     "bias_dropout_fusion",
                                                     "gradient_accumulation_fusion"}),
]


@pytest.mark.parametrize("flags,te,on", GPU_CASES)
def test_gpu_fusions(flags, te, on, monkeypatch):
    s = _settings(True, te, **flags)
    assert {k for k in FUSIONS if s[k]} == on
    assert not s["persist_layer_norm"]  # asserts on the local RMSNorm, never on
    # megatron-core accepts the combination (its fused-RoPE import is TE's: stand in for it)
    from megatron.core.models.common.embeddings import rope_utils

    from megaloop.model.config import transformer_config

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", object())
    cfg = transformer_config(_model(**flags), 2, cuda=True, te=te)
    # masked softmax also needs apex's kernel, absent here (test_masked_softmax_fusion_needs_...)
    assert {k for k in FUSIONS if getattr(cfg, k)} == on - {"masked_softmax_fusion"}

def test_masked_softmax_fusion_needs_the_kernel():
    from megaloop.model.config import kernel_settings

    s = kernel_settings(_model(), cuda=True, te=False, fused_softmax=False)
    assert not s["masked_softmax_fusion"] and s["bias_dropout_fusion"]


def test_attention_backend_is_megatron_cores_enum():
    from megatron.core.transformer.enums import AttnBackend

    for name in ("flash", "fused", "unfused", "local", "auto"):
        assert _settings(True, True, attention_backend=name)["attention_backend"] == \
            AttnBackend[name]


def test_fp8_translation_with_te_on_gpu():
    from megaloop.model.config import transformer_config

    flags = dict(fp8_format="hybrid", fp8_recipe="tensorwise", fp8_margin=1,
                 fp8_amax_history_len=16, fp8_amax_compute_algo="max", fp8_param_gather=True,
                 first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
                 num_layers_at_end_in_bf16=0, no_rope_fusion=True)
    s = _settings(True, True, **flags)
    assert (s["fp8"], s["fp8_recipe"], s["fp8_margin"], s["fp8_amax_history_len"],
            s["fp8_amax_compute_algo"], s["fp8_param"], s["first_last_layers_bf16"],
            s["num_layers_at_start_in_bf16"], s["num_layers_at_end_in_bf16"]) == \
        ("hybrid", "tensorwise", 1, 16, "max", True, True, 1, 0)
    cfg = transformer_config(_model(**flags), 2, bf16=True, cuda=True, te=True)
    assert cfg.fp8 == "hybrid" and cfg.fp8_param and cfg.fp8_amax_history_len == 16
    # the local spec has no FP8 path: off even on a GPU (a refused combination for training)
    assert "fp8" not in _settings(True, False, **flags)
    cfg = transformer_config(_model(**flags), 2, cuda=False, te=False)
    assert cfg.fp8 is None and not cfg.fp8_param


# --- validation ------------------------------------------------------------------------------
BASE = [*TEST_FLAGS, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--vocab-size", "256", "--mock-data"]
TE_FP8 = ["--transformer-impl", "transformer_engine", "--bf16", "--fp8-format", "hybrid",
          "--fp8-recipe", "tensorwise"]

# (extra flags, GPU present, fragments the message must contain: the flag and the fix)
REFUSED = [
    (["--fp8-format", "hybrid"], False, ["--fp8-format hybrid", "needs a GPU",
                                         "drop --fp8-format"]),
    (["--fp8-format", "e4m3", "--transformer-impl", "local", "--bf16"], True,
     ["--fp8-format e4m3", "--transformer-impl transformer_engine"]),
    (["--transformer-impl", "transformer_engine", "--fp8-format", "hybrid"], True,
     ["--fp8-format", "add --bf16"]),
    (TE_FP8[:-2] + ["--first-last-layers-bf16"], True,
     ["--first-last-layers-bf16", "--fp8-recipe delayed", "tensorwise"]),
    (TE_FP8 + ["--first-last-layers-bf16", "--num-layers", "3", "--num-prelude-layers", "1"],
     True, ["--first-last-layers-bf16", "--num-prelude-layers", "core-only"]),
    (TE_FP8 + ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "3"], True,
     ["--num-layers-at-start-in-bf16 3", "lower it"]),
    (TE_FP8 + ["--fp8-param-gather"], True, ["--fp8-param-gather",
                                             "--use-distributed-optimizer"]),
    (["--fp8-param-gather"], False, ["--fp8-param-gather", "--fp8-format"]),
    (["--first-last-layers-bf16"], False, ["--first-last-layers-bf16", "--fp8-format"]),
    (TE_FP8 + ["--hidden-size", "72", "--num-attention-heads", "4"], True,
     ["--hidden-size is 72", "multiple of 16", "rows are a multiple of 8"]),
    (TE_FP8 + ["--ffn-hidden-size", "96", "--tensor-model-parallel-size", "4"], True,
     ["--ffn-hidden-size per TP shard is 24", "--tensor-model-parallel-size"]),
    (TE_FP8 + ["--seq-length", "12", "--max-position-embeddings", "32", "--micro-batch-size",
               "1", "--global-batch-size", "1"], True,
     ["tokens per rank", "is 12", "--seq-length or --micro-batch-size"]),
    (TE_FP8 + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "16",
               "--micro-batch-size", "1", "--global-batch-size", "1"], True,
     ["tokens per rank (micro-batch x sequence / 2 ranks)", "is 8"]),
    (TE_FP8[:-1] + ["mxfp8", "--hidden-size", "48", "--num-attention-heads", "3"], "blackwell",
     ["multiple of 32", "MXFP8"]),
    (TE_FP8[:-1] + ["mxfp8"], True, ["--fp8-recipe mxfp8", "Blackwell", "tensorwise"]),
    (["--attention-backend", "flash"], False, ["--attention-backend flash",
                                               "--transformer-impl transformer_engine"]),
    (["--attention-backend", "local", "--transformer-impl", "transformer_engine"], True,
     ["--attention-backend local", "--transformer-impl local"]),
    (["--reset-attention-mask", "--transformer-impl", "local"], "apex",
     ["--reset-attention-mask", "add --no-masked-softmax-fusion"]),
    (["--gradient-accumulation-fusion", "--transformer-impl", "transformer_engine",
      "--num-loops", "3"], True,
     ["--gradient-accumulation-fusion", "--num-loops 3", "#6965",
      "drop --gradient-accumulation-fusion"]),
    (["--gradient-accumulation-fusion", "--transformer-impl", "transformer_engine",
      "--random-depth-mean", "2", "--exit-loss", "last"], True,
     ["--gradient-accumulation-fusion", "--random-depth-mean"]),
    (["--gradient-accumulation-fusion", "--log-grad-norm-per-step"], False,
     ["--gradient-accumulation-fusion", "--log-grad-norm-per-step", "main_grad"]),
    (["--gradient-accumulation-fusion", "--no-gradient-accumulation-fusion"], False,
     ["contradict"]),
    (["--fp8-amax-history-len", "0"], False, ["--fp8-amax-history-len 0"]),
]


def _validate(argv, cuda, monkeypatch, world=None):
    from megaloop.model import config as model_config
    from megaloop.training import run_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(cuda))
    # a Hopper GPU where one is pretended (``cuda="blackwell"``: a Blackwell one)
    cap = (10, 0) if cuda == "blackwell" else (9, 0) if cuda else (0, 0)
    monkeypatch.setattr(run_config, "torch_capability", lambda: cap)
    # ``cuda="apex"``: a GPU machine with apex's fused softmax kernel
    monkeypatch.setattr(model_config, "_fused_softmax_available", lambda: cuda == "apex")
    # a pretended GPU machine has Transformer Engine (the GPU image does)
    monkeypatch.setattr(run_config, "_te_installed", lambda: bool(cuda))
    cfg = run_config.parse_args(BASE + argv)
    tp = cfg.parallel.tensor_model_parallel_size
    cfg.validate(world or tp)
    return cfg


@pytest.mark.parametrize("argv,cuda,fragments", REFUSED,
                         ids=[" ".join(a) + f" {c or 'cpu'}" for a, c, _ in REFUSED])
def test_refused_with_the_fix(argv, cuda, fragments, monkeypatch):
    with pytest.raises(ValueError) as err:
        _validate(argv, cuda, monkeypatch)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


ALLOWED = [
    (TE_FP8, True),
    (TE_FP8[:-1] + ["delayed", "--num-loops", "4", "--exit-kl-beta", "0.1"], True),
    (TE_FP8 + ["--first-last-layers-bf16", "--num-layers", "4"], True),
    (TE_FP8 + ["--fp8-param-gather", "--use-distributed-optimizer"], True),
    (TE_FP8[:-1] + ["mxfp8"], "blackwell"),
    (TE_FP8 + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--micro-batch-size",
               "1", "--seq-length", "32", "--global-batch-size", "1"], True),
    (["--gradient-accumulation-fusion", "--transformer-impl", "transformer_engine"], True),
    (["--gradient-accumulation-fusion", "--transformer-impl", "local", "--num-loops", "3"], True),
    (["--reset-attention-mask", "--transformer-impl", "local", "--no-masked-softmax-fusion"],
     "apex"),
    (["--reset-attention-mask", "--transformer-impl", "local"], True),  # no fused kernel: off
    (["--reset-attention-mask"], False),  # CPU: no fused softmax
    (["--cross-entropy-loss-fusion", "--attention-backend", "local"], False),
    (["--attention-backend", "fused", "--transformer-impl", "transformer_engine"], True),
]


@pytest.mark.parametrize("argv,cuda", ALLOWED,
                         ids=[" ".join(a) + f" {c or 'cpu'}" for a, c in ALLOWED])
def test_allowed(argv, cuda, monkeypatch):
    _validate(argv, cuda, monkeypatch)


# --- is_first_microbatch across loop steps and micro-batches ----------------------------------
def _recording(base):
    """``base`` behaving like megatron-core's TE linear wrappers around TE's ``is_first_microbatch``
    (True after construction and after ``set_is_first_microbatch``; each forward passes the value
    to TE, then sets it False), recording what each call would pass."""

    class Recording(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.is_first_microbatch = True
            self.seen = []

        def forward(self, x, *args, **kwargs):
            self.seen.append(self.is_first_microbatch)
            out = super().forward(x, *args, **kwargs)
            self.is_first_microbatch = False
            return out

    Recording.__name__ = f"Recording{base.__name__}"
    return Recording


def _recording_spec(layer_spec):
    from megatron.core.transformer.spec_utils import get_module

    from megaloop.compat import submodules_of, with_submodules
    from megaloop.model.lora import TARGETS

    def spec(*args, **kwargs):
        s = layer_spec(*args, **kwargs)
        sub, parents = submodules_of(s), {}
        for name, (parent, _) in TARGETS.items():
            parent_spec = parents.get(parent, getattr(sub, parent))
            target = getattr(submodules_of(parent_spec), name)
            parents[parent] = with_submodules(parent_spec,
                                              **{name: _recording(get_module(target))})
        return with_submodules(s, **parents)

    return spec


def _first_microbatch_pattern(rank, world, T, microbatches, sabotage):
    import megaloop.model.looped_gpt as looped_gpt
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megaloop.model import recurrence
    from megaloop.model.config import LoopConfig, transformer_config
    from megaloop.training.trainer import forward_step

    setup_parallel(1)
    looped_gpt.layer_spec = _recording_spec(looped_gpt.layer_spec)  # forked rank: no undo needed
    model_cfg = llama_style(num_layers=2, hidden_size=32, num_attention_heads=4,
                            max_position_embeddings=16)
    loop = LoopConfig(num_loops=T)
    # FP8 configured (what makes megatron-core's set_is_first_microbatch act); without TE its
    # autocast contexts are no-ops, so the model runs on CPU.
    config = dataclasses.replace(transformer_config(model_cfg, 2), fp8="hybrid",
                                 fp8_recipe="tensorwise")
    model = looped_gpt.LoopedGPTModel(config, model_cfg, loop, 256)
    if sabotage:  # a regression: something re-arms the flag before every loop step
        core_call = recurrence._core

        def rearming(core, *args, **kwargs):
            for m in core.modules():
                if hasattr(m, "is_first_microbatch"):
                    m.is_first_microbatch = True
            return core_call(core, *args, **kwargs)

        recurrence._core = rearming
    linears = {n: m for n, m in model.named_modules() if hasattr(m, "seen")}
    assert len(linears) == 8 and all(n.startswith("core.") for n in linears), list(linears)
    for m in linears.values():
        m.is_first_microbatch = False  # as after an earlier iteration
    batches = []
    for i in range(microbatches):
        ids, pos, labels = lm_batch(256, 16, 2, seed=i)
        batches.append({"tokens": ids, "position_ids": pos, "labels": labels,
                        "loss_mask": torch.ones_like(labels, dtype=torch.float)})
    model.config.finalize_model_grads_func = None
    get_forward_backward_func()(
        forward_step_func=lambda it, mdl: forward_step(it, mdl, num_loops=T),
        data_iterator=iter(batches), model=[model], num_microbatches=microbatches,
        seq_length=16, micro_batch_size=2, forward_only=False)
    assert all(p.grad is not None for p in model.core.parameters())
    return {n: list(m.seen) for n, m in linears.items()}


@pytest.mark.parametrize("sabotage", [False, True])
def test_is_first_microbatch_true_only_at_step_1_of_micro_batch_0(sabotage):
    T, microbatches = 3, 2
    (seen,) = run_distributed(_first_microbatch_pattern, 1, T, microbatches, sabotage)
    expected = [True] + [False] * (T * microbatches - 1)
    for name, calls in seen.items():
        assert len(calls) == T * microbatches, (name, calls)
        if sabotage:  # the check below catches a per-step reset
            assert calls != expected and calls.count(True) == T * microbatches
        else:
            assert calls == expected, (name, calls)
