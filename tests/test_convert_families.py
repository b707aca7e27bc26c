"""Dense-to-loop for Llama 3.x (RoPE scaling), Qwen2 / Qwen2.5 (QKV bias) and Mistral, against
`transformers`.

For each family a tiny random model is made with `transformers` from a config with the real
structural fields (Llama-3.2-style "llama3" RoPE scaling with factor 32 and rope_theta 500000,
tied; Qwen2.5-style q/k/v biases, untied; Mistral with a head_dim unlike hidden/heads and no
sliding window), its weights perturbed so that every tensor shows in the logits. The imported
model at T=1 computes `transformers`' logits (fp32, <= 1e-5 relative to the largest logit), loads
at TP=2 with the same logits, trains at T=3, and exports back to a folder whose modeling file
computes the same logits, with the decoder's tensors returned bit for bit. The config walk
proves the other half of the issue: every key of each family's config.json is honoured, checked
or shown not to change `transformers`' logits, and an unknown key is refused.
"""

import json
import os

import pytest
import torch

from distributed import run_distributed
from test_convert import _perturb, _run_tool, _world
from flags import LLAMA_STYLE_FLAGS, llama_style

SEQ, BATCH = 48, 2  # long enough that Llama 3.x's scaled low frequencies change the logits
TOL = 1e-5  # relative to the largest logit
LLAMA3 = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
          "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def _hf_config(family):
    import transformers

    if family == "llama3":  # Llama 3.2: scaled RoPE, tied, GQA, head_dim != hidden / heads
        return transformers.LlamaConfig(
            vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
            rope_theta=500000.0, rope_scaling=dict(LLAMA3), max_position_embeddings=131072,
            rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False, bos_token_id=1,
            eos_token_id=2)
    if family == "qwen2":  # Qwen2.5: q/k/v biases, untied, GQA
        return transformers.Qwen2Config(
            vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
            rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
            use_sliding_window=False, sliding_window=32768, max_window_layers=21,
            bos_token_id=3, eos_token_id=3)
    if family == "mistral":  # Mistral 7B v0.3: no sliding window, head_dim 8 of hidden 64 / 4
        return transformers.MistralConfig(
            vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=None,
            rope_theta=1000000.0, tie_word_embeddings=False, max_position_embeddings=32768,
            rms_norm_eps=1e-5)
    if family == "smollm":  # SmolLM2: a tied Llama with nanotron's two extra keys
        return transformers.LlamaConfig(
            vocab_size=192, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True,
            rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
            is_llama_config=True, rope_interleaved=False, pretraining_tp=1)
    assert family == "qwen3"
    return transformers.Qwen3Config(
        vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        rope_theta=1000000.0, max_position_embeddings=40960)


def _make_hf(family, path=None, seed=0):
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(family)).float().eval()
    _perturb(model, seed)
    if path is not None:
        model.save_pretrained(path)
    return model


def _ids(vocab, seed=1):
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _import(rank, world, hf_dir, save_dir, loop_kw):
    from megaloop.convert.hf_import import import_hf
    from megaloop.model.config import LoopConfig

    _world()
    return import_hf(hf_dir, save_dir, LoopConfig(**loop_kw), progress=False)


def _logits_at(rank, world, ckpt, ids, loops):
    """Full-vocabulary logits of the converted checkpoint at TP = world, per loop count."""
    from megatron.core import tensor_parallel

    from megaloop.checkpoint.config import config_from_dict
    from megaloop.data.config import TokenizerConfig
    from megaloop.data.tokenizers import build_tokenizer
    from megaloop.model.config import LoopConfig, ModelConfig
    from megaloop.model.looped_gpt import build_model
    from megaloop.training.checkpointing import load_checkpoint, read_run_config

    _world()
    run = read_run_config(ckpt)
    vocab = build_tokenizer(config_from_dict(TokenizerConfig, run["tokenizer"])).vocab_size
    model = build_model(config_from_dict(ModelConfig, run["model"]),
                        config_from_dict(LoopConfig, run["loop"]), vocab, tp_size=world)
    load_checkpoint(ckpt, model, load_optim=False, load_rng=False)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return {T: tensor_parallel.gather_from_tensor_model_parallel_region(
            model(ids, pos, None, num_loops=T)).float() for T in loops}


