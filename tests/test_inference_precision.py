"""Inference precision: ``--bf16`` / ``--fp16`` / ``--fp32`` of tools/generate.py, tools/serve.py
and tools/evaluate.py, and lm-eval's ``bf16=true`` / ``fp16=true`` / ``fp32=true`` model args, all
through megaloop/inference/precision.py into megaloop/model/inference_model.py.

- a 16-bit model computes the fp32 model's teacher-forced logits within a bound derived from the
  format's unit roundoff, and holds every parameter in that format;
- each tool's flag reaches the model it loads; two precisions at once are refused, naming both;
- the default: on a GPU the precision the checkpoint trained in, announced in one line; on CPU
  fp32, silently;
- inference builds turn megatron-core's masked-softmax fusion off (its fused causal kernel
  asserts sq == sk, which a second prompt chunk or a speculation verify breaks).
"""

import contextlib
import io
import json
import os

import pytest
import torch

from distributed import run_distributed, setup_parallel
from test_inference import _train_and_save
from test_placement import check_placement
from run_helpers import load_tool as _tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Unit roundoff of round-to-nearest: 2**-(significand bits, the implicit one included).
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 3, 40, 41, 42, 43, 44, 45]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny looped model trained two steps in fp32 (test_training.BASE: 2 layers, T = 3)."""
    path = str(tmp_path_factory.mktemp("precision") / "ckpt")
    run_distributed(_train_and_save, 1, path)
    return path


def _train_bf16(rank, world, save):
    check_placement()
    from run_helpers import train
    from test_training import BASE

    return train(BASE + ["--micro-batch-size", "2", "--save", save, "--bf16"])[0]


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    """The same model trained with the trainer's --bf16: its saved run config says so."""
    path = str(tmp_path_factory.mktemp("precision") / "bf16")
    assert run_distributed(_train_bf16, 1, path) == [0]
    return path


def _dtypes(model) -> set:
    return {p.dtype for p in model.parameters()}


# --- (a) a 16-bit model against the fp32 model --------------------------------------------------
def _last_logits(rank, world, ckpt, precision):
    """The teacher-forced logits of PROMPTS' last positions (fp32, real vocabulary), the
    parameters' dtypes and the rounding count of ``test_16_bit_logits_...`` for this model."""
    check_placement()
    from megaloop.device import current_device
    from megaloop.inference.loading import load_for_generation
    from megaloop.inference.precision import PrecisionConfig

    setup_parallel(1)
    with contextlib.redirect_stderr(io.StringIO()):  # the precision line
        model, tokenizer, _ = load_for_generation(ckpt, precision=PrecisionConfig(
            **{precision: True}))
    ids = torch.tensor(PROMPTS, device=current_device())
    pos = torch.arange(ids.size(1), device=ids.device).expand_as(ids)
    with torch.no_grad():
        logits = model(ids, pos, None)
    loop = model.loop
    depth = loop.num_prelude_layers + loop.num_core_layers(
        model.model_cfg.num_layers) * loop.num_loops + loop.num_coda_layers
    return (logits[:, -1, :tokenizer.vocab_size].float().cpu(), _dtypes(model), depth,
            loop.num_loops)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bit_logits_are_the_fp32_logits_within_the_rounding_bound(ckpt, precision):
    """Every parameter is held in the 16-bit format (a flag accepted and ignored fails here), and
    the last-position logits z16 of the 16-bit model differ from the fp32 model's z by at most

        |z16 - z|  <=  N * u * max|z|

    u: the format's unit roundoff, 2**-8 for bf16 (8 significand bits), 2**-11 for fp16 (11):
    one rounding to nearest changes a value x by at most u * |x|.
    N: the roundings on the way from the token ids to a logit, each counted once (first order:
    products of two rounding errors, O(u**2), dropped). Per layer application (the local
    layer, norm scheme ``ouro``: a norm on each sub-layer's input and output, SwiGLU, RoPE):
    the 8 weights it reads (4 norm weights; QKV, output projection, fc1, fc2), and the
    activations each op rounds to 16 bits: attention 9 (input norm, QKV, RoPE, scores q.k,
    softmax, probs.v, output projection, output norm, residual add), MLP 7 (input norm, fc1,
    SiLU, SiLU x gate, fc2, output norm, residual add): 24 in all. Per loop step, the step
    norm (its weight and output): 2. Once: the embedding table read (1), the output layer's
    weight and its logits (2). With D = P + K * T + C layer applications:
    N = 24 * D + 2 * T + 3 (153 for this model's D = 6, T = 3).
    Each rounding error is carried to the logits with a gain taken as at most 1 relative to the
    logits' scale max|z|: every sub-layer's input and output and the head's input are
    RMS-normalised, so the residual stream's scale does not grow an error (an assumption of
    this first-order bound, not a theorem about every weight matrix). The bound is loose (N * u
    is 0.6 for bf16, 0.075 for fp16): errors of independent roundings partly cancel, and the
    observed difference is 1 to 2 u * max|z|. It catches a 16-bit model that computes another
    function (the 16-bit model left at its initial weights, its load skipped, differed by twice
    the bf16 bound when this test was written), not a small loss of accuracy."""
    z, fp32_dtypes, depth, loops = run_distributed(_last_logits, 1, ckpt, "fp32")[0]
    z16, dtypes, _, _ = run_distributed(_last_logits, 1, ckpt, precision)[0]
    assert fp32_dtypes == {torch.float32}
    assert dtypes == {DTYPES[precision]}, dtypes
    roundings = 24 * depth + 2 * loops + 3
    bound = roundings * UNIT_ROUNDOFF[precision] * z.abs().max().item()
    diff = (z16 - z).abs().max().item()
    assert diff <= bound, (precision, diff, bound)
    assert diff > 0  # computed in 16 bits, not fp32 relabelled


