"""Dense-to-loop: a local Hugging Face Llama / Mistral / Qwen2 / Qwen3 folder -> a looped megaloop
checkpoint (which architectures and config.json fields: ``hf_families``).
(And, at the end of this file, ``load_exported``: a folder written by export-hf back into a model
at any TP size, for generation.)

The recipe of "Closing the Loop" (arXiv 2610.00673), section 4: the pretrained decoder becomes
the looped core (norm scheme ``pre``, as these models are pre-norm), its final norm becomes the
step norm, every core pass after the first mixes the token embedding back in (``scalar-mix``,
w = 0.99 at the start), the exit gate is
fresh, and stepwise LoRA adapters (B = 0) are optional. At T = 1 the result computes exactly the
Hugging Face model's logits.

The checkpoint is written from a single process at TP = 1: dist_checkpointing stores every tensor
by its global shape and reshards on load, so the training run loads it at any TP size. The
requested TP size only decides the vocabulary padding check and the flags printed for the run.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import asdict, dataclass, fields

import torch

from megaloop.arguments import flag_name
from megaloop.convert.hf_families import SUPPORTED, model_config_from_hf, rope_settings
from megaloop.convert.layout import Heads, from_hf, layer_from_hf, local_names
from megaloop.data.config import TokenizerConfig
from megaloop.model.config import LoopConfig, ModelConfig, padded_vocab_size


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--hf-dir {hf_dir}: no config.json; pass the folder that "
                                f"save_pretrained wrote (config.json + *.safetensors)")
    with open(path) as f:
        return json.load(f)


@dataclass
class Vocab:
    """How the training run sees the Hugging Face vocabulary."""

    table_rows: int
    """Rows of the HF embedding table (config.json's vocab_size; often above the tokenizer's)."""
    tokenizer: TokenizerConfig
    """The tokenizer the training run uses: the folder's tokenizer.json, or NullTokenizer."""
    tokenizer_vocab: int
    """The vocab size megaloop's tokenizer reports (what the trainer pads)."""
    divisible_by: int
    """--make-vocab-size-divisible-by that pads tokenizer_vocab to exactly table_rows."""

    def flags(self) -> list:
        t = self.tokenizer
        extra = ["--tokenizer-model", t.tokenizer_model] if t.tokenizer_model else \
            ["--vocab-size", str(t.vocab_size)]
        return ["--tokenizer-type", t.tokenizer_type] + extra


def padding_divisor(table_rows: int, tok_vocab: int) -> int:
    """The --make-vocab-size-divisible-by that pads ``tok_vocab`` to exactly ``table_rows``:
    ceil(tok / d) * d equals the table iff d divides it and d > table - tok. The smallest such d
    of at least 128 (Megatron-LM's usual value) when there is one."""
    lowest = max(table_rows - tok_vocab + 1, min(128, table_rows))
    return next(d for d in range(lowest, table_rows + 1) if table_rows % d == 0)


def plan_vocab(hf_dir: str, table_rows: int, tp_size: int) -> Vocab:
    """Keep the HF table as it is: choose the padding divisor so that megaloop's padding of the
    tokenizer's vocabulary lands exactly on the table size (no extra softmax columns)."""
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        from megaloop.data.tokenizers import HuggingFaceTokenizer

        tok_vocab = HuggingFaceTokenizer(hf_dir).vocab_size
        tokenizer = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer",
                                    tokenizer_model=os.path.abspath(hf_dir))
        if tok_vocab > table_rows:
            raise ValueError(f"{hf_dir}/tokenizer.json has {tok_vocab} tokens but the embedding "
                             f"table only {table_rows} rows")
    else:  # no tokenizer: ids are the table's rows (NullTokenizer reports vocab-size + 1)
        tok_vocab = table_rows
        tokenizer = TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=table_rows - 1)
    divisible_by = padding_divisor(table_rows, tok_vocab)
    if padded_vocab_size(tok_vocab, divisible_by, tp_size) != table_rows:
        raise ValueError(f"--tensor-model-parallel-size {tp_size} does not divide the vocabulary "
                         f"table ({table_rows} rows); choose a TP size that divides it")
    return Vocab(table_rows, tokenizer, tok_vocab, divisible_by)


