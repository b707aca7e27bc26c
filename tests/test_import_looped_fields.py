"""How a looped Hugging Face config.json (Ouro's, or an export's) is read: every key of the
released Ouro-1.4B config.json honoured, checked or inert; anything else refused by name; Huginn
refused with what megaloop lacks; early_exit_threshold / early_exit_step -> the default exit rule
and back (export-hf writes what import-hf read); import-hf refuses loop flags for a looped folder
(they would be ignored). No model is built here: these are the reader's decisions."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The keys of ByteDance/Ouro-1.4B's config.json (values at a tiny size).
OURO = {
    "architectures": ["OuroForCausalLM"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig",
                 "AutoModel": "modeling_ouro.OuroModel",
                 "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
    "bos_token_id": 1, "eos_token_id": 2, "head_dim": 8, "hidden_act": "silu",
    "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
    "layer_types": ["full_attention", "full_attention"], "max_position_embeddings": 64,
    "max_window_layers": 28, "model_type": "ouro", "num_attention_heads": 4,
    "num_hidden_layers": 2, "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "rope_scaling": None,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "total_ut_steps": 4, "early_exit_threshold": 1.0,
    "transformers_version": "4.55.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 128,
}


def test_every_ouro_key_is_accounted_for_and_read():
    from megaloop.convert.hf_looped import CHECKED, HONOURED, INERT, looped_configs

    for key in OURO:
        assert (key in HONOURED) + (key in CHECKED) + (key in INERT) == 1, key
    model, loop = looped_configs(dict(OURO))
    assert (model.num_layers, model.hidden_size, model.ffn_hidden_size) == (2, 32, 64)
    assert (model.num_attention_heads, model.num_query_groups, model.kv_channels) == (4, 4, 8)
    assert (model.rotary_base, model.norm_epsilon, model.norm_scheme) == (1000000, 1e-6, "ouro")
    assert model.untie_embeddings_and_output_weights and not model.add_qkv_bias
    assert (loop.num_loops, loop.step_norm_placement, loop.gated) == (4, "recurrent", True)
    assert (loop.num_prelude_layers, loop.num_coda_layers, loop.input_injection) == (0, 0, "none")


@pytest.mark.parametrize("key,value,needle", [
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("use_sliding_window", True, "use_sliding_window=True"),
    ("layer_types", ["full_attention", "sliding_attention"], "layer_types"),
    ("attention_bias", True, "attention_bias=True"),
    ("mlp_bias", True, "mlp_bias=True"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5"),
    ("some_new_switch", 3, "['some_new_switch'] are unknown"),
    ("model_type", "qwen2", "model_type 'qwen2'"),
    ("early_exit_step", 4, "early_exit_step 4"),
    ("early_exit_threshold", "high", "early_exit_threshold 'high'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_type 'yarn'"),
])
def test_what_megaloop_does_not_compute_is_refused_by_name(key, value, needle):
    from megaloop.convert.hf_looped import looped_configs

    with pytest.raises(ValueError) as err:
        looped_configs({**OURO, key: value})
    assert needle in str(err.value), err.value


@pytest.mark.parametrize("keys,rule", [
    ({"early_exit_threshold": 1.0}, None),        # the released models: full depth
    ({"early_exit_threshold": 0.6}, "q:0.6"),     # Ouro's cumulative-probability rule
    ({"early_exit_threshold": 0.0}, "fixed:1"),   # the first step's CDF is always >= 0
    ({"early_exit_threshold": 0.6, "early_exit_step": 1}, "fixed:2"),  # the step wins
    ({"early_exit_threshold": 0.6, "early_exit_step": 3}, None),       # the last step
    ({}, None),
])
def test_the_default_exit_rule_and_its_way_back(keys, rule):
    from megaloop.convert.hf_looped import default_exit, threshold_keys

    cfg = {k: v for k, v in OURO.items() if k != "early_exit_threshold"}
    generation = default_exit({**cfg, **keys})
    assert generation["exit"] == rule
    # export-hf writes keys that read back as the same rule.
    assert default_exit({**cfg, **threshold_keys(generation)})["exit"] == rule


def test_an_ungated_model_with_a_threshold_is_refused():
    from megaloop.convert.hf_looped import default_exit

    with pytest.raises(ValueError, match="no exit gate"):
        default_exit({**OURO, "total_ut_steps": 1, "early_exit_threshold": 0.5})


def test_import_hf_refuses_loop_flags_for_a_looped_folder(tmp_path):
    folder = tmp_path / "ouro"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(OURO))
    (folder / "model.safetensors").write_bytes(b"")  # never read: refused before
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "import-hf",
         "--hf-dir", str(folder), "--save", str(tmp_path / "ckpt"), "--num-loops", "3",
         "--seed", "5"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == "", out
    assert "takes no --num-loops, --seed" in out.stderr, out.stderr
    assert not (tmp_path / "ckpt").exists()