# --- (b) every tool's flag reaches the model it loads ---------------------------------------------
class _Loaded(Exception):
    """Raised by the recording load below to stop a tool once its model is loaded."""


def _tool_loads(rank, world, name, argv, stop):
    """Run tools/<name>.py's main(argv) with load_for_generation recording the dtypes of the
    model it returns (``stop``: end the tool right there); (exit code or None, dtypes, stdout,
    stderr)."""
    check_placement()
    from megaloop.inference import loading

    real, seen = loading.load_for_generation, []

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(_dtypes(out[0]))
        if stop:
            raise _Loaded
        return out

    loading.load_for_generation = recording
    out, err = io.StringIO(), io.StringIO()
    code = None
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = _tool(name).main(argv)
        except _Loaded:
            pass
    return code, seen, out.getvalue(), err.getvalue()


def test_generate_flags_reach_the_model(ckpt):
    """tools/generate.py --bf16 and --fp16 decode end to end with a model in that dtype; the
    chosen precision is named in one stderr line."""
    argv = ["--load", ckpt, "--prompt-ids", "5,6,7,8", "--max-tokens", "3", "--no-stop-at-eod"]
    for flag, dtype in (("--bf16", torch.bfloat16), ("--fp16", torch.float16),
                        ("--fp32", torch.float32)):
        code, seen, out, err = run_distributed(_tool_loads, 1, "generate", argv + [flag],
                                               False)[0]
        assert code == 0 and seen == [{dtype}], (flag, code, seen, err)
        assert len(out.strip().split(",")) == 3, out  # three generated ids
        lines = [line for line in err.splitlines() if "precision" in line]
        assert len(lines) == 1 and lines[0].startswith(
            f"inference precision: {flag[2:]} ({flag}"), err


