"""A Hugging Face folder that is wrong in a way a user meets (megaloop/convert/hf_folder.py,
hf_import.py): each mistake is one line naming the file and what is wrong, exit code 2, before a
model is built; nothing is silently replaced.

- config.json: not JSON, not a JSON object, a number / boolean key of the wrong JSON type;
- sizes config.json gives that its tensors do not have (a hidden_size of 10**12 asked the
  allocator for half a petabyte), for import-hf and for generate --load of the folder, and
  weights whose float32 copies do not fit in memory;
- NaN / inf weights, named by tensor;
- a tokenizer the folder lacks: tokenizer.json missing beside other tokenizer files is refused;
  no tokenizer files at all is NullTokenizer, said in a note;
- the checkpoint names its own copy of the tokenizer (it works with the source folder gone), and
  the note about config.json's eos_token_id appears exactly when that id is not the tokenizer's
  end-of-text token.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from ouro_reference import make_ouro_folder, write_tokenizer
from test_convert import _make_hf, _run_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _edit_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def _one_error_line(log):
    """The tool's whole output: one line, an error, no traceback."""
    lines = open(log).read().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def _import(folder, save, log):
    return _run_tool(["import-hf", "--hf-dir", str(folder), "--save", str(save),
                      "--no-progress"], str(log))


@pytest.fixture(scope="module")
def ouro(tmp_path_factory):
    """A tiny Ouro folder, copied by each test that changes it."""
    folder = tmp_path_factory.mktemp("ouro_src") / "ouro"
    make_ouro_folder(str(folder), seed=3)
    return folder


