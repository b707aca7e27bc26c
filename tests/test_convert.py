"""Hugging Face import (dense-to-loop) and export, against `transformers` and megaloop itself.

Tiny random Qwen3 (QK-norm, GQA, head_dim != hidden/heads, untied, vocab not a multiple of 128)
and Llama (tied, one KV head) models are made with `transformers` here, saved, converted; the
converted model at T=1 reproduces `transformers`' logits, trains at T>1, and exports back to a
folder whose own modeling code reproduces megaloop's logits at any loop count.
"""

import json
import os

import pytest
import torch

from distributed import run_distributed
from flags import llama_style

SEQ, BATCH = 12, 2


def _perturb(model, seed):
    # Random init is nearly uniform (std 0.02, norms = 1); perturb everything so that every
    # weight, norm and rotary detail shows in the logits.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


def _make_hf(kind, path, seed=0):
    import transformers

    torch.manual_seed(seed)
    if kind == "qwen3":
        cfg = transformers.Qwen3Config(
            vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
            rope_theta=50000.0, rms_norm_eps=1e-6, max_position_embeddings=64)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
            rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    _perturb(model, seed)
    model.save_pretrained(path)
    return model


def _ids(vocab, seed=1):
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _world():
    from megaloop.parallel.config import ParallelConfig
    from megaloop.parallel.initialize import initialize

    initialize(ParallelConfig(tensor_model_parallel_size=torch.distributed.get_world_size()), 3)


def _logits(model, ids, T):
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(ids, pos, None, num_loops=T).float()


def _import(rank, world, hf_dir, save_dir, loop_kw):
    from megaloop.convert.hf_import import import_hf
    from megaloop.model.config import LoopConfig

    _world()
    return import_hf(hf_dir, save_dir, LoopConfig(**loop_kw), progress=False)


def _converted_logits(rank, world, save_dir, ids, loops):
    from megaloop.checkpoint.load import load_model
    from megaloop.model.looped_gpt import build_model
    from megaloop.training.checkpointing import load_checkpoint, read_run_config

    _world()
    if world == 1:
        model = load_model(save_dir)[0]
    else:  # the TP=1 checkpoint at TP=2: rebuild from the saved config
        from megaloop.checkpoint.config import config_from_dict
        from megaloop.data.config import TokenizerConfig
        from megaloop.data.tokenizers import build_tokenizer
        from megaloop.model.config import LoopConfig, ModelConfig

        run = read_run_config(save_dir)
        vocab = build_tokenizer(config_from_dict(TokenizerConfig, run["tokenizer"])).vocab_size
        model = build_model(config_from_dict(ModelConfig, run["model"]),
                            config_from_dict(LoopConfig, run["loop"]), vocab, tp_size=world)
        load_checkpoint(save_dir, model, load_optim=False, load_rng=False)
    from reference import gather_tp

    return {T: gather_tp(_logits(model, ids, T).transpose(0, 2).contiguous(),
                         model.output_layer.weight if model.output_layer.weight is not None
                         else model.embedding.word_embeddings.weight).transpose(0, 2)
            for T in loops}


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def converted(request, tmp_path_factory):
    """(kind, HF model, its folder, the converted checkpoint, printed flags)."""
    root = tmp_path_factory.mktemp(request.param)
    hf = _make_hf(request.param, str(root / "hf"))
    loop_kw = dict(num_loops=3, input_injection="scalar-mix", exit_loss="smoothed", lora_rank=4,
                   num_prelude_layers=1 if request.param == "llama" else 0)
    flags, = run_distributed(_import, 1, str(root / "hf"), str(root / "ckpt"), loop_kw)
    return request.param, hf, str(root / "hf"), str(root / "ckpt"), flags


def test_import_t1_matches_transformers(converted):
    kind, hf, _, ckpt, _ = converted
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        expected = hf(ids).logits
    got, = run_distributed(_converted_logits, 1, ckpt, ids, (1,))
    assert got[1].shape == expected.shape  # the HF table is kept as it is: no padding rows
    err = (got[1] - expected).abs().max().item()
    assert err < 1e-4, (kind, err)