@pytest.fixture(scope="module", params=["llama3", "qwen2", "mistral"])
def converted(request, tmp_path_factory):
    """(family, HF model, its folder, the converted checkpoint (T=3), printed flags)."""
    root = tmp_path_factory.mktemp(request.param)
    hf = _make_hf(request.param, str(root / "hf"))
    loop_kw = dict(num_loops=3, input_injection="scalar-mix", exit_loss="smoothed",
                   lora_rank=2 if request.param == "qwen2" else 0)  # LoRA beside the QKV bias
    flags, = run_distributed(_import, 1, str(root / "hf"), str(root / "ckpt"), loop_kw)
    return request.param, hf, str(root / "hf"), str(root / "ckpt"), flags


def test_import_t1_equals_transformers(converted):
    family, hf, _, ckpt, flags = converted
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        expected = hf(ids).logits
    got, = run_distributed(_logits_at, 1, ckpt, ids, (1,))
    assert got[1].shape == expected.shape
    assert _rel(got[1], expected) <= TOL, (family, _rel(got[1], expected))
    switches = {"llama3": ["--use-rope-scaling", "true", "--rope-scaling-factor", "32.0"],
                "qwen2": ["--add-qkv-bias", "true"], "mistral": ["--kv-channels", "8"]}[family]
    assert " ".join(switches) in " ".join(flags), flags


def test_import_tp2_equals_tp1(converted):
    family, hf, _, ckpt, _ = converted
    ids = _ids(hf.config.vocab_size, seed=2)
    one, = run_distributed(_logits_at, 1, ckpt, ids, (1, 3))
    for two in run_distributed(_logits_at, 2, ckpt, ids, (1, 3)):
        for T in (1, 3):
            assert _rel(two[T], one[T]) <= TOL, (family, T, _rel(two[T], one[T]))