class SafetensorsFolder:
    """Read tensors by name from every *.safetensors file of a folder (lazily, one at a time)."""

    def __init__(self, hf_dir: str):
        from safetensors import safe_open

        paths = sorted(glob.glob(os.path.join(glob.escape(hf_dir), "*.safetensors")))
        if not paths:
            raise FileNotFoundError(f"--hf-dir {hf_dir}: no *.safetensors files (convert .bin "
                                    f"checkpoints with save_pretrained(safe_serialization=True))")
        _check_index(hf_dir)
        self._files = [_open(p, safe_open) for p in paths]
        self.where = {name: f for f in self._files for name in f.keys()}

    def names(self) -> set:
        return set(self.where)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise KeyError(f"tensor {name!r} is missing from the safetensors files")
        return self.where[name].get_tensor(name).float()


INDEX = "model.safetensors.index.json"  # save_pretrained's map of a sharded model's tensors


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


def hf_state_dict(reader: SafetensorsFolder, model_cfg: ModelConfig, loop: LoopConfig,
                  progress=None) -> dict:
    """megaloop-named tensors of the HF decoder: layer i goes to the prelude for i < P, else to
    core layer i - P; the final norm becomes the step norm."""
    heads = Heads(model_cfg.num_attention_heads, model_cfg.num_query_groups,
                  model_cfg.kv_channels)
    names = reader.names()
    out = {"embedding.word_embeddings.weight": reader.get("model.embed_tokens.weight"),
           "step_norm.weight": reader.get("model.norm.weight")}
    if model_cfg.untie_embeddings_and_output_weights:
        if "lm_head.weight" not in names:
            raise ValueError("config.json says the embeddings are untied, but there is no "
                             "lm_head.weight in the safetensors files")
        out["output_layer.weight"] = reader.get("lm_head.weight")
    P = loop.num_prelude_layers
    for i in range(model_cfg.num_layers):
        prefix = f"prelude.layers.{i}." if i < P else f"core.layers.{i - P}."
        out.update(layer_from_hf(reader.get, f"model.layers.{i}.", prefix, heads, names))
        if progress is not None:
            progress.update(1)
    return out


