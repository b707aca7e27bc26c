"""LoopFormer checkpoints in ("LoopFormer: Elastic-Depth Looped Transformers for Latent Reasoning
via Shortcut Modulation", arXiv 2602.11451). Export back is not provided.

LoopFormer is megaloop's ``--timestep-conditioning loopformer`` model with the settings of
examples/recipes/loopformer_from_scratch.sh: ``n_layer`` shared layers looped 8 times (its
forward's default route, 8 steps of 1/8; fewer loops at inference are its shorter routes,
``--timestep-inference rescaled``), 256-d sinusoidal step embeddings, adaLN scale and gate per
branch on RMS norms without a scale (``--norm-scheme magic``, eps = float32 machine epsilon, torch
RMSNorm's default), one learnable RMSNorm at readout only, learned absolute positions, no linear
bias, exact-erf GELU MLP (megaloop's activation without --swiglu is ``F.gelu``, as LoopFormer's
``nn.GELU()``), the head tied to the embedding, no exit gate (``--exit-loss last``) and no
default exit rule (LoopFormer always runs its whole route).

Two sources are read, as LoopFormer's own ``GPT.from_pretrained`` reads them:

(A) a folder without config.json holding exactly one ``*.pt`` / ``*.pth`` (train.py writes
    ``ckpt.pt``): a dict with ``model`` (or ``state_dict`` / ``model_state_dict``; else the file
    is a bare state dict), ``model_args`` (a dict) and ``config`` (a pickled
    ``models.loopformer.GPTConfig``). It is unpickled with torch's weights-only loader, the one
    class allowed besides tensors being a stand-in recording GPTConfig's fields
    (``_ConfigFields``): any other global in the pickle (code to run) refuses the file. Its
    architecture is GPTConfig's defaults, then the ``config`` object's fields, then
    ``model_args`` (train.py's dict lacks intermediate_dim; the two must agree where both
    speak); this becomes the config dict ``checkpoint_config`` returns and the rest of megaloop
    reads like a config.json (``read_hf_config`` returns it for such a folder).
(B) a Hugging Face folder, config.json + ``*.safetensors``, recognised by ``model_type:
    loopformer`` (LoopFormer's GPTConfig field; a folder without it cannot be told from GPT-2).

Tensor names lose any leading ``gpt.``, ``model.``, ``module.`` (and torch.compile's
``_orig_mod.``) however often repeated, and ``lm_head.weight`` / ``transformer.wte.weight`` fill
in for each other (tied: both present and different is refused).

Every key of the config (config.json, or the checkpoint's fields) has a role: HONOURED (a
megaloop setting; LoopFormer accepts the aliases listed, the first present wins as in its
loader), CHECKED (one value computed; another refused by name) or INERT (does not change the
logits). Any other key is refused by name. ``dropout`` is CHECKED at 0: megaloop's dropout sites
are not LoopFormer's (nor is its objective: docs/training.md), so a model trained with dropout
is not reproduced by the flags the import prints; the published model has 0.

Tokenizer: LoopFormer uses GPT-2's (tiktoken). A folder with tokenizer.json is carried as every
import does; otherwise the checkpoint gets NullTokenizer (hf_import.plan_vocab says so).
"""

from __future__ import annotations

import glob
import os
import re

import torch

from megaloop.convert.hf_families import check_roles
from megaloop.convert.layout import Heads
from megaloop.convert.tensor_readers import StateDictTensors, check_named_shapes
from megaloop.model.config import LoopConfig, ModelConfig

MODEL_TYPE = "loopformer"
NUM_LOOPS = 8  # GPT.forward's default route: steps=[1/8]*8
FREQUENCY_DIM = 256  # TimestepEmbedder's frequency_embedding_size default
EPS = torch.finfo(torch.float32).eps  # nn.RMSNorm's default eps (None: the dtype's epsilon)
PREFIXES = ("gpt.", "model.", "module.", "_orig_mod.")
GPT_CONFIG = "models.loopformer.GPTConfig"  # the class train.py pickles into 'config'
# GPTConfig's defaults: what LoopFormer's loader assumes for a key the source lacks.
DEFAULTS = {"model_type": "loopformer", "block_size": 1024, "vocab_size": 50304, "n_layer": 3,
            "n_head": 32, "n_embd": 2048, "dropout": 0.0, "bias": False,
            "intermediate_dim": 5120}
