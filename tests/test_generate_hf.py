"""Generation from a folder written by export-hf (``--load FOLDER``), against the checkpoint.

A tiny checkpoint trained here (NullTokenizer, Ouro-style) is exported under megaloop names and
Ouro names; tools/generate.py on either folder, at TP=1 and under a 2-rank launch, prints exactly
the greedy ids it prints from the checkpoint. The reader itself: config.json read back gives the
config that writes it (every key hf_config writes), and a model with every optional piece the
export knows (prelude, coda, GQA, QK-norm, LoRA, injection, untied, trimmed vocabulary) loads at
TP=1 and TP=2 with the original's logits.
"""

import json
import os

import pytest
import torch

from distributed import run_distributed
from test_inference import _generate_tool, _train_and_save
from flags import llama_style

SEQ = 12


def _export_both(rank, world, ckpt, out):
    from megaloop.convert.hf_export import export_hf
    from megaloop.parallel.config import ParallelConfig
    from megaloop.parallel.initialize import initialize

    initialize(ParallelConfig(), 3)
    return {names: export_hf(ckpt, os.path.join(out, names), names=names)
            for names in ("megaloop", "ouro")}


def test_generate_from_exported_folder_equals_checkpoint(tmp_path):
    from megaloop.inference.loading import CHECKPOINT_TRACKER, is_hf_folder
    from megaloop.training.checkpointing import TRACKER

    assert CHECKPOINT_TRACKER == TRACKER
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_train_and_save, 1, ckpt)
    cfgs = run_distributed(_export_both, 1, ckpt, str(tmp_path))[0]
    assert cfgs["ouro"]["model_type"] == "ouro" and cfgs["megaloop"]["model_type"] == "megaloop"
    folders = [str(tmp_path / "megaloop"), str(tmp_path / "ouro")]
    assert all(is_hf_folder(f) for f in folders) and not is_hf_folder(ckpt)
    assert not os.path.exists(os.path.join(folders[0], "tokenizer.json"))  # NullTokenizer run

    prompt = ["--prompt-ids", "5,6,7,8", "--prompt-ids", "9,10", "--max-tokens", "10",
              "--no-stop-at-eod"]
    tok = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "200"]
    code, expected = run_distributed(_generate_tool, 1, ["--load", ckpt] + prompt,
                                     str(tmp_path / "ckpt_out"))[0]
    assert code == 0 and len(expected.strip().split("\n")) == 2
    for i, folder in enumerate(folders):
        got = run_distributed(_generate_tool, 1, ["--load", folder] + prompt + tok,
                              str(tmp_path / f"tp1_{i}"))[0]
        assert got == (0, expected), (folder, got, expected)
    tp2 = run_distributed(_generate_tool, 2, ["--load", folders[1]] + prompt + tok,
                          str(tmp_path / "tp2"))
    assert tp2[0] == (0, expected) and tp2[1] == (0, "")
    # No tokenizer.json and no flags: a clear refusal (exit 2), not a traceback.
    missing = run_distributed(_generate_tool, 1, ["--load", folders[0]] + prompt,
                              str(tmp_path / "notok"))[0]
    assert missing[0] == 2


def _hf_configs():
    from megaloop.model.config import LoopConfig

    everything = (
        llama_style(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                    kv_channels=12, qk_layernorm=True, max_position_embeddings=SEQ,
                    norm_scheme="pre", untie_embeddings_and_output_weights=True,
                    rotary_base=50000, norm_epsilon=1e-6, init_method_std=0.01,
                    ffn_hidden_size=48),
        LoopConfig(num_loops=3, num_prelude_layers=1, num_coda_layers=1,
                   step_norm_placement="readout", input_injection="scalar-mix",
                   injection_source="prelude", lora_rank=2, lora_alpha=4.0))
    ouro = (llama_style(num_layers=2, hidden_size=32, num_attention_heads=4,
                        max_position_embeddings=SEQ),
            LoopConfig(num_loops=3))
    no_gate = (llama_style(num_layers=2, hidden_size=32, num_attention_heads=4,
                           max_position_embeddings=SEQ, norm_scheme="pre"),
               LoopConfig(num_loops=4, exit_loss="last"))
    dense = (llama_style(num_layers=1, hidden_size=32, num_attention_heads=2), LoopConfig())
    return {"everything": everything, "ouro": ouro, "no_gate": no_gate, "dense": dense}


@pytest.mark.parametrize("name", ["everything", "ouro", "no_gate", "dense"])
def test_exported_config_reads_back_exactly(name):
    from megaloop.convert.hf_export import hf_config, is_ouro_style
    from megaloop.convert.hf_import import exported_configs

    model_cfg, loop = _hf_configs()[name]
    cfg = json.loads(json.dumps(hf_config(model_cfg, loop, 256, is_ouro_style(model_cfg, loop))))
    back_model, back_loop = exported_configs(cfg)
    assert hf_config(back_model, back_loop, 256, cfg["model_type"] == "ouro") == cfg
    assert back_loop.gated == loop.gated and back_model.num_layers == model_cfg.num_layers