def load_into(model, tensors: dict) -> None:
    """Copy converted tensors into a TP=1 model; everything except what the conversion adds
    (exit gate, injection scalar, LoRA adapters) must be covered, with matching shapes."""
    fresh = ("exit_gate.", "injection.", ".lora_A.", ".lora_B.")
    state = local_names(model.state_dict())  # either layer backend
    missing = [k for k in state if k not in tensors and not any(f in k for f in fresh)]
    unexpected = [k for k in tensors if k not in state]
    if missing or unexpected:
        raise ValueError(f"the Hugging Face tensors do not fit the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    with torch.no_grad():
        for k, v in tensors.items():
            if state[k].shape != v.shape:
                raise ValueError(f"{k}: the checkpoint holds shape {tuple(v.shape)}, the model "
                                 f"expects {tuple(state[k].shape)}")
            state[k].copy_(v)


def training_flags(model_cfg: ModelConfig, loop: LoopConfig, vocab: Vocab, tp_size: int,
                   load_dir: str) -> list:
    """pretrain_looplm.py flags that rebuild exactly this model (every model and loop field)."""
    flags = []
    for cfg in (model_cfg, loop):
        for f in fields(cfg):
            value = getattr(cfg, f.name)
            if value is None or not f.init or f.metadata.get("cli") is False:
                continue
            flags += [flag_name(f), str(value).lower() if isinstance(value, bool) else str(value)]
    return flags + vocab.flags() + ["--tensor-model-parallel-size", str(tp_size),
                                            "--load", load_dir, "--finetune"]


def import_hf(hf_dir: str, save_dir: str, loop: LoopConfig, *, tp_size: int = 1,
              seed: int = 1234, progress: bool = True) -> list:
    """Convert ``hf_dir`` into a megaloop checkpoint in ``save_dir`` (iteration 0) and return the
    pretrain_looplm.py flags that train it. Needs torch.distributed and megatron-core's parallel
    state at TP = 1 (``tools/convert_checkpoint.py`` starts a world of one process)."""
    from tqdm import tqdm

    from megaloop.checkpoint.save import save_weights
    from megaloop.model.looped_gpt import build_model
    from megaloop.parallel.config import ParallelConfig
    from megaloop.parallel.initialize import set_seed

    cfg = read_hf_config(hf_dir)
    vocab = plan_vocab(hf_dir, cfg["vocab_size"], tp_size)
    model_cfg = model_config_from_hf(cfg, vocab.divisible_by)
    if loop.num_coda_layers:
        raise ValueError("--num-coda-layers: import-hf keeps the decoder's final norm right before "
                         "the LM head, which a coda would move; use 0 (a prelude is fine)")
    model_cfg.validate()
    loop.validate(model_cfg.num_layers)
    set_seed(seed)  # the fresh exit gate and LoRA A matrices
    model = build_model(model_cfg, loop, vocab.tokenizer_vocab, tp_size=1)
    reader = SafetensorsFolder(hf_dir)
    with tqdm(total=model_cfg.num_layers, desc="import-hf layers", unit="layer",
              disable=not progress) as bar:
        tensors = hf_state_dict(reader, model_cfg, loop, bar)
    load_into(model, tensors)
    # The sections this conversion decides (a training run's own sections come with its flags).
    run = {"model": asdict(model_cfg), "loop": asdict(loop), "tokenizer": asdict(vocab.tokenizer),
           "parallel": asdict(ParallelConfig(tensor_model_parallel_size=tp_size))}
    save_weights(save_dir, 0, model, run_config=run)
    return training_flags(model_cfg, loop, vocab, tp_size, save_dir)


# --- A folder written by export-hf (hf_export.write_hf_folder) -> a model, for generation --------
EXPORT_ARCHITECTURES = ("MegaloopForCausalLM", "OuroForCausalLM")
# config.json keys that configuration_megaloop.py defaults (the Ouro layout): an Ouro-style
# export may lack the megaloop ones, and the modeling file reads them with these values.
EXPORT_DEFAULTS = {
    "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "initializer_range": 0.02,
    "tie_word_embeddings": False, "total_ut_steps": 4, "norm_scheme": "ouro", "qk_norm": False,
    "num_prelude_layers": 0, "num_coda_layers": 0, "step_norm_placement": "recurrent",
    "use_exit_gate": True, "input_injection": "none", "injection_source": "embedding",
    "lora_rank": 0, "lora_alpha": None, "lora_steps": 0, "qkv_bias": False, "rope_scaling": None,
}


def exported_configs(cfg: dict) -> tuple[ModelConfig, LoopConfig]:
    """(ModelConfig, LoopConfig) of an export's config.json: every key ``hf_config`` writes, read
    back (``hf_config`` of the result writes the same keys and values). ValueError for a
    config.json that is not a megaloop / Ouro export, naming what to do instead."""
    from megaloop.convert.hf_export import check_exportable

    arch = (cfg.get("architectures") or ["?"])[0]
    if arch in SUPPORTED:
        raise ValueError(f"this folder holds a dense {arch} (not a looped model exported by "
                         f"megaloop): convert it first with `tools/convert_checkpoint.py import-hf "
                         f"--hf-dir FOLDER --save CKPT ...` and pass --load CKPT")
    if arch not in EXPORT_ARCHITECTURES or cfg.get("model_type") not in ("megaloop", "ouro"):
        raise ValueError(f"config.json (architecture {arch!r}, model_type "
                         f"{cfg.get('model_type')!r}) is not a megaloop or Ouro export: --load "
                         f"reads megaloop checkpoints and folders written by "
                         f"`tools/convert_checkpoint.py export-hf` "
                         f"({' / '.join(EXPORT_ARCHITECTURES)})")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in cfg]
    if missing:
        raise ValueError(f"config.json lacks {missing}")
    c = {**EXPORT_DEFAULTS, **cfg}
    if c["hidden_act"] != "silu":
        raise ValueError(f"hidden_act {c['hidden_act']!r}: only SwiGLU (silu) MLPs are supported")
    if c.get("use_sliding_window"):
        raise ValueError("sliding-window attention is not supported")
    heads = c["num_attention_heads"]
    theta, factor = rope_settings(c)
    prelude, coda = c["num_prelude_layers"], c["num_coda_layers"]
    model_cfg = ModelConfig(
        num_layers=prelude + c["num_hidden_layers"] + coda, hidden_size=c["hidden_size"],
        ffn_hidden_size=c["intermediate_size"], num_attention_heads=heads,
        num_query_groups=c["num_key_value_heads"] or heads,
        kv_channels=c["head_dim"] or c["hidden_size"] // heads,
        max_position_embeddings=c["max_position_embeddings"], position_embedding_type="rope",
        rotary_base=theta, rotary_percent=1.0, use_rope_scaling=factor is not None,
        rope_scaling_factor=factor if factor is not None else ModelConfig.rope_scaling_factor,
        normalization="RMSNorm", norm_epsilon=c["rms_norm_eps"], swiglu=True,
        hidden_dropout=0.0, attention_dropout=0.0,  # the exported model has no dropout
        disable_bias_linear=True, add_qkv_bias=bool(c["qkv_bias"]),
        qk_layernorm=bool(c["qk_norm"]),
        untie_embeddings_and_output_weights=not c["tie_word_embeddings"],
        init_method_std=c["initializer_range"], norm_scheme=c["norm_scheme"],
        # The export keeps the (padded) table as it is: build exactly vocab_size rows.
        make_vocab_size_divisible_by=1)
    loops = c["total_ut_steps"]
    if c["lora_rank"] and c["lora_steps"] != loops:
        raise ValueError(f"config.json: lora_steps {c['lora_steps']} != total_ut_steps {loops}; "
                         f"megaloop keeps one adapter per trained loop step")
    loop = LoopConfig(
        num_loops=loops, num_prelude_layers=prelude, num_coda_layers=coda,
        step_norm_placement=c["step_norm_placement"],
        # The gate exists iff T > 1 and the objective is not "last" (LoopConfig.gated).
        exit_loss="expected" if c["use_exit_gate"] else "last",
        input_injection=c["input_injection"], injection_source=c["injection_source"],
        lora_rank=c["lora_rank"], lora_alpha=c["lora_alpha"])
    if loop.gated != bool(c["use_exit_gate"]):
        raise ValueError(f"config.json: use_exit_gate {c['use_exit_gate']} with total_ut_steps "
                         f"{loops}: a single-step model has no exit gate")
    model_cfg.validate()
    loop.validate(model_cfg.num_layers)
    check_exportable(model_cfg, loop)  # what the export (and this reader) implements
    return model_cfg, loop