# GPTConfig field -> the config.json keys LoopFormer's loader reads for it, first present first.
ALIASES = {"block_size": ("block_size", "n_positions", "max_position_embeddings"),
           "vocab_size": ("vocab_size",), "n_layer": ("n_layer", "num_hidden_layers"),
           "n_head": ("n_head", "num_attention_heads"), "n_embd": ("n_embd", "hidden_size"),
           "dropout": ("dropout", "resid_pdrop"), "bias": ("bias",),
           "intermediate_dim": ("intermediate_dim", "n_inner")}

HONOURED = {
    "model_type": "loopformer (how a folder is recognised; another value is refused)",
    "block_size": "--max-position-embeddings (the wpe table's rows)",
    "n_positions": "--max-position-embeddings (alias of block_size)",
    "max_position_embeddings": "--max-position-embeddings (alias of block_size)",
    "vocab_size": "the embedding table's rows",
    "n_layer": "--num-layers (the looped block's layers)",
    "num_hidden_layers": "--num-layers (alias of n_layer)",
    "n_head": "--num-attention-heads",
    "num_attention_heads": "--num-attention-heads (alias of n_head)",
    "n_embd": "--hidden-size",
    "hidden_size": "--hidden-size (alias of n_embd)",
    "intermediate_dim": "--ffn-hidden-size",
    "n_inner": "--ffn-hidden-size (alias of intermediate_dim; absent: 4 n_embd)",
}
ZERO = (0, 0.0)
CHECKED = {
    "bias": ((False,), "linear biases are not supported for LoopFormer (its published model "
                       "has none; megaloop builds it with --disable-bias-linear)"),
    "dropout": (ZERO, "megaloop's dropout sites are not LoopFormer's; only 0 (the published "
                      "value) is reproduced"),
    "resid_pdrop": (ZERO, "megaloop's dropout sites are not LoopFormer's; only 0 (the "
                          "published value) is reproduced"),
}
INERT = {
    "architectures": "transformers' class name; a LoopFormer folder is told by model_type",
    "transformers_version": "the version that wrote the file",
    "torch_dtype": "storage dtype: megaloop reads fp32, training chooses --bf16",
    "dtype": "storage dtype: megaloop reads fp32, training chooses --bf16",
    "auto_map": "where the folder's own modeling code is; megaloop computes the model itself",
    "_name_or_path": "where the folder came from",
    "bos_token_id": "a tokenizer setting (the folder's tokenizer is carried along)",
    "eos_token_id": "a tokenizer / generation setting (megaloop stops at the tokenizer's "
                    "end-of-text token)",
    "pad_token_id": "a tokenizer setting",
    "use_cache": "a generation setting",
    "tie_word_embeddings": "LoopFormer's code ties the head whatever the key says (an untied "
                           "lm_head that differs is refused by its tensors)",
    "output_attentions": "what transformers returns, not what it computes",
    "output_hidden_states": "what transformers returns, not what it computes",
    "return_dict": "what transformers returns, not what it computes",
}


def is_loopformer(cfg: dict) -> bool:
    return cfg.get("model_type") == MODEL_TYPE


# --- (A) a train.py checkpoint -------------------------------------------------------------
class _ConfigFields:
    """Stands in for ``models.loopformer.GPTConfig`` while unpickling: it runs no code of the
    checkpoint's and only records the fields the pickle holds."""

    def __setstate__(self, state):
        self.fields = dict(state) if isinstance(state, dict) else {}


def checkpoint_file(folder: str) -> str | None:
    """The one ``*.pt`` / ``*.pth`` of a folder without config.json (variant A), else None;
    ValueError when there are several (which one LoopFormer would read is the user's choice)."""
    if not os.path.isdir(folder) or os.path.isfile(os.path.join(folder, "config.json")):
        return None
    found = sorted(p for ext in ("*.pt", "*.pth")
                   for p in glob.glob(os.path.join(glob.escape(folder), ext)))
    if len(found) > 1:
        raise ValueError(f"{folder} holds {len(found)} torch checkpoints "
                         f"({', '.join(os.path.basename(p) for p in found)}): keep the one to "
                         f"import (LoopFormer's train.py writes ckpt.pt)")
    return found[0] if found else None