def _train_and_save(rank, world, ckpt, out, ids, steps):
    from megaloop.checkpoint.load import load_model
    from megaloop.training.checkpointing import save_checkpoint

    _world()
    model, _, loop, run = load_model(ckpt)
    assert loop.num_loops == 3
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    labels = torch.roll(ids, -1, dims=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(ids, pos, None, labels=labels).objective.mean()
        loss.backward()
        losses.append(loss.item())
        opt.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    save_checkpoint(out, steps, model, run_config=run)
    with torch.no_grad():
        logits = {T: model(ids, pos, None, num_loops=T).float() for T in (1, 3)}
    return losses, moved, logits


def _hf_logits(folder, ids, loops):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    with torch.no_grad():
        return {T: model(ids, num_loops=T).logits for T in loops}, model


def _export(rank, world, load, out):
    from megaloop.convert.hf_export import export_hf

    _world()
    return export_hf(load, out)


def test_trains_at_t3_and_exports_equal_logits(converted, tmp_path):
    family, hf, _, ckpt, _ = converted
    ids = _ids(hf.config.vocab_size, seed=5)
    losses, moved, ours = run_distributed(_train_and_save, 1, ckpt, str(tmp_path / "trained"),
                                          ids, 5)[0]
    assert losses[-1] < losses[0], losses
    if family == "qwen2":  # the biases and the adapters are trained parameters like any other
        assert any(n.endswith("linear_qkv.bias") for n in moved), moved
        assert any(".lora_B." in n for n in moved), moved
    cfg, = run_distributed(_export, 1, str(tmp_path / "trained"), str(tmp_path / "hf_out"))
    assert cfg["model_type"] == "megaloop" and cfg["total_ut_steps"] == 3
    assert cfg.get("rope_scaling") == ({k: LLAMA3[k] for k in LLAMA3} if family == "llama3"
                                       else None)
    assert cfg.get("qkv_bias", False) == (family == "qwen2")
    theirs, _ = _hf_logits(str(tmp_path / "hf_out"), ids, (1, 3))
    for T in (1, 3):
        assert _rel(theirs[T], ours[T]) <= TOL, (family, T, _rel(theirs[T], ours[T]))


def test_round_trip_is_bit_for_bit(converted, tmp_path):
    family, hf, _, ckpt, _ = converted
    run_distributed(_export, 1, ckpt, str(tmp_path / "back"))
    ids = _ids(hf.config.vocab_size, seed=9)
    theirs, back = _hf_logits(str(tmp_path / "back"), ids, (1,))
    with torch.no_grad():
        expected = hf(ids).logits
    assert _rel(theirs[1], expected) <= TOL, (family, _rel(theirs[1], expected))
    returned = back.state_dict()
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and hf.config.tie_word_embeddings:
            continue
        assert torch.equal(returned[name], tensor), name
    biases = [n for n in returned if n.endswith("_proj.bias")]
    assert len(biases) == (6 if family == "qwen2" else 0), biases  # q, k, v of 2 layers


def test_llama3_frequencies_match_transformers_and_matter():
    """megatron-core's scaled RoPE (what --use-rope-scaling builds) equals transformers' llama3
    frequencies; the tiny config puts frequencies in all three bands (kept, blended, divided),
    and the scaling changes the logits far beyond the parity tolerance at SEQ tokens, so the
    parity test above could not pass with the scaling ignored."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    import math

    cfg = _hf_config("llama3")
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    plain = 1.0 / 500000.0 ** (torch.arange(0, 16, 2).float() / 16)
    ours = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=500000,
                           rope_scaling=True, rope_scaling_factor=32.0,
                           use_cpu_initialization=True).inv_freq
    assert torch.equal(ours, theirs)
    wavelen = 2 * math.pi / plain
    assert (wavelen < 2048).any() and (wavelen > 8192).any()
    assert ((wavelen >= 2048) & (wavelen <= 8192)).any()
    import transformers

    hf = _make_hf("llama3")
    unscaled_cfg = _hf_config("llama3")
    unscaled_cfg.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    unscaled = transformers.AutoModelForCausalLM.from_config(unscaled_cfg).float().eval()
    unscaled.load_state_dict(hf.state_dict())
    ids = _ids(256)
    with torch.no_grad():
        assert _rel(unscaled(ids).logits, hf(ids).logits) > 1000 * TOL


def test_tool_refuses_sliding_window_by_name(tmp_path):
    import transformers

    cfg = _hf_config("mistral")
    cfg.sliding_window = 16
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path / "hf"))
    log = str(tmp_path / "log")
    assert _run_tool(["import-hf", "--hf-dir", str(tmp_path / "hf"), "--save",
                      str(tmp_path / "ck"), "--no-progress"], log) == 2
    assert "sliding_window=16" in open(log).read()
    assert not os.path.exists(tmp_path / "ck")


def test_flags_reach_the_model():
    """--use-rope-scaling / --rope-scaling-factor / --add-qkv-bias as pretrain_looplm.py parses
    them build megatron-core's scaled rotary table and a QKV bias (and no other bias)."""
    from megaloop.arguments import dataclass_from_args
    from megaloop.model.config import ModelConfig
    from megaloop.training.run_config import build_parser

    args, _ = build_parser().parse_known_args(
        [*LLAMA_STYLE_FLAGS, "--use-rope-scaling", "--rope-scaling-factor", "32", "--add-qkv-bias",
         "--rotary-base", "500000", "--kv-channels", "16", "--num-attention-heads", "4",
         "--hidden-size", "48"])
    model_cfg = dataclass_from_args(ModelConfig, args)
    assert model_cfg.use_rope_scaling and model_cfg.rope_scaling_factor == 32.0
    assert model_cfg.add_qkv_bias and model_cfg.disable_bias_linear
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](_hf_config("llama3"), "cpu")
    names, inv_freq = run_distributed(_built, 1, model_cfg)[0]
    assert torch.equal(inv_freq, expected)
    biases = sorted(n for n in names if n.endswith("bias"))
    assert biases == [f"core.layers.{i}.self_attention.linear_qkv.bias" for i in range(2)]


def _built(rank, world, model_cfg):
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    _world()
    model = build_model(model_cfg, LoopConfig(num_loops=2, exit_loss="last"), 128)
    return [n for n, _ in model.named_parameters()], model.rotary_pos_emb.inv_freq.cpu()


def test_flag_validation_names_the_flag():
    from megaloop.model.config import ModelConfig

    with pytest.raises(ValueError, match="--rope-scaling-factor 32.0 has no effect without "
                                         "--use-rope-scaling"):
        llama_style(rope_scaling_factor=32.0).validate()
    with pytest.raises(ValueError, match="--use-rope-scaling .* --position-embedding-type rope"):
        llama_style(use_rope_scaling=True, position_embedding_type="learned_absolute").validate()
    with pytest.raises(ValueError, match="--rope-scaling-factor -1.0 must be positive"):
        llama_style(use_rope_scaling=True, rope_scaling_factor=-1.0).validate()
    llama_style(use_rope_scaling=True, rope_scaling_factor=32.0, add_qkv_bias=True).validate()