def exported_tokenizer(folder: str, table_rows: int, given: TokenizerConfig | None):
    """The export's own tokenizer when it has one (its sentencepiece tokenizer.model, which the
    run tokenized with, before the tokenizer.json converted from it; else tokenizer.json), else
    ``given`` (the --tokenizer-type / --tokenizer-model / --vocab-size flags); ValueError when
    neither exists or the tokenizer has more tokens than the embedding table."""
    from megaloop.data.tokenizers import build_tokenizer

    if os.path.isfile(os.path.join(folder, "tokenizer.model")):
        tok_cfg = TokenizerConfig(tokenizer_type="SentencePieceTokenizer",
                                  tokenizer_model=os.path.abspath(
                                      os.path.join(folder, "tokenizer.model")))
    elif os.path.isfile(os.path.join(folder, "tokenizer.json")):
        tok_cfg = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer",
                                  tokenizer_model=os.path.abspath(folder))
    elif given is not None:
        tok_cfg = given
    else:
        raise ValueError(f"{folder} has no tokenizer.json or tokenizer.model (a NullTokenizer "
                         f"run, or an older export): pass --tokenizer-type and "
                         f"--tokenizer-model, or --tokenizer-type NullTokenizer --vocab-size N, "
                         f"as the run did")
    size = build_tokenizer(tok_cfg).vocab_size
    if size > table_rows:
        raise ValueError(f"the tokenizer has {size} tokens but the exported embedding table only "
                         f"{table_rows} rows; pass the tokenizer the model was trained with")
    return tok_cfg