def _safe_load(path: str):
    """The checkpoint's objects, unpickled without running any of its code."""
    try:
        with torch.serialization.safe_globals([(_ConfigFields, GPT_CONFIG)]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # (pickle, zip and mmap errors alike)
        # (torch words it "Unsupported global: GLOBAL x.y" or "unsupported GLOBAL x.y whose
        # module x is blocked", by version and by what x is)
        what = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if what:
            raise ValueError(f"{path}: refused, its pickle names {what.group(1)}, which a "
                             f"LoopFormer checkpoint does not hold (only tensors, plain values "
                             f"and {GPT_CONFIG}); it is not loaded, so nothing in it ran") from None
        raise ValueError(f"{path} is not a readable torch checkpoint ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200]}); copy or download it again") from None


def _strip(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for p in PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name


def _named_tensors(state: dict, where: str) -> dict:
    """``state`` under LoopFormer's names (prefixes stripped); ValueError when it is not a dict
    of named tensors or two names become one."""
    if not isinstance(state, dict) or \
            not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise ValueError(f"{where} does not hold a state dict of named tensors")
    out = {}
    for k, v in state.items():
        name = _strip(k)
        if name in out:
            raise ValueError(f"{where}: tensors {k!r} and another both become {name!r} once the "
                             f"prefixes {', '.join(PREFIXES)} are stripped")
        out[name] = v
    return out


class CheckpointWeights(StateDictTensors):
    """A train.py checkpoint's tensors (a ``tensor_readers`` reader) and ``config``, the config
    dict of its architecture (variant A above)."""

    def __init__(self, path: str):
        obj = _safe_load(path)
        state, fields = obj, {}
        if isinstance(obj, dict):
            for key in ("model", "state_dict", "model_state_dict"):
                if isinstance(obj.get(key), dict):
                    state = obj[key]
                    break
            conf = obj.get("config")
            if isinstance(conf, _ConfigFields):
                fields.update(conf.fields)
            elif isinstance(conf, dict):
                fields.update(conf)
            args = obj.get("model_args")
            if isinstance(args, dict):
                for key, value in args.items():
                    if key in fields and fields[key] != value and value is not None:
                        raise ValueError(f"{path}: model_args {key}={value!r} but config "
                                         f"{key}={fields[key]!r}; the checkpoint contradicts "
                                         f"itself")
                    if value is not None:  # (train.py's vocab_size None before it is set)
                        fields[key] = value
        super().__init__(_fill_tied(_named_tensors(state, path)), path)
        self.config = {**DEFAULTS, **fields}


def _fill_tied(state: dict) -> dict:
    """One side of the tied pair fills in the other, as LoopFormer's loader does."""
    state = dict(state)
    for a, b in (("lm_head.weight", "transformer.wte.weight"),
                 ("transformer.wte.weight", "lm_head.weight")):
        if a not in state and b in state:
            state[a] = state[b]
    return state


def checkpoint_config(folder: str) -> dict | None:
    """The config dict of a variant-A folder (None for any other folder)."""
    path = checkpoint_file(folder)
    return None if path is None else CheckpointWeights(path).config


class _StrippedFolder:
    """A SafetensorsFolder under LoopFormer's names (prefixes stripped, the tied pair filled)."""

    def __init__(self, reader):
        self.reader = reader
        back = {}
        for original in sorted(reader.names()):
            name = _strip(original)
            if name in back:
                raise ValueError(f"the safetensors files hold {original!r} and "
                                 f"{back[name]!r}, both {name!r} once the prefixes are stripped")
            back[name] = original
        self.back = _fill_tied(back)

    def names(self) -> set:
        return set(self.back)

    def shape(self, name: str) -> tuple:
        return self.reader.shape(self.back[name])

    def get(self, name: str) -> torch.Tensor:
        return self.reader.get(self.back[name])


def open_weights(folder: str):
    """The folder's tensor reader under LoopFormer's names: its safetensors files (B), else its
    torch checkpoint (A)."""
    from megaloop.convert.hf_folder import SafetensorsFolder

    if glob.glob(os.path.join(glob.escape(folder), "*.safetensors")):
        return _StrippedFolder(SafetensorsFolder(folder))
    path = checkpoint_file(folder)
    if path is None:
        raise FileNotFoundError(f"{folder}: no LoopFormer weights (*.safetensors with "
                                f"config.json, or one *.pt / *.pth without it)")
    return CheckpointWeights(path)


# --- the configuration ----------------------------------------------------------------------
def resolve(cfg: dict) -> dict:
    """GPTConfig's fields of ``cfg`` after every key is accounted for: the first alias present
    (LoopFormer's order), else GPTConfig's default (intermediate_dim: 4 n_embd in a config.json,
    as LoopFormer's HF loader); ValueError naming the first key refused or unknown."""
    if not is_loopformer(cfg):
        raise ValueError(f"model_type {cfg.get('model_type')!r}: only LoopFormer's model "
                         f"('loopformer') is read here")
    check_roles(cfg, "LoopFormer", lambda k: k in HONOURED or k in CHECKED or k in INERT,
                CHECKED)
    out = {}
    for field, keys in ALIASES.items():
        present = [cfg[k] for k in keys if cfg.get(k) is not None]
        out[field] = present[0] if present else DEFAULTS[field]
    if not any(cfg.get(k) is not None for k in ALIASES["intermediate_dim"]):
        # only a config.json lacks it (a checkpoint's config starts from GPTConfig's defaults):
        # LoopFormer's HF loader then takes 4 n_embd
        out["intermediate_dim"] = 4 * out["n_embd"]
    for field in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd",
                  "intermediate_dim"):
        value = out[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config {field}={value!r}: it must be an integer of at least 1")
    if out["n_embd"] % out["n_head"]:
        raise ValueError(f"config n_embd {out['n_embd']} is not divisible by n_head "
                         f"{out['n_head']}")
    return out


def configs(cfg: dict) -> tuple[ModelConfig, LoopConfig]:
    """(ModelConfig, LoopConfig) of a LoopFormer config (a config.json, or a checkpoint's fields
    from ``checkpoint_config``): the recipe's settings at its sizes. The table is built with
    exactly ``vocab_size`` rows; import-hf chooses the divisor a training run pads to."""
    c = resolve(cfg)
    model = ModelConfig(
        num_layers=c["n_layer"], hidden_size=c["n_embd"], num_attention_heads=c["n_head"],
        ffn_hidden_size=c["intermediate_dim"], kv_channels=c["n_embd"] // c["n_head"],
        max_position_embeddings=c["block_size"], position_embedding_type="learned_absolute",
        norm_scheme="magic", normalization="RMSNorm", norm_epsilon=EPS,
        disable_bias_linear=True, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, make_vocab_size_divisible_by=1)
    loop = LoopConfig(num_loops=NUM_LOOPS, timestep_conditioning="loopformer",
                      timestep_frequency_dim=FREQUENCY_DIM, timestep_inference="rescaled",
                      step_norm="rms", step_norm_placement="readout", exit_loss="last",
                      loopformer_objective=True)  # (how LoopFormer trains; evaluation: CE)
    model.validate()
    loop.validate(model.num_layers)
    return model, loop


def default_exit(cfg: dict) -> dict:
    """No default exit rule: LoopFormer's generate runs its whole route."""
    return {"exit": None, "source": None}


# --- the tensors ----------------------------------------------------------------------------
# megaloop's four modulations in LoopFormer's chunk order of adaLN_modulation.1 (gate_msa,
# gate_mlp, scale_msa, scale_mlp).
SLOTS = ("self_attn_bda.timestep_gate", "mlp_bda.timestep_gate",
         "input_layernorm.timestep_scale", "pre_mlp_layernorm.timestep_scale")
EMBEDDERS = {"time": "time_embedder", "size": "dt_embedder"}
SIMPLE = {"self_attention.linear_proj.weight": "attn.c_proj.weight",
          "mlp.linear_fc1.weight": "mlp.c_fc.weight", "mlp.linear_fc2.weight": "mlp.c_proj.weight"}


def from_loopformer(get, names: set, model: ModelConfig, loop: LoopConfig) -> dict:
    """LoopFormer tensors (read with ``get(name)``, names already stripped) -> megaloop names at
    TP = 1. Raises for a tensor nothing here reads or a head that differs from wte."""
    heads = Heads(model.num_attention_heads, model.num_attention_heads, model.kv_channels)
    d = model.hidden_size
    read = set()

    def tracked(name):
        read.add(name)
        return get(name)

    out = {"embedding.word_embeddings.weight": tracked("transformer.wte.weight"),
           "embedding.position_embeddings.weight": tracked("transformer.wpe.weight"),
           "step_norm.weight": tracked("transformer.norm_f.weight")}
    if "lm_head.weight" in names and not torch.equal(tracked("lm_head.weight"),
                                                      out["embedding.word_embeddings.weight"]):
        raise ValueError("lm_head.weight differs from transformer.wte.weight: LoopFormer's head "
                         "is tied to the embedding (an untied head is not supported)")
    for ours, theirs in EMBEDDERS.items():
        for part, index in (("in", 0), ("out", 2)):
            for x in ("weight", "bias"):
                out[f"timestep.embedder.{ours}_{part}.{x}"] = tracked(
                    f"{theirs}.mlp.{index}.{x}")
    for k in range(model.num_layers):
        ours, theirs = f"core.layers.{k}.", f"transformer.h.blocks.{k}."
        for o, t in SIMPLE.items():
            out[ours + o] = tracked(theirs + t)
        q, kk, v = tracked(theirs + "attn.c_attn.weight").split(d)
        out[ours + "self_attention.linear_qkv.weight"] = heads.fuse_qkv(q, kk, v)
        ada_w = tracked(theirs + "adaLN_modulation.1.weight")
        ada_b = tracked(theirs + "adaLN_modulation.1.bias")
        for slot, w, b in zip(SLOTS, ada_w.split(d), ada_b.split(d)):
            out[ours + slot], out[ours + slot + "_bias"] = w, b
    unused = sorted(set(names) - read)
    if unused:
        raise ValueError(f"the weights hold tensors the config does not describe: {unused[:5]}")
    return out


def check_shapes(folder: str, cfg: dict, reader):
    """``reader`` once every tensor LoopFormer's definition has, at the config's sizes, is there
    with its shape (from the headers); ValueError naming the tensor and the keys otherwise."""
    c = resolve(cfg)
    V, P, d, ffn, F = (c["vocab_size"], c["block_size"], c["n_embd"], c["intermediate_dim"],
                       FREQUENCY_DIM)
    want = {"transformer.wte.weight": ((V, d), "vocab_size x n_embd"),
            "lm_head.weight": ((V, d), "vocab_size x n_embd"),
            "transformer.wpe.weight": ((P, d), "block_size x n_embd"),
            "transformer.norm_f.weight": ((d,), "n_embd")}
    for e in EMBEDDERS.values():
        want.update({f"{e}.mlp.0.weight": ((d, F), "n_embd x 256"),
                     f"{e}.mlp.0.bias": ((d,), "n_embd"),
                     f"{e}.mlp.2.weight": ((d, d), "n_embd x n_embd"),
                     f"{e}.mlp.2.bias": ((d,), "n_embd")})
    for k in range(c["n_layer"]):
        p = f"transformer.h.blocks.{k}."
        want.update({p + "attn.c_attn.weight": ((3 * d, d), "3 n_embd x n_embd"),
                     p + "attn.c_proj.weight": ((d, d), "n_embd x n_embd"),
                     p + "mlp.c_fc.weight": ((ffn, d), "intermediate_dim x n_embd"),
                     p + "mlp.c_proj.weight": ((d, ffn), "n_embd x intermediate_dim"),
                     p + "adaLN_modulation.1.weight": ((4 * d, d), "4 n_embd x n_embd"),
                     p + "adaLN_modulation.1.bias": ((4 * d,), "4 n_embd")})
    names = reader.names()
    where = os.path.join(folder, "config.json") if os.path.isfile(
        os.path.join(folder, "config.json")) else folder
    check_named_shapes(folder, where, reader, want)
    extra = sorted(n for n in names if n.startswith("transformer.h.blocks.") and n not in want)
    if extra:
        raise ValueError(f"{where}: n_layer {c['n_layer']} does not match the weights, which "
                         f"also hold {extra[:3]}; the config and the weights come from "
                         f"different models")
    return reader