def test_exported_config_refusals():
    from megaloop.convert.hf_export import hf_config
    from megaloop.convert.hf_import import exported_configs

    with pytest.raises(ValueError, match="import-hf"):
        exported_configs({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})
    with pytest.raises(ValueError, match="not a megaloop or Ouro export"):
        exported_configs({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    model_cfg, loop = _hf_configs()["ouro"]
    cfg = hf_config(model_cfg, loop, 256, True)
    with pytest.raises(ValueError, match="hidden_act"):
        exported_configs({**cfg, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="sliding-window"):
        exported_configs({**cfg, "use_sliding_window": True})


def _write_everything(rank, world, out):
    """The every-feature model, random and perturbed, written as a folder with its vocabulary
    trimmed to 151 rows (odd: a TP=2 load pads one zero row); its T=1/3 logits."""
    from megaloop.convert.hf_export import write_hf_folder
    from megaloop.model.looped_gpt import build_model
    from megaloop.parallel.config import ParallelConfig
    from megaloop.parallel.initialize import initialize

    initialize(ParallelConfig(), 3)
    model_cfg, loop = _hf_configs()["everything"]
    model = build_model(model_cfg, loop, 200, tp_size=1)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    write_hf_folder(out, model_cfg, loop, model.state_dict(), vocab_size=151)
    ids = torch.randint(0, 150, (2, SEQ), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(SEQ).expand_as(ids)
    with torch.no_grad():
        return ids, {T: model(ids, pos, None, num_loops=T)[..., :151].float() for T in (1, 3)}


def _load_everything(rank, world, folder, ids):
    from megatron.core import tensor_parallel

    from megaloop.convert.hf_import import load_exported
    from megaloop.data.config import TokenizerConfig
    from megaloop.parallel.config import ParallelConfig
    from megaloop.parallel.initialize import initialize

    initialize(ParallelConfig(tensor_model_parallel_size=world), 3)
    model, _, loop, run = load_exported(folder, world, TokenizerConfig("NullTokenizer", None, 149))
    assert run["tokenizer"]["tokenizer_type"] == "NullTokenizer" and loop.lora_rank == 2
    pos = torch.arange(SEQ).expand_as(ids)
    out = {}
    with torch.no_grad():
        for T in (1, 3):
            logits = model(ids, pos, None, num_loops=T)
            out[T] = tensor_parallel.gather_from_tensor_model_parallel_region(logits)[..., :151]
    return out


def test_exported_every_feature_loads_at_tp1_and_tp2(tmp_path):
    folder = str(tmp_path / "hf")
    ids, expected = run_distributed(_write_everything, 1, folder)[0]
    for world in (1, 2):
        for got in run_distributed(_load_everything, world, folder, ids):
            for T in (1, 3):
                err = (got[T].float() - expected[T]).abs().max().item()
                assert err < 1e-5, (world, T, err)


def test_exported_tokenizer_folder_first_then_flags(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from megaloop.convert.hf_import import exported_tokenizer
    from megaloop.data.config import TokenizerConfig
    from megaloop.data.tokenizers import train_sentencepiece

    flags = TokenizerConfig("NullTokenizer", None, 99)
    assert exported_tokenizer(str(tmp_path), 128, flags) == flags
    with pytest.raises(ValueError, match="no tokenizer.json .* --tokenizer-type"):
        exported_tokenizer(str(tmp_path), 128, None)
    with pytest.raises(ValueError, match="100 tokens but the exported embedding table only 64"):
        exported_tokenizer(str(tmp_path), 64, flags)
    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(["a looped model reads its own output again"] * 20, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<unk>", "<pad>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(tmp_path / "tokenizer.json"))  # as export-hf copies a run's tokenizer
    got = exported_tokenizer(str(tmp_path), 384, flags)
    assert got.tokenizer_type == "HuggingFaceTokenizer" and got.tokenizer_model == str(tmp_path)
    # A sentencepiece run's export holds the .model it tokenized with beside the tokenizer.json
    # converted from it: the .model is read.
    spm = train_sentencepiece(["a looped model reads its own output again"] * 20,
                              str(tmp_path / "spm"), vocab_size=280)
    os.rename(spm, tmp_path / "tokenizer.model")
    got = exported_tokenizer(str(tmp_path), 384, flags)
    assert got.tokenizer_type == "SentencePieceTokenizer"
    assert got.tokenizer_model == str(tmp_path / "tokenizer.model")
