"""What a Hugging Face folder's files say, checked before anything is built from them.

Both readers of such a folder (import-hf, and generate / serve / lm-eval on an export) go
through here:

- ``read_hf_config``: config.json is valid JSON, an object, and every number or boolean key
  megaloop reads has its JSON type (``KEY_TYPES``). The families' readers (``hf_families``,
  ``hf_looped``) then check the values; a string "4" would otherwise reach a comparison deep in
  the model's configs and stop there with a TypeError.
- ``check_folder``: the sizes config.json gives agree with the tensors in the safetensors files,
  and their float32 copies fit in this machine's memory, before a model of those sizes is
  allocated (a hidden_size of 10**12 otherwise asks the allocator for half a petabyte).
- ``SafetensorsFolder``: tensors by name, each refused by name when it holds NaN or inf (weights
  that broken would otherwise surface later as a training run "diverging").
"""

from __future__ import annotations

import glob
import json
import math
import os

import torch

from megaloop.convert import hf_huginn, hf_loopformer, hf_parcae
from megaloop.convert.tensor_readers import checked_float

INT, NUMBER, BOOL, LIST, OBJECT, STRING = (
    "an integer", "a number", "true or false", "a list", "an object", "a string")

# key -> (JSON type, least value or None, whether null is accepted) for every config.json key
# megaloop reads as a number, boolean, list or object, in a dense family's folder and in a looped
# one alike (a key means the same thing in both). Strings (model_type, norm_scheme, ...) are
# checked by value where they are read, which names the values accepted.
KEY_TYPES = {
    "architectures": (LIST, None, True),  # null: the readers refuse the architecture by name
    "vocab_size": (INT, 1, False),
    "hidden_size": (INT, 1, False),
    "intermediate_size": (INT, 1, False),
    "num_hidden_layers": (INT, 1, False),
    "num_attention_heads": (INT, 1, False),
    "num_key_value_heads": (INT, 1, True),
    "head_dim": (INT, 1, True),
    "max_position_embeddings": (INT, 1, False),
    "rms_norm_eps": (NUMBER, 0, False),
    "rope_theta": (NUMBER, None, False),
    "rope_scaling": (OBJECT, None, True),
    "rope_parameters": (OBJECT, None, True),
    "partial_rotary_factor": (NUMBER, None, False),
    "tie_word_embeddings": (BOOL, None, False),
    "initializer_range": (NUMBER, 0, False),
    "attention_dropout": (NUMBER, None, False),
    "layer_types": (LIST, None, True),
    "attention_bias": (BOOL, None, True),
    "mlp_bias": (BOOL, None, True),
    "use_sliding_window": (BOOL, None, True),
    "use_mrope": (BOOL, None, True),
    "rope_interleaved": (BOOL, None, True),
    # looped folders (Ouro's keys, then megaloop's own)
    "total_ut_steps": (INT, 1, False),
    "early_exit_threshold": (NUMBER, None, True),
    "early_exit_step": (INT, 0, True),
    "qk_norm": (BOOL, None, False),
    "qkv_bias": (BOOL, None, False),
    "num_prelude_layers": (INT, 0, False),
    "num_coda_layers": (INT, 0, False),
    "use_exit_gate": (BOOL, None, False),
    "lora_rank": (INT, 0, False),
    "lora_alpha": (NUMBER, None, True),
    "lora_steps": (INT, 0, False),
    # Huginn's (hf_huginn)
    "n_embd": (INT, 1, False),
    "n_heads": (INT, 1, False),
    "n_layers_in_prelude": (INT, 0, False),
    "n_layers_in_recurrent_block": (INT, 1, False),
    "n_layers_in_coda": (INT, 0, False),
    "mean_recurrence": (INT, 1, False),
    "mean_backprop_depth": (INT, 1, False),
    "block_size": (INT, 1, False),
    "norm_eps": (NUMBER, 0, False),
    "rope_base": (NUMBER, 1, False),
    "qk_bias": (BOOL, None, False),
    "tie_embeddings": (BOOL, None, False),
    # Parcae's (hf_parcae; its other size keys are Huginn's)
    "padded_vocab_size": (INT, 1, True),
    "padding_multiple": (INT, 1, False),
    "prelude_norm": (BOOL, None, False),
    "recurrent_embedding_dimension": (INT, 1, False),
    "recurrent_intermediation_embedding_dimension": (INT, 1, False),
    "recurrent_num_attention_heads": (INT, 1, True),
    "mup_model_scaling_factor": (INT, 1, False),
    # Nanbeige's (hf_nanbeige)
    "num_loops": (INT, 1, False),
    "skip_loop_final_norm": (BOOL, None, False),
    "loop_loss_weights": (LIST, None, True),
    "pretraining_tp": (INT, 1, False),
}
# The numbers inside rope_scaling / rope_parameters (hf_families.rope_settings reads them).
ROPE_KEY_TYPES = {
    "rope_theta": (NUMBER, None, False),
    "factor": (NUMBER, None, False),
    "low_freq_factor": (NUMBER, None, False),
    "high_freq_factor": (NUMBER, None, False),
    "original_max_position_embeddings": (INT, 1, False),
    "partial_rotary_factor": (NUMBER, None, False),
}