def test_ouro_names_refused_for_scaling_and_bias(tmp_path):
    from megaloop.convert.hf_export import hf_config, is_ouro_style, write_hf_folder
    from megaloop.model.config import LoopConfig, ModelConfig

    loop = LoopConfig(num_loops=3)
    plain = llama_style(norm_scheme="ouro")
    assert is_ouro_style(plain, loop)
    cfg = hf_config(plain, loop, 128, True)
    assert "rope_scaling" not in cfg and "qkv_bias" not in cfg  # Ouro's keys, unchanged
    for extra in (dict(use_rope_scaling=True), dict(add_qkv_bias=True)):
        model = llama_style(norm_scheme="ouro", **extra)
        assert not is_ouro_style(model, loop)
        with pytest.raises(ValueError, match="--names ouro needs an Ouro-style model"):
            write_hf_folder(str(tmp_path), model, loop, {}, names="ouro")


def test_export_config_reads_back_with_scaling_and_bias():
    from megaloop.convert.hf_export import hf_config
    from megaloop.convert.hf_import import exported_configs
    from megaloop.model.config import LoopConfig, ModelConfig

    model = llama_style(norm_scheme="pre", use_rope_scaling=True, rope_scaling_factor=32.0,
                        add_qkv_bias=True, rotary_base=500000)
    loop = LoopConfig(num_loops=3, input_injection="scalar-mix")
    cfg = json.loads(json.dumps(hf_config(model, loop, 128, False)))
    back_model, back_loop = exported_configs(cfg)
    assert back_model.use_rope_scaling and back_model.rope_scaling_factor == 32.0
    assert back_model.add_qkv_bias
    assert hf_config(back_model, back_loop, 128, False) == cfg


def _pretrain(rank, world, args):
    """pretrain_looplm.py's run, in this forked rank: its exit code."""
    from run_helpers import train

    return train(args)[0]


def test_printed_flags_train_at_tp2(converted, tmp_path):
    """The flags import-hf prints (--use-rope-scaling / --add-qkv-bias among them) drive the
    trainer at TP=2 from the converted checkpoint: it loads, and the loss of the T=3 model falls."""
    family, _, _, ckpt, flags = converted
    flags = list(flags)
    tp = flags.index("--tensor-model-parallel-size")
    flags[tp + 1] = "2"
    log = tmp_path / "train.jsonl"
    codes = run_distributed(_pretrain, 2, flags + [
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "8", "--lr", "3e-3", "--mock-data", "--log-interval", "1",
        "--eval-iters", "0", "--log-jsonl", str(log)], timeout=300)
    assert codes == [0, 0]
    train = [json.loads(line) for line in log.read_text().splitlines()]
    train = [r for r in train if r["split"] == "train"]
    assert len(train) == 8 and all(len(r["step_losses"]) == 3 for r in train)
    losses = [r["loss"] for r in train]  # noisy per batch (mock data): compare 3-step means
    assert sum(losses[-3:]) < sum(losses[:3]), (family, losses)


def _load_exported_logits(rank, world, folder, ids, vocab):
    from megatron.core import tensor_parallel

    from megaloop.convert.hf_import import load_exported
    from megaloop.data.config import TokenizerConfig

    _world()
    model = load_exported(folder, world, TokenizerConfig("NullTokenizer", None, vocab - 1))[0]
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        logits = model(ids, pos, None, num_loops=1)
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)[..., :vocab].float()


def test_exported_folder_loads_back_at_tp2(converted, tmp_path):
    """``--load FOLDER`` (generate.py, serve.py) reads the export's scaling and biases back and
    shards them at TP=2: the logits are still `transformers`' own."""
    family, hf, _, ckpt, _ = converted
    run_distributed(_export, 1, ckpt, str(tmp_path / "out"))
    ids = _ids(hf.config.vocab_size, seed=11)
    with torch.no_grad():
        expected = hf(ids).logits
    for got in run_distributed(_load_exported_logits, 2, str(tmp_path / "out"), ids,
                               hf.config.vocab_size):
        assert _rel(got, expected) <= TOL, (family, _rel(got, expected))