def shard_for_rank(full: torch.Tensor, param, rank: int, world: int) -> torch.Tensor:
    """This rank's part of a full (TP=1) tensor, as megatron-core shards ``param``: along
    ``partition_dim``, each of ``partition_stride`` consecutive pieces split over the ranks (the
    inverse of gathering the shards; stride 2 is SwiGLU's [gate; up])."""
    if world == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    return torch.cat([piece.chunk(world, dim)[rank] for piece in full.chunk(stride, dim)], dim)


def load_sharded(model, tensors: dict) -> None:
    """Copy full (TP=1) tensors into ``model`` at this rank's TP size: every tensor of the model
    covered, nothing left over, each rank's slice by the parameter's sharding. The vocabulary
    table gets zero rows where the TP size needs more rows than the export holds (ids the
    tokenizer never produces; the generator never samples them)."""
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    world = parallel_state.get_tensor_model_parallel_world_size()
    state = local_names(model.state_dict())  # either layer backend
    params = local_names(dict(model.named_parameters()))
    missing = sorted(set(state) - set(tensors))
    unexpected = sorted(set(tensors) - set(state))
    if missing or unexpected:
        raise ValueError(f"the exported tensors do not fit the model config.json describes: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for k, dest in state.items():
            full = tensors[k]
            if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
                rows = dest.shape[0] * (world if getattr(params.get(k), "tensor_model_parallel",
                                                         False) else 1)
                if full.shape[0] < rows:
                    full = torch.cat([full, full.new_zeros(rows - full.shape[0],
                                                           *full.shape[1:])])
            part = shard_for_rank(full, params.get(k), rank, world)
            if part.shape != dest.shape:
                raise ValueError(f"{k}: the export holds shape {tuple(full.shape)}, which does not "
                                 f"give this rank's {tuple(dest.shape)} at TP={world}")
            dest.copy_(part)


def load_exported(folder: str, tp_size: int = 1, tokenizer: TokenizerConfig | None = None,
                  transformer_impl: str | None = None):
    """(model at TP = ``tp_size``, ModelConfig, LoopConfig, a run-config dict naming them and the
    tokenizer) of a folder written by export-hf (``hf_export.write_hf_folder``): config.json read
    back exactly (``exported_configs``), the tensors through the reverse of the export's names
    (``layout.from_hf``), each rank's TP slice cut from the full tensors; the tokenizer is the
    folder's tokenizer.json, else ``tokenizer``. The layers are ``transformer_impl``'s (an export
    does not record the backend it came from; the generation entry points choose it), None:
    ModelConfig's default.
    Collective like ``megaloop.checkpoint.load.load_model``: needs megatron-core's parallel state
    at that TP size."""
    from megaloop.model.looped_gpt import build_model

    cfg = read_hf_config(folder)
    model_cfg, loop = exported_configs(cfg)
    if transformer_impl is not None:
        model_cfg.transformer_impl = transformer_impl
    rows = cfg["vocab_size"]
    tok_cfg = exported_tokenizer(folder, rows, tokenizer)
    model = build_model(model_cfg, loop, rows, tp_size=tp_size)
    reader = SafetensorsFolder(folder)
    heads = Heads(model_cfg.num_attention_heads, model_cfg.num_query_groups,
                  model_cfg.kv_channels)
    layers = {"prelude": loop.num_prelude_layers, "coda": loop.num_coda_layers,
              "core": loop.num_core_layers(model_cfg.num_layers)}
    tensors = from_hf(reader.get, reader.names(), heads, layers)
    table = tensors.get("embedding.word_embeddings.weight")
    if table is not None and table.shape[0] != rows:
        raise ValueError(f"config.json's vocab_size {rows} differs from the {table.shape[0]} rows "
                         f"of model.embed_tokens.weight")
    load_sharded(model, tensors)
    run = {"model": asdict(model_cfg), "loop": asdict(loop), "tokenizer": asdict(tok_cfg),
           "hf_folder": os.path.abspath(folder)}
    return model, model_cfg, loop, run