def _json_kind(value) -> str:
    """What a JSON value is, in the words of the refusal."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number" if math.isfinite(value) else "not a finite number"
    return "a list" if isinstance(value, list) else "an object"


def _type_error(value, spec) -> str | None:
    """Why ``value`` does not have the type ``spec`` says (None when it does)."""
    kind, least, nullable = spec
    if value is None:
        return None if nullable else f"it must be {kind}"
    if kind == BOOL:
        ok = isinstance(value, bool)
    elif kind == LIST:
        ok = isinstance(value, list)
    elif kind == OBJECT:
        ok = isinstance(value, dict)
    elif kind == STRING:
        ok = isinstance(value, str)
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        ok = False
    else:  # a JSON 4.0 is not the integer 4; NaN and Infinity are not sizes or rates
        ok = isinstance(value, int) if kind == INT else math.isfinite(value)
    if not ok:
        return f"it must be {kind}{' (or null)' if nullable else ''}"
    if least is not None and value < least:
        return f"it must be {kind} of at least {least}"
    return None


def check_key_types(path: str, cfg: dict) -> None:
    """ValueError naming ``path``, the key, its value and the type it must have, for the first
    key of ``KEY_TYPES`` (and of the RoPE dicts) whose value does not have it."""
    checks = [(key, cfg[key], spec) for key, spec in KEY_TYPES.items() if key in cfg]
    for outer in ("rope_scaling", "rope_parameters"):
        if isinstance(cfg.get(outer), dict):
            checks += [(f"{outer}.{key}", cfg[outer][key], spec)
                       for key, spec in ROPE_KEY_TYPES.items() if key in cfg[outer]]
    if isinstance(cfg.get("architectures"), list):
        checks += [(f"architectures[{i}]", name, (STRING, None, False))
                   for i, name in enumerate(cfg["architectures"])]
    for key, value, spec in checks:
        why = _type_error(value, spec)
        if why:
            shown = "null" if value is None else f"{json.dumps(value)} ({_json_kind(value)})"
            raise ValueError(f"{path}: {key} is {shown}; {why}")



def read_hf_config(hf_dir: str) -> dict:
    """config.json of ``hf_dir`` as a dict; FileNotFoundError / ValueError naming the file when
    it is missing, not valid JSON, not a JSON object, or a key has the wrong type
    (``check_key_types``)."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        # A folder holding LoopFormer's train.py checkpoint instead: its architecture, in the
        # keys of a LoopFormer config.json (hf_loopformer)
        found = hf_loopformer.checkpoint_config(hf_dir)
        if found is not None:
            return found
        raise FileNotFoundError(f"--hf-dir {hf_dir}: no config.json; pass the folder that "
                                f"save_pretrained wrote (config.json + *.safetensors)")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno} column "
                         f"{exc.colno}); copy it again from the model's source") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte {exc.start}); copy it again from the "
                         f"model's source") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds {_json_kind(cfg)}, not the object of settings "
                         f"(\"key\": value, ...) a config.json is; copy it again from the "
                         f"model's source")
    check_key_types(path, cfg)
    return cfg