def test_import_loads_at_tp2(converted):
    kind, hf, _, ckpt, _ = converted
    ids = _ids(hf.config.vocab_size)
    one, = run_distributed(_converted_logits, 1, ckpt, ids, (1, 3))
    for two in run_distributed(_converted_logits, 2, ckpt, ids, (1, 3)):
        for T in (1, 3):
            assert (one[T] - two[T]).abs().max().item() < 1e-4, (kind, T)


def test_printed_flags_rebuild_the_model(converted):
    from megaloop.arguments import dataclass_from_args
    from megaloop.checkpoint.config import config_from_dict
    from megaloop.model.config import LoopConfig, ModelConfig
    from megaloop.training.checkpointing import read_run_config
    from megaloop.training.run_config import build_parser

    _, _, _, ckpt, flags = converted
    args, _ = build_parser().parse_known_args(flags)
    saved = read_run_config(ckpt)
    assert dataclass_from_args(ModelConfig, args) == config_from_dict(ModelConfig, saved["model"])
    assert dataclass_from_args(LoopConfig, args) == config_from_dict(LoopConfig, saved["loop"])
    assert args.injection_init_weight == 0.99 and args.norm_scheme == "pre"


def _train_and_save(rank, world, ckpt, out, ids, steps):
    from megaloop.checkpoint.load import load_model
    from megaloop.training.checkpointing import save_checkpoint

    _world()
    model, _, _, run = load_model(ckpt)
    pos = torch.arange(SEQ).expand_as(ids)
    labels = torch.roll(ids, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, grads = [], {}
    for _ in range(steps):
        opt.zero_grad()
        out_ = model(ids, pos, None, labels=labels)
        loss = out_.objective.mean()
        loss.backward()
        losses.append(loss.item())
        grads = {n: p.grad.abs().max().item() for n, p in model.named_parameters()
                 if "exit_gate" in n or "injection" in n}
        opt.step()
    save_checkpoint(out, steps, model, run_config=run)
    return losses, grads, {T: _logits(model, ids, T) for T in (1, 3, 5)}


def _hf_logits(folder, ids, loops):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    with torch.no_grad():
        return {T: model(ids, num_loops=T).logits for T in loops}, model


def _export(rank, world, load, out, kw):
    from megaloop.convert.hf_export import export_hf

    _world()
    return export_hf(load, out, **kw)


def test_converted_model_trains_and_exports(converted, tmp_path):
    kind, hf, _, ckpt, _ = converted
    ids = _ids(hf.config.vocab_size, seed=5)
    losses, grads, ours = run_distributed(_train_and_save, 1, ckpt, str(tmp_path / "trained"),
                                          ids, 4)[0]
    assert losses[-1] < losses[0], losses
    assert all(g > 0 and g == g for g in grads.values()), grads
    cfg, = run_distributed(_export, 1, str(tmp_path / "trained"), str(tmp_path / "hf_out"), {})
    assert cfg["model_type"] == "megaloop" and cfg["lora_steps"] == 3
    # T=5 runs past the 3 trained LoRA adapters (both reuse the last one).
    theirs, _ = _hf_logits(str(tmp_path / "hf_out"), ids, (1, 3, 5))
    for T in (1, 3, 5):
        err = (ours[T] - theirs[T]).abs().max().item()
        assert err < 1e-4, (kind, T, err)


def test_round_trip_hf_megaloop_hf(converted, tmp_path):
    kind, hf, hf_dir, ckpt, _ = converted
    run_distributed(_export, 1, ckpt, str(tmp_path / "back"), {})
    ids = _ids(hf.config.vocab_size, seed=9)
    theirs, back = _hf_logits(str(tmp_path / "back"), ids, (1,))
    with torch.no_grad():
        expected = hf(ids).logits
    assert (theirs[1] - expected).abs().max().item() < 1e-4
    # The decoder's tensors come back bit for bit under their Hugging Face names.
    original, returned = hf.state_dict(), back.state_dict()
    offset = back.config.num_prelude_layers
    for name, tensor in original.items():
        if name == "lm_head.weight" and hf.config.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            rest = name.split(".", 3)[3]
            name = f"model.prelude.{i}.{rest}" if i < offset else \
                f"model.layers.{i - offset}.{rest}"
        assert torch.equal(returned[name], tensor), name


def _native(rank, world, out, kind):
    """A megaloop-native model (random, perturbed) saved as a checkpoint: its T=1/3 logits."""
    from megaloop.data.config import TokenizerConfig
    from megaloop.model.config import LoopConfig, ModelConfig
    from megaloop.model.looped_gpt import build_model
    from megaloop.training.checkpointing import save_checkpoint
    from megaloop.training.run_config import RunConfig

    _world()
    if kind == "ouro":
        model_cfg = llama_style(num_layers=2, hidden_size=32, num_attention_heads=4,
                                max_position_embeddings=SEQ, norm_scheme="ouro",
                                untie_embeddings_and_output_weights=True, norm_epsilon=1e-6)
        loop = LoopConfig(num_loops=3)
    else:  # every optional piece the modeling file implements
        model_cfg = llama_style(num_layers=4, hidden_size=32, num_attention_heads=4,
                                num_query_groups=2, kv_channels=12, qk_layernorm=True,
                                max_position_embeddings=SEQ, norm_scheme="pre")
        loop = LoopConfig(num_loops=3, num_prelude_layers=1, num_coda_layers=1,
                          step_norm_placement="readout", input_injection="scalar-mix",
                          injection_source="prelude", lora_rank=2, lora_alpha=4.0)
    model = build_model(model_cfg, loop, 200, tp_size=1)
    _perturb(model, 4)
    # 150 ids (EOD 149), what the export test trims the table to; export-hf writes EOD's id.
    tokenizer = TokenizerConfig("NullTokenizer", None, 149)
    run = RunConfig(model=model_cfg, loop=loop, tokenizer=tokenizer).to_dict()
    save_checkpoint(out, 7, model, run_config=run)
    ids = _ids(150, seed=2)  # below the trimmed vocabulary of the export test
    return ids, {T: _logits(model, ids, T) for T in (1, 3)}


def test_export_ouro_style_uses_ouro_names(tmp_path):
    ids, ours = run_distributed(_native, 1, str(tmp_path / "ckpt"), "ouro")[0]
    cfg, = run_distributed(_export, 1, str(tmp_path / "ckpt"), str(tmp_path / "hf"), {})
    assert cfg["model_type"] == "ouro" and cfg["architectures"] == ["OuroForCausalLM"]
    assert cfg["total_ut_steps"] == 3 and cfg["tie_word_embeddings"] is False
    assert cfg["eos_token_id"] == 149  # NullTokenizer: EOD is the id after the N ordinary ones
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for name in ("model.layers.1.input_layernorm_2.weight",
                 "model.layers.1.post_attention_layernorm_2.weight",
                 "model.layers.0.self_attn.q_proj.weight", "model.early_exit_gate.weight",
                 "model.early_exit_gate.bias", "model.norm.weight", "lm_head.weight"):
        assert name in names, name
    theirs, _ = _hf_logits(str(tmp_path / "hf"), ids, (1, 3))
    for T in (1, 3):
        assert (ours[T] - theirs[T]).abs().max().item() < 1e-4, T


def test_export_prelude_coda_qknorm_lora_injection(tmp_path):
    ids, ours = run_distributed(_native, 1, str(tmp_path / "ckpt"), "everything")[0]
    # --vocab-size trims the padded table (200 rows) to the tokenizer's real tokens.
    cfg, = run_distributed(_export, 1, str(tmp_path / "ckpt"), str(tmp_path / "hf"),
                           {"vocab_size": 150})
    assert cfg["model_type"] == "megaloop" and cfg["vocab_size"] == 150
    theirs, _ = _hf_logits(str(tmp_path / "hf"), ids, (1, 3))
    for T in (1, 3):
        assert theirs[T].shape[-1] == 150
        assert (ours[T][..., :150] - theirs[T]).abs().max().item() < 1e-4, T


def test_export_refuses_unsupported(tmp_path):
    from megaloop.convert.hf_export import write_hf_folder
    from megaloop.model.config import LoopConfig, ModelConfig

    with pytest.raises(ValueError, match="--swiglu"):
        write_hf_folder(str(tmp_path), llama_style(swiglu=False), LoopConfig(), {})


def _run_tool(argv, log):
    """Run tools/convert_checkpoint.py's main in a forked child (it starts its own world of one
    process); returns its exit code, with its output in ``log``."""
    import multiprocessing as mp
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
    import convert_checkpoint

    def child():
        with open(log, "w") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            sys.stdout, sys.stderr = f, f
            code = convert_checkpoint.main(argv)
            f.flush()
        os._exit(code)

    proc = mp.get_context("fork").Process(target=child)
    proc.start()
    proc.join(timeout=120)
    return proc.exitcode


def test_tool_round_trip_and_errors(tmp_path):
    hf_dir = str(tmp_path / "hf")
    hf = _make_hf("llama", hf_dir)
    log = str(tmp_path / "log")
    assert _run_tool(["import-hf", "--hf-dir", hf_dir, "--save", str(tmp_path / "ck"),
                      "--num-loops", "2", "--no-progress"], log) == 0
    text = open(log).read()
    assert "pretrain_looplm.py" in text and "--input-injection scalar-mix" in text
    assert "--exit-loss smoothed" in text and "--load " + str(tmp_path / "ck") in text
    assert _run_tool(["export-hf", "--load", str(tmp_path / "ck"), "--out",
                      str(tmp_path / "out")], log) == 0
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f)["total_ut_steps"] == 2
    ids = _ids(hf.config.vocab_size, seed=3)
    theirs, exported = _hf_logits(str(tmp_path / "out"), ids, (1,))
    with torch.no_grad():
        assert (theirs[1] - hf(ids).logits).abs().max().item() < 1e-4
        # generate() is greedy decoding (its cache: tests/test_export_cache.py).
        out = exported.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
        x = ids[:1, :4]
        for _ in range(3):
            x = torch.cat([x, exported(x).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(out, x)
    # Bad input: exit code 2 and a message naming the flag.
    assert _run_tool(["import-hf", "--hf-dir", str(tmp_path / "nowhere"), "--save",
                      str(tmp_path / "x")], log) == 2
    assert "--hf-dir" in open(log).read()
    assert _run_tool(["import-hf", "--hf-dir", hf_dir, "--save", str(tmp_path / "x"),
                      "--injection-init-weight", "1.5"], log) == 2
    assert "--injection-init-weight" in open(log).read()


@pytest.mark.parametrize("rows,tok", [(151936, 151669), (128256, 128256), (32000, 32000),
                                      (300, 300), (256, 100)])
def test_padding_divisor_keeps_the_table(rows, tok):
    from megaloop.convert.hf_import import padding_divisor
    from megaloop.model.config import padded_vocab_size

    d = padding_divisor(rows, tok)
    for tp in (1, 2, 4):
        if rows % tp == 0:
            assert padded_vocab_size(tok, d, tp) == rows, (d, tp)


def test_plan_vocab_reads_the_folder_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from megaloop.convert.hf_import import plan_vocab

    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(["a looped model reads its own output again"] * 20, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<unk>", "<pad>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(tmp_path / "tokenizer.json"))
    vocab = plan_vocab(str(tmp_path), 384, tp_size=2)
    assert vocab.tokenizer.tokenizer_type == "HuggingFaceTokenizer"
    assert vocab.tokenizer_vocab == hf.get_vocab_size() < 384
    assert "--tokenizer-model" in vocab.flags()
    with pytest.raises(ValueError, match="has .* tokens but the embedding"):
        plan_vocab(str(tmp_path), 200, tp_size=1)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 7"):
        plan_vocab(str(tmp_path), 384, tp_size=7)


@pytest.mark.parametrize("seed", ["-1", "4294967296"])
def test_import_seed_outside_numpys_range_is_one_line(tmp_path, seed):
    """import-hf's --seed seeds the process's generators, numpy's among them: a seed numpy
    refuses is refused by name before anything starts (it was numpy's traceback)."""
    hf_dir = str(tmp_path / "hf")
    _make_hf("llama", hf_dir)
    log = str(tmp_path / "log")
    assert _run_tool(["import-hf", "--hf-dir", hf_dir, "--save", str(tmp_path / "ck"),
                      "--num-loops", "2", "--seed", seed, "--no-progress"], log) == 2
    lines = open(log).read().strip().splitlines()
    assert lines == [f"error: --seed {seed}: must be an integer from 0 to 4294967295 (numpy's "
                     f"seed range: it seeds the fresh weights' generators)"], lines
    assert not os.path.exists(tmp_path / "ck")