def test_serve_and_evaluate_flags_reach_the_model(ckpt, tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    for name, argv in (("serve", ["--load", ckpt, "--port", "1"]),
                       ("evaluate", ["--load", ckpt, "--output-dir", str(tmp_path / "eval"),
                                     "--plots", "false"])):
        for flag, dtype in (("--bf16", torch.bfloat16), ("--fp16", torch.float16)):
            _, seen, _, err = run_distributed(_tool_loads, 1, name, argv + [flag], True)[0]
            assert seen == [{dtype}], (name, flag, seen, err)


def _lm_eval_model(rank, world, args):
    check_placement()
    from megaloop.eval.lm_eval_adapter import MegaloopLM

    setup_parallel(1)
    with contextlib.redirect_stderr(io.StringIO()):
        lm = MegaloopLM.create_from_arg_string(args)  # lm-eval's own --model_args parsing
    return _dtypes(lm.model)


def test_lm_eval_model_args_reach_the_model(ckpt):
    pytest.importorskip("lm_eval")
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        assert run_distributed(_lm_eval_model, 1, f"load={ckpt},{key}=true") == [{dtype}]


@pytest.mark.parametrize("name", ["generate", "serve", "evaluate"])
def test_two_precisions_are_refused_naming_both(name, ckpt, tmp_path, capsys, monkeypatch):
    """Exit code 2 and one line naming --bf16 and --fp16, before any process group."""
    if name == "serve":
        pytest.importorskip("fastapi")
        pytest.importorskip("uvicorn")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    extra = {"generate": ["--prompt-ids", "5,6"], "serve": ["--port", "1"],
             "evaluate": ["--output-dir", str(tmp_path / "eval")]}[name]
    assert _tool(name).main(["--load", ckpt, *extra, "--bf16", "--fp16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --bf16 and --fp16: choose one precision (or none: on a GPU the "
                   "checkpoint's, on CPU fp32)"], err
    assert not torch.distributed.is_initialized()


def test_lm_eval_refuses_two_precisions_and_a_value_that_is_not_a_boolean(ckpt):
    pytest.importorskip("lm_eval")
    from megaloop.eval.lm_eval_adapter import MegaloopLM, ModelArgsError

    for args, message in ((f"load={ckpt},bf16=true,fp16=true", "bf16 and fp16: choose one"),
                          (f"load={ckpt},bf16=yes", "bf16 'yes': must be true or false")):
        with pytest.raises(ModelArgsError) as info:
            MegaloopLM.create_from_arg_string(args)
        assert str(info.value).startswith(message), info.value
    assert not torch.distributed.is_initialized()


# --- (c) the default ----------------------------------------------------------------------------
def test_trained_precision_is_read_from_the_run_config_and_config_json(ckpt, bf16_ckpt,
                                                                       tmp_path):
    from megaloop.inference.precision import trained_precision

    assert trained_precision(bf16_ckpt) == ("bf16", "the checkpoint trained in bf16")
    assert trained_precision(ckpt) == ("fp32", "the checkpoint trained in fp32")
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    for key, value, want in (("torch_dtype", "bfloat16", "bf16"), ("dtype", "float16", "fp16"),
                             ("torch_dtype", "float32", "fp32")):
        (folder / "config.json").write_text(json.dumps({key: value}))
        assert trained_precision(str(folder)) == (want, f"config.json's {key} is {value}")
    (folder / "config.json").write_text("{}")
    assert trained_precision(str(folder))[0] == "fp32"


def test_default_on_a_gpu_is_the_trained_precision_announced(bf16_ckpt, ckpt, monkeypatch,
                                                             capsys):
    from megaloop.inference.precision import (PrecisionConfig, resolve_precision,
                                              trained_precision)

    trained_bf16, trained_fp32 = trained_precision(bf16_ckpt), trained_precision(ckpt)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_precision(None, *trained_bf16) == "bf16"
    assert capsys.readouterr().err == ("inference precision: bf16 (the checkpoint trained in "
                                       "bf16; --fp32 to override)\n")
    assert resolve_precision(PrecisionConfig(fp32=True), *trained_bf16) == "fp32"
    assert capsys.readouterr().err == "inference precision: fp32 (--fp32)\n"
    assert resolve_precision(None, *trained_fp32) == "fp32"
    assert capsys.readouterr().err == ("inference precision: fp32 (the checkpoint trained in "
                                       "fp32; --bf16 or --fp16 for 16 bits)\n")
    # lm-eval spells its keys without dashes
    assert resolve_precision(None, *trained_bf16, spell=str) == "bf16"
    assert "; fp32 to override)" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")  # (no process group here: torchrun's RANK says the rank)
    assert resolve_precision(None, *trained_bf16) == "bf16"
    assert capsys.readouterr().err == ""


def test_default_on_cpu_is_fp32_and_silent(bf16_ckpt, capsys):
    from megaloop.inference.precision import resolve_precision, trained_precision

    assert not torch.cuda.is_available()
    assert resolve_precision(None, *trained_precision(bf16_ckpt)) == "fp32"
    assert capsys.readouterr().err == ""


def _load_default(rank, world, load):
    check_placement()
    from megaloop.inference.loading import load_for_generation

    setup_parallel(1)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        model, _, _ = load_for_generation(load)
    return _dtypes(model), model.model_cfg.no_masked_softmax_fusion, err.getvalue()


def test_a_bf16_checkpoint_loads_in_fp32_on_cpu_without_a_line(bf16_ckpt):
    """The whole load: the trainer's --bf16 checkpoint (bf16 weights) comes back in fp32 on CPU,
    and nothing on stderr names a precision."""
    dtypes, no_fusion, err = run_distributed(_load_default, 1, bf16_ckpt)[0]
    assert dtypes == {torch.float32} and "precision" not in err, err
    assert no_fusion


# --- (d) the fused-softmax trap ----------------------------------------------------------------
def test_inference_builds_turn_the_masked_softmax_fusion_off():
    """kernel_settings is what transformer_config passes megatron-core: on a GPU with apex's
    kernel present, a local-layer model would fuse its softmax (the control); the inference
    model's config does not."""
    from megaloop.model.config import kernel_settings
    from megaloop.model.inference_model import inference_model_config
    from flags import llama_style

    cfg = llama_style(num_layers=2, hidden_size=32, num_attention_heads=4)
    gpu = {"cuda": True, "te": False, "fused_softmax": True}
    assert kernel_settings(cfg, **gpu)["masked_softmax_fusion"] is True
    assert kernel_settings(inference_model_config(cfg), **gpu)["masked_softmax_fusion"] is False
    assert cfg.no_masked_softmax_fusion is False  # a copy: the caller's config is untouched


def _chunked_bf16_decode(rank, world):
    """A bf16 model decoding a 40-token prompt in chunks of 16 (the second chunk: sq = 16
    queries against sk = 32 keys, shapes apex's fused causal kernel takes), then with
    self-speculation (a verify of k + 1 = 4 tokens against the cache), through megatron-core's
    layer forward (whose softmax module holds the fused kernel) and the engine's default:
    each request gets its tokens."""
    from megaloop.device import current_device
    from megaloop.inference.engine import EngineConfig, InferenceEngine
    from megaloop.model.config import LoopConfig
    from megaloop.model.inference_model import build_inference_model
    from flags import llama_style

    setup_parallel(1)
    cfg = llama_style(num_layers=2, hidden_size=64, num_attention_heads=4,
                      max_position_embeddings=128, transformer_impl="local")
    model = build_inference_model(cfg, LoopConfig(num_loops=2), 256, precision="bf16")
    model.cuda(current_device()).eval()
    prompt = [5 + i % 200 for i in range(40)]
    outs = []
    for layer_forward, speculate in (("megatron-core", ""), ("megatron-core", "1:3"),
                                     ("auto", ""), ("auto", "1:3")):
        engine = InferenceEngine(model, 250, config=EngineConfig(
            max_sequence_length=64, max_batch=4, block_size=16, prefill_chunk=16,
            speculate=speculate, layer_forward=layer_forward))
        requests = [engine.add(p, 8) for p in (prompt, prompt[:20])]
        while engine.has_work():
            engine.step()
        outs.append([len(r.out) for r in requests])
    return outs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_chunked_prefill_and_speculation_in_bf16_on_a_gpu():
    """With the fusion on, apex's ScaledUpperTriangMaskedSoftmax (where apex is installed) would
    assert sq == sk at the second chunk and at a verify."""
    assert run_distributed(_chunked_bf16_decode, 1)[0] == [[8, 8]] * 4