# --- the safetensors files ------------------------------------------------------------------------
INDEX = "model.safetensors.index.json"  # save_pretrained's map of a sharded model's tensors


class SafetensorsFolder:
    """Read tensors by name from every *.safetensors file of a folder (lazily, one at a time)."""

    def __init__(self, hf_dir: str):
        from safetensors import safe_open

        paths = sorted(glob.glob(os.path.join(glob.escape(hf_dir), "*.safetensors")))
        if not paths:
            raise FileNotFoundError(f"--hf-dir {hf_dir}: no *.safetensors files (convert .bin "
                                    f"checkpoints with save_pretrained(safe_serialization=True))")
        _check_index(hf_dir)
        self._files = [(_open(p, safe_open), p) for p in paths]
        self.where = {name: (f, p) for f, p in self._files for name in f.keys()}

    def names(self) -> set:
        return set(self.where)

    def shape(self, name: str) -> tuple:
        """The tensor's shape, from the file's header (nothing is read)."""
        handle, _ = self.where[name]
        return tuple(handle.get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        """The tensor in float32; ValueError naming it and its file when it holds NaN or inf."""
        if name not in self.where:
            raise KeyError(f"tensor {name!r} is missing from the safetensors files")
        handle, path = self.where[name]
        return checked_float(handle.get_tensor(name), name, path)


def _check_index(hf_dir: str) -> None:
    """The shards the folder's index names are all there: a missing one is named as the file to
    copy again (otherwise the first tensor it holds would be reported missing)."""
    path = os.path.join(hf_dir, INDEX)
    if not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a readable safetensors index ({type(exc).__name__}: "
                         f"{exc}); copy it again from the model's source") from None
    missing = sorted({f for f in weight_map.values()
                      if not os.path.isfile(os.path.join(hf_dir, f))})
    if missing:
        raise FileNotFoundError(
            f"--hf-dir {hf_dir}: shard {', '.join(missing)} named by {INDEX} is missing "
            f"(tensors such as {next(k for k, v in weight_map.items() if v == missing[0])!r} "
            f"are in it); copy the folder again, every shard included")


def _open(path: str, safe_open):
    """``safe_open`` of one shard, or a message naming it: a file cut short (an interrupted
    download or copy) fails safetensors' header check with a SafetensorError."""
    from safetensors import SafetensorError

    try:
        return safe_open(path, framework="pt")
    except SafetensorError as exc:
        raise ValueError(f"{path} is truncated or corrupt ({exc}; {os.path.getsize(path):,} "
                         f"bytes): copy or download it again") from None


# --- config.json's sizes against the tensors, and against memory ---------------------------------
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")
# block prefix of the layer names -> the config.json key that counts its layers (absent: 0).
LAYER_BLOCKS = {"model.layers": "num_hidden_layers", "model.prelude": "num_prelude_layers",
                "model.coda": "num_coda_layers"}


def _expected_shapes(cfg: dict) -> list:
    """(tensor name, [(its size along each dimension, the config.json keys that say so)]): one
    tensor for every size key, in the names every family reader uses."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    groups = cfg.get("num_key_value_heads") or heads
    dim = "head_dim" if cfg.get("head_dim") else "hidden_size / num_attention_heads"
    width = (hidden, f"hidden_size {hidden}")
    return [
        ("model.embed_tokens.weight", [(cfg["vocab_size"], f"vocab_size {cfg['vocab_size']}"),
                                       width]),
        ("model.layers.0.self_attn.q_proj.weight",
         [(heads * head_dim, f"num_attention_heads {heads} x {dim} {head_dim}"), width]),
        ("model.layers.0.self_attn.k_proj.weight",
         [(groups * head_dim, f"num_key_value_heads {groups} x {dim} {head_dim}"), width]),
        ("model.layers.0.mlp.gate_proj.weight",
         [(cfg["intermediate_size"], f"intermediate_size {cfg['intermediate_size']}"), width]),
    ]


def available_memory() -> int | None:
    """Bytes this process can still allocate: MemAvailable plus free swap (Linux's
    /proc/meminfo), else the free physical pages; None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f
                    if line.split()[1:2] and line.split()[1].isdigit()}
        return info["MemAvailable"] + info.get("SwapFree", 0)
    except (OSError, KeyError, IndexError, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_folder(hf_dir: str, cfg: dict | None = None) -> SafetensorsFolder:
    """The folder's tensor reader, after checking that config.json (``cfg`` when already read)
    gives the sizes of the tensors (one tensor per size key, and the layer count of each block)
    and that the weights' float32 copies fit in memory (not checked where ``available_memory``
    cannot read it); ValueError naming the key, its value and the tensor's shape (or the sizes
    in GiB) otherwise. Only the files' headers are read."""
    path = os.path.join(hf_dir, "config.json")
    cfg = read_hf_config(hf_dir) if cfg is None else cfg
    if hf_huginn.is_huginn(cfg):  # Huginn's own tensor names and size keys
        reader = hf_huginn.check_shapes(hf_dir, cfg, SafetensorsFolder(hf_dir))
        return _check_memory(hf_dir, reader)
    if hf_parcae.is_parcae(cfg):  # Parcae's names and keys, and its torch state dict
        reader = hf_parcae.check_shapes(hf_dir, cfg, hf_parcae.open_weights(hf_dir))
        return _check_memory(hf_dir, reader)
    if hf_loopformer.is_loopformer(cfg):  # its names (prefixes stripped) or its checkpoint
        reader = hf_loopformer.check_shapes(hf_dir, cfg, hf_loopformer.open_weights(hf_dir))
        return _check_memory(hf_dir, reader)
    missing = [k for k in SIZE_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}; copy it again from the model's "
                         f"source")
    reader = SafetensorsFolder(hf_dir)
    names = reader.names()
    for tensor, dims in _expected_shapes(cfg):
        if tensor not in names:
            raise ValueError(f"{hf_dir}: tensor {tensor} is missing from the safetensors files "
                             f"(config.json says the model has one); copy the folder again")
        shape = reader.shape(tensor)
        if len(shape) != len(dims) or any(n != size for n, (size, _) in zip(shape, dims)):
            said = [why for n, (size, why) in zip(shape, dims) if n != size] or \
                [" x ".join(why for _, why in dims)]
            raise ValueError(f"{path}: {', '.join(said)} does not match the tensor {tensor}, "
                             f"whose shape is {list(shape)}; config.json and the weights come "
                             f"from different models (copy the folder again)")
    for block, key in LAYER_BLOCKS.items():
        found = {int(n.split(".")[2]) for n in names
                 if n.startswith(block + ".") and n.split(".")[2].isdigit()}
        want = cfg.get(key) or 0
        if found != set(range(want)):
            held = f"layers {block}.{min(found)} .. {block}.{max(found)} ({len(found)} in all)" \
                if found else f"no {block}.* layers"
            raise ValueError(f"{path}: {key} {want} does not match the safetensors files, which "
                             f"hold {held}; config.json and the weights come from different "
                             f"models (copy the folder again)")
    return _check_memory(hf_dir, reader)


def _check_memory(hf_dir: str, reader: SafetensorsFolder) -> SafetensorsFolder:
    """``reader`` when the folder's weights, read in float32 into a model of the same size, fit
    in this machine's free memory; ValueError with the sizes in GiB otherwise."""
    numel = sum(math.prod(reader.shape(n)) for n in reader.names())
    need, free = 2 * 4 * numel, available_memory()
    if free is not None and need > free:
        gib = 2 ** 30
        raise ValueError(f"{hf_dir}: its {numel:,} weights are read in float32 into a model of "
                         f"the same size, {need / gib:.1f} GiB together, more than the "
                         f"{free / gib:.1f} GiB of memory (and swap) this machine has free; free "
                         f"memory or use a machine with more")
    return reader