def _copy(src, tmp_path, name="hf"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


# --- config.json: JSON, an object, and the type of every key megaloop reads -----------------------
def test_config_that_is_not_json_or_not_an_object(ouro, tmp_path):
    folder = _copy(ouro, tmp_path)
    path = folder / "config.json"
    path.write_text('{"hidden_size": 32,\n  oops}')
    assert _import(folder, tmp_path / "ck", tmp_path / "log") == 2
    line = _one_error_line(tmp_path / "log")
    assert f"{path} is not valid JSON" in line and "line 2 column 3" in line, line
    path.write_text("[1, 2]")
    assert _import(folder, tmp_path / "ck", tmp_path / "log") == 2
    line = _one_error_line(tmp_path / "log")
    assert f"{path} holds a list, not the object of settings" in line, line
    assert not (tmp_path / "ck").exists()


def test_a_string_where_a_number_belongs_is_one_line(ouro, tmp_path):
    folder = _copy(ouro, tmp_path)
    path = _edit_config(folder, total_ut_steps="4")
    assert _import(folder, tmp_path / "ck", tmp_path / "log") == 2
    assert _one_error_line(tmp_path / "log") == \
        f'error: {path}: total_ut_steps is "4" (a string); it must be an integer'


def _wrong_values(kind, least):
    """JSON values that are not of ``kind`` (or fall below ``least``), and how each reads."""
    from megaloop.convert import hf_folder as F

    if kind in (F.LIST, F.OBJECT):
        return [(3, "3")]
    if kind == F.STRING:
        return [(3, "3"), (["x"], '["x"]')]
    wrong = [("1", '"1"'), ([1], "[1]")]
    if kind == F.INT:
        wrong += [(True, "true"), (4.0, "4.0")]
    if kind == F.NUMBER:
        wrong += [(True, "true"), (float("nan"), "NaN"), (float("inf"), "Infinity")]
    if kind == F.BOOL:
        wrong += [(0, "0"), ("false", '"false"')]
    if least is not None:
        wrong.append((least - 1, json.dumps(least - 1)))
    return wrong


def _cases():
    from megaloop.convert import hf_folder as F

    cases = [(key, spec) for key, spec in F.KEY_TYPES.items()]
    for outer in ("rope_scaling", "rope_parameters"):
        cases += [(f"{outer}.{key}", spec) for key, spec in F.ROPE_KEY_TYPES.items()]
    return [(key, kind, value, shown) for key, (kind, least, _) in cases
            for value, shown in _wrong_values(kind, least)]


@pytest.mark.parametrize("key,kind,value,shown", _cases())
def test_every_typed_key_is_refused_by_name_file_value_and_type(tmp_path, key, kind, value,
                                                                 shown):
    from megaloop.convert.hf_folder import read_hf_config
    from ouro_reference import ouro_config

    cfg = ouro_config()
    if "." in key:
        outer, inner = key.split(".")
        cfg[outer] = {"rope_type": "llama3", inner: value}
    else:
        cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        read_hf_config(str(tmp_path))
    text = str(err.value)
    assert text.startswith(f"{tmp_path / 'config.json'}: {key} is {shown} "), text
    assert f"it must be {kind}" in text, text


def test_architectures_entries_are_strings(tmp_path):
    from megaloop.convert.hf_folder import read_hf_config
    from ouro_reference import ouro_config

    (tmp_path / "config.json").write_text(json.dumps(ouro_config(architectures=[7])))
    with pytest.raises(ValueError, match=r"architectures\[0\] is 7 \(an integer\); it must be "
                                         r"a string"):
        read_hf_config(str(tmp_path))


def test_every_number_or_boolean_key_the_readers_read_has_a_type():
    """The type table covers every key the families' readers honour or check whose value is not
    a string checked by value: a key added to a reader without a type would reach the configs
    unchecked."""
    from megaloop.convert import hf_families, hf_looped
    from megaloop.convert.hf_folder import KEY_TYPES

    read = set(hf_families.HONOURED) | set(hf_families.CHECKED_COMMON) | set(hf_looped.HONOURED)
    read |= set(hf_looped.CHECKED)
    for checked in hf_families.CHECKED_BY_FAMILY.values():
        read |= set(checked)
    # Strings, each checked by value where it is read (naming the values accepted), and
    # Mistral's sliding_window, refused by value unless null.
    by_value = {"model_type", "hidden_act", "norm_scheme", "step_norm_placement",
                "input_injection", "injection_source", "sliding_window"}
    assert sorted(read - by_value - set(KEY_TYPES)) == []


def test_the_released_configs_pass_the_type_check(tmp_path):
    """No false refusal: Ouro-1.4B's keys, and the configs transformers writes for the dense
    families (with Llama 3.x's rope_scaling)."""
    import transformers

    from megaloop.convert.hf_folder import read_hf_config
    from ouro_reference import ouro_config

    configs = [ouro_config(), transformers.Qwen3Config().to_dict(),
               transformers.Qwen2Config().to_dict(), transformers.MistralConfig().to_dict(),
               transformers.LlamaConfig(rope_scaling={
                   "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}).to_dict()]
    for cfg, arch in zip(configs, ["OuroForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM",
                                   "MistralForCausalLM", "LlamaForCausalLM"]):
        cfg["architectures"] = [arch]  # as save_pretrained writes it
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        assert read_hf_config(str(tmp_path)) == json.loads(json.dumps(cfg))


# --- sizes against the tensors, and against memory -----------------------------------------------
@pytest.mark.parametrize("key,value,said", [
    ("hidden_size", 10 ** 12, "hidden_size 1000000000000"),
    ("vocab_size", 10 ** 12, "vocab_size 1000000000000"),
    ("intermediate_size", 128, "intermediate_size 128"),
    ("num_attention_heads", 8, "num_attention_heads 8 x head_dim 8"),
    ("num_key_value_heads", 2, "num_key_value_heads 2 x head_dim 8"),
])
def test_a_size_the_tensors_do_not_have_is_one_line_before_any_allocation(ouro, tmp_path, key,
                                                                         value, said):
    from safetensors import safe_open

    folder = _copy(ouro, tmp_path)
    path = _edit_config(folder, **{key: value})
    tensor = {"vocab_size": "model.embed_tokens.weight", "hidden_size": "model.embed_tokens.weight",
              "intermediate_size": "model.layers.0.mlp.gate_proj.weight",
              "num_attention_heads": "model.layers.0.self_attn.q_proj.weight",
              "num_key_value_heads": "model.layers.0.self_attn.k_proj.weight"}[key]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        shape = list(f.get_slice(tensor).get_shape())
    assert _import(folder, tmp_path / "ck", tmp_path / "log") == 2
    line = _one_error_line(tmp_path / "log")
    assert line.startswith(f"error: {path}: {said} does not match the tensor {tensor}, whose "
                           f"shape is {shape}"), line
    assert not (tmp_path / "ck").exists()


def test_a_layer_count_the_tensors_do_not_have(ouro, tmp_path):
    folder = _copy(ouro, tmp_path)
    path = _edit_config(folder, num_hidden_layers=10 ** 6)
    assert _import(folder, tmp_path / "ck", tmp_path / "log") == 2
    assert _one_error_line(tmp_path / "log") == (
        f"error: {path}: num_hidden_layers 1000000 does not match the safetensors files, which "
        f"hold layers model.layers.0 .. model.layers.1 (2 in all); config.json and the weights "
        f"come from different models (copy the folder again)")


def test_generate_on_a_folder_whose_config_says_a_huge_size(ouro, tmp_path):
    folder = _copy(ouro, tmp_path)
    path = _edit_config(folder, hidden_size=10 ** 12)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "generate.py"), "--load",
                          str(folder), "--prompt-ids", "5,6", "--max-tokens", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stdout == "", out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: {path}: hidden_size 1000000000000 does not match the tensor "
        f"model.embed_tokens.weight, whose shape is [128, 32]"), out.stderr


def test_weights_that_do_not_fit_in_memory(ouro, monkeypatch):
    """Reading a folder holds two float32 copies of its weights (the model, and the tensors read
    into it): refused when they exceed the memory available, accepted when they fit."""
    from safetensors.torch import load_file

    from megaloop.convert import hf_folder

    tensors = load_file(str(ouro / "model.safetensors"))
    need = 2 * 4 * sum(t.numel() for t in tensors.values())
    monkeypatch.setattr(hf_folder, "available_memory", lambda: need - 1)
    with pytest.raises(ValueError) as err:
        hf_folder.check_folder(str(ouro))
    text = str(err.value)
    assert f"its {need // 8:,} weights are read in float32" in text, text
    gib = 2 ** 30
    assert f"{need / gib:.1f} GiB together, more than the {(need - 1) / gib:.1f} GiB" in text
    monkeypatch.setattr(hf_folder, "available_memory", lambda: need)
    hf_folder.check_folder(str(ouro))


def test_available_memory_is_within_what_the_machine_has():
    from megaloop.convert.hf_folder import available_memory

    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    assert 0 < available_memory() <= info["MemTotal"] + info.get("SwapTotal", 0)


# --- NaN / inf weights ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, bad):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "hf"
    make_ouro_folder(str(folder), seed=5)
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][3, 7] = bad
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert _import(folder, tmp_path / "ck", tmp_path / "log") == 2
    line = _one_error_line(tmp_path / "log")
    expected = int((~torch.isfinite(tensors[name])).sum())  # 1
    assert line.startswith(f"error: {folder / 'model.safetensors'}: tensor {name} holds "
                           f"{expected} NaN or infinite value(s) of {tensors[name].numel()}"), line


# --- the tokenizer -------------------------------------------------------------------------------
def test_tokenizer_json_missing_beside_its_config_is_refused(ouro, tmp_path):
    folder = _copy(ouro, tmp_path)
    os.remove(folder / "tokenizer.json")
    assert _import(folder, tmp_path / "ck", tmp_path / "log") == 2
    assert _one_error_line(tmp_path / "log") == (
        f"error: {folder} has tokenizer_config.json but no tokenizer.json, the file import-hf "
        f"reads the tokenizer from: copy the model's tokenizer.json into the folder")
    assert not (tmp_path / "ck").exists()


def test_no_tokenizer_files_is_null_tokenizer_said_in_a_note(ouro, tmp_path):
    from megaloop.checkpoint.config import read_run_config

    folder = _copy(ouro, tmp_path)
    os.remove(folder / "tokenizer.json")
    os.remove(folder / "tokenizer_config.json")
    rows = json.load(open(folder / "config.json"))["vocab_size"]
    assert _import(folder, tmp_path / "ck", tmp_path / "log") == 0, open(tmp_path / "log").read()
    text = open(tmp_path / "log").read()
    assert f"> note: {folder} holds no tokenizer files: the checkpoint's tokenizer is " \
           f"NullTokenizer (text is token ids, 0..{rows - 2} and end-of-text {rows - 1})" in text
    # The eos note names no file the checkpoint lacks (NullTokenizer has no settings file).
    eos = [line for line in text.splitlines() if "eos_token_id" in line]
    assert len(eos) == 1 and "tokenizer_config.json" not in eos[0], eos
    assert f"not the tokenizer's end-of-text token {rows - 1}" in eos[0], eos
    assert not (tmp_path / "ck" / "tokenizer").exists()
    tok = read_run_config(str(tmp_path / "ck"))["tokenizer"]
    assert (tok["tokenizer_type"], tok["vocab_size"]) == ("NullTokenizer", rows - 1)


def _tokenizer_of(ckpt):
    from megaloop.checkpoint.config import config_from_dict, read_run_config
    from megaloop.data.config import TokenizerConfig
    from megaloop.data.tokenizers import build_tokenizer

    cfg = config_from_dict(TokenizerConfig, read_run_config(ckpt)["tokenizer"])
    return cfg, build_tokenizer(cfg)


TEXT = "w5 w9 w17 w4 <|im_end|> w30"


@pytest.mark.parametrize("kind", ["ouro", "llama"])
def test_the_checkpoint_names_its_own_tokenizer_copy(tmp_path, kind):
    """import-hf's checkpoint keeps working with the source folder gone: its run config names
    the copy in the checkpoint, which tokenizes as the source's tokenizer did."""
    from megaloop.data.tokenizers import HuggingFaceTokenizer

    folder = tmp_path / "hf"
    if kind == "ouro":
        make_ouro_folder(str(folder), seed=6)
    else:  # a dense folder: transformers' model, and a tokenizer of its table's size
        _make_hf("llama", str(folder))
        write_tokenizer(str(folder), json.load(open(folder / "config.json"))["vocab_size"])
    source = HuggingFaceTokenizer(str(folder))
    expected = (source.tokenize(TEXT), source.eod, source.vocab_size)
    ckpt = tmp_path / "ck"
    assert _import(folder, ckpt, tmp_path / "log") == 0, open(tmp_path / "log").read()
    shutil.move(str(folder), str(tmp_path / "moved_away"))
    cfg, tok = _tokenizer_of(str(ckpt))
    assert os.path.commonpath([cfg.tokenizer_model, str(ckpt)]) == str(ckpt), cfg
    assert (tok.tokenize(TEXT), tok.eod, tok.vocab_size) == expected


@pytest.mark.parametrize("eos", [0, 2])
def test_the_eos_note_appears_exactly_when_eos_is_not_the_end_of_text(tmp_path, eos):
    from megaloop.data.tokenizers import HuggingFaceTokenizer

    folder = tmp_path / "hf"
    make_ouro_folder(str(folder), seed=7, eos_token_id=eos)
    eod = HuggingFaceTokenizer(str(folder)).eod  # <|endoftext|>, id 0
    ckpt = tmp_path / "ck"
    assert _import(folder, ckpt, tmp_path / "log") == 0, open(tmp_path / "log").read()
    notes = [line for line in open(tmp_path / "log").read().splitlines() if "eos_token_id" in line]
    if eos == eod:
        assert notes == []
    else:
        settings = ckpt / "tokenizer" / "tokenizer_config.json"
        assert notes == [f"> note: config.json's eos_token_id {eos} is not the tokenizer's "
                         f"end-of-text token {eod}; megaloop separates documents and stops "
                         f"generating at {eod} (set eos_token in {settings} to change it)"]
        assert settings.is_file()  # the file the note names is there to edit


def test_the_eos_note_for_lists_missing_settings_and_null_tokenizers(tmp_path):
    from megaloop.convert.hf_import import eos_note
    from megaloop.data.config import TokenizerConfig

    write_tokenizer(str(tmp_path), 64)  # eos <|endoftext|> = 0, in its tokenizer_config.json
    hf = TokenizerConfig("HuggingFaceTokenizer", str(tmp_path))
    assert eos_note({"eos_token_id": [2, 0]}, hf) is None
    assert eos_note({"eos_token_id": None}, hf) is None and eos_note({}, hf) is None
    assert "eos_token_id [2, 1] is not the tokenizer's end-of-text token 0" in \
        eos_note({"eos_token_id": [2, 1]}, hf)
    os.remove(tmp_path / "tokenizer_config.json")  # eos found by its usual name: still 0
    note = eos_note({"eos_token_id": 2}, hf)
    assert f"write a {tmp_path / 'tokenizer_config.json'} with an eos_token" in note, note
    null = TokenizerConfig("NullTokenizer", None, 63)  # end-of-text 63
    assert eos_note({"eos_token_id": 63}, null) is None
    note = eos_note({"eos_token_id": 2}, null)
    assert "end-of-text token 63" in note and "tokenizer_config" not in note, note
    assert len(note.splitlines()) == 1
