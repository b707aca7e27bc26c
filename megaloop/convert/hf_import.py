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

import os
from dataclasses import MISSING, asdict, dataclass, fields

import torch

from megaloop.arguments import flag_name
from megaloop.convert import hf_huginn, hf_loopformer, hf_parcae
from megaloop.convert.hf_families import SUPPORTED, check_fields, model_config_from_hf
from megaloop.convert.hf_folder import SafetensorsFolder, check_folder, read_hf_config
from megaloop.convert.hf_looped import (EXPORT_ARCHITECTURES, default_exit, is_looped_config,
                                        looped_configs)
from megaloop.convert.layout import Heads, from_hf, layer_from_hf, local_names
from megaloop.data.config import TokenizerConfig
from megaloop.model.config import LoopConfig, ModelConfig, padded_vocab_size


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


# Tokenizer files a Hugging Face folder may hold: import-hf copies them next to the checkpoint,
# which then stands alone (the training run and generation read them there).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
# Files of a tokenizer import-hf does not read (it reads tokenizer.json): a folder holding one of
# these without tokenizer.json has a tokenizer that the import would otherwise replace by
# NullTokenizer.
OTHER_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt")


def plan_vocab(hf_dir: str, table_rows: int, tp_size: int) -> Vocab:
    """Keep the HF table as it is: choose the padding divisor so that megaloop's padding of the
    tokenizer's vocabulary lands exactly on the table size (no extra softmax columns). The
    tokenizer is the folder's tokenizer.json; a folder with no tokenizer files at all gets
    NullTokenizer (said in a note); one with some but not tokenizer.json is refused."""
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        from megaloop.data.tokenizers import HuggingFaceTokenizer

        tok_vocab = HuggingFaceTokenizer(hf_dir).vocab_size
        tokenizer = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer",
                                    tokenizer_model=os.path.abspath(hf_dir))
        if tok_vocab > table_rows:
            raise ValueError(f"{hf_dir}/tokenizer.json has {tok_vocab} tokens but the embedding "
                             f"table only {table_rows} rows")
    else:  # no tokenizer: ids are the table's rows (NullTokenizer reports vocab-size + 1)
        others = [name for name in TOKENIZER_FILES[1:] + OTHER_TOKENIZER_FILES
                  if os.path.isfile(os.path.join(hf_dir, name))]
        if others:
            raise ValueError(f"{hf_dir} has {', '.join(others)} but no tokenizer.json, the file "
                             f"import-hf reads the tokenizer from: copy the model's "
                             f"tokenizer.json into the folder")
        tok_vocab = table_rows
        tokenizer = TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=table_rows - 1)
        print(f"> note: {hf_dir} holds no tokenizer files: the checkpoint's tokenizer is "
              f"NullTokenizer (text is token ids, 0..{table_rows - 2} and end-of-text "
              f"{table_rows - 1}); copy the model's tokenizer.json into the folder and import "
              f"again to use it")
    divisible_by = padding_divisor(table_rows, tok_vocab)
    if padded_vocab_size(tok_vocab, divisible_by, tp_size) != table_rows:
        raise ValueError(f"--tensor-model-parallel-size {tp_size} does not divide the vocabulary "
                         f"table ({table_rows} rows); choose a TP size that divides it")
    return Vocab(table_rows, tokenizer, tok_vocab, divisible_by)


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


# Printed even at their defaults: a reader of the command sees the model's shape.
SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "num_query_groups", "kv_channels", "max_position_embeddings", "norm_scheme",
                "num_loops", "num_prelude_layers", "num_coda_layers")


def training_flags(model_cfg: ModelConfig, loop: LoopConfig, vocab: Vocab, tp_size: int,
                   load_dir: str) -> list:
    """pretrain_looplm.py flags that rebuild exactly this model: every model and loop field
    that differs from its default (the flags' defaults are the fields')."""
    flags = []
    for cfg in (model_cfg, loop):
        for f in fields(cfg):
            value = getattr(cfg, f.name)
            default = f.default if f.default is not MISSING else (
                f.default_factory() if f.default_factory is not MISSING else MISSING)
            if value is None or not f.init or f.metadata.get("cli") is False or (
                    value == default and f.name not in SHAPE_FIELDS):
                continue
            flags += [flag_name(f), str(value).lower() if isinstance(value, bool) else str(value)]
    return flags + vocab.flags() + ["--tensor-model-parallel-size", str(tp_size),
                                            "--load", load_dir, "--finetune"]


def check_source(hf_dir: str) -> tuple[dict, SafetensorsFolder]:
    """(config.json, the tensor reader) of ``hf_dir`` after what can be checked before a model is
    built: config.json's keys (a looped folder's configs, or a dense family's fields) and its
    sizes against the tensors and this machine's memory (``hf_folder.check_folder``).
    tools/convert_checkpoint.py calls it before it starts a process group, import_hf again."""
    cfg = read_hf_config(hf_dir)
    if is_looped_config(cfg):
        looped_configs(cfg)
    else:
        check_fields(cfg)  # the architecture and every key, before its sizes are compared
    return cfg, check_folder(hf_dir, cfg)


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

    cfg, reader = check_source(hf_dir)
    if is_looped_config(cfg):
        return import_looped(hf_dir, cfg, reader, save_dir, tp_size=tp_size, progress=progress)
    vocab = plan_vocab(hf_dir, cfg["vocab_size"], tp_size)
    model_cfg = model_config_from_hf(cfg, vocab.divisible_by)
    if loop.num_coda_layers:
        raise ValueError("--num-coda-layers: import-hf keeps the decoder's final norm right before "
                         "the LM head, which a coda would move; use 0 (a prelude is fine)")
    model_cfg.validate()
    loop.validate(model_cfg.num_layers)
    set_seed(seed)  # the fresh exit gate and LoRA A matrices
    model = build_model(model_cfg, loop, vocab.tokenizer_vocab, tp_size=1)
    with tqdm(total=model_cfg.num_layers, desc="import-hf layers", unit="layer",
              disable=not progress) as bar:
        tensors = hf_state_dict(reader, model_cfg, loop, bar)
    load_into(model, tensors)
    vocab = carry_tokenizer(hf_dir, save_dir, vocab)  # the run config names the copy
    # The sections this conversion decides (a training run's own sections come with its flags).
    run = {"model": asdict(model_cfg), "loop": asdict(loop), "tokenizer": asdict(vocab.tokenizer),
           "parallel": asdict(ParallelConfig(tensor_model_parallel_size=tp_size))}
    save_weights(save_dir, 0, model, run_config=run)
    return training_flags(model_cfg, loop, vocab, tp_size, save_dir)


def carry_tokenizer(hf_dir: str, save_dir: str, vocab: Vocab) -> Vocab:
    """``vocab`` with its tokenizer read from a copy of the folder's tokenizer files in
    ``save_dir/tokenizer`` (unchanged for a NullTokenizer: the folder has none)."""
    import shutil

    if vocab.tokenizer.tokenizer_type != "HuggingFaceTokenizer":
        return vocab
    target = os.path.join(os.path.abspath(save_dir), "tokenizer")
    os.makedirs(target, exist_ok=True)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copyfile(os.path.join(hf_dir, name), os.path.join(target, name))
    tokenizer = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=target)
    return Vocab(vocab.table_rows, tokenizer, vocab.tokenizer_vocab, vocab.divisible_by)


def eos_note(cfg: dict, tokenizer: TokenizerConfig) -> str | None:
    """The note import-hf prints when config.json's eos_token_id (an id, or a list of them) does
    not name the end-of-text token of the checkpoint's tokenizer, which is where megaloop
    separates documents and stops generating; None when it does, or config.json names none."""
    from megaloop.data.tokenizers import build_tokenizer

    eos = cfg.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]
    eod = build_tokenizer(tokenizer).eod
    if not ids or eod in ids:
        return None
    if tokenizer.tokenizer_type == "NullTokenizer":
        how = "NullTokenizer's end-of-text id is the one after the table's ordinary ids"
    else:
        path = os.path.join(tokenizer.tokenizer_model, "tokenizer_config.json")
        how = (f"set eos_token in {path} to change it" if os.path.isfile(path) else
               f"write a {path} with an eos_token to change it")
    shown = eos if isinstance(eos, int) else ids
    return (f"> note: config.json's eos_token_id {shown} is not the tokenizer's end-of-text "
            f"token {eod}; megaloop separates documents and stops generating at {eod} ({how})")


def import_looped(hf_dir: str, cfg: dict, reader: SafetensorsFolder, save_dir: str, *,
                  tp_size: int = 1, progress: bool = True) -> list:
    """A looped folder (Ouro's, or an export; ``cfg`` and ``reader`` from ``check_source``) -> a
    megaloop checkpoint in ``save_dir`` (iteration 0) holding every tensor of the folder (the
    exit gate included: nothing is fresh), the folder's tokenizer (copied into
    ``save_dir/tokenizer``) and its default exit rule (the run config's ``generation`` section,
    from early_exit_threshold / early_exit_step); returns the pretrain_looplm.py flags that train
    it. The loop is the folder's: config.json says how many steps, which norms and which gate
    (``hf_looped.looped_configs``)."""
    from tqdm import tqdm

    from megaloop.checkpoint.save import save_weights
    from megaloop.model.looped_gpt import build_model
    from megaloop.parallel.config import ParallelConfig

    model_cfg, loop = looped_configs(cfg)
    vocab = plan_vocab(hf_dir, table_rows(cfg), tp_size)
    model_cfg.make_vocab_size_divisible_by = vocab.divisible_by
    generation = default_exit(cfg)
    model = build_model(model_cfg, loop, vocab.tokenizer_vocab, tp_size=1)
    with tqdm(total=1, desc="import-hf tensors", disable=not progress) as bar:
        tensors = looped_tensors(cfg, reader, model_cfg, loop)
        bar.update(1)
    load_sharded(model, tensors)  # every tensor covered, nothing left over (TP = 1 here)
    vocab = carry_tokenizer(hf_dir, save_dir, vocab)
    note = eos_note(cfg, vocab.tokenizer)
    if note:
        print(note)
    run = {"model": asdict(model_cfg), "loop": asdict(loop), "tokenizer": asdict(vocab.tokenizer),
           "parallel": asdict(ParallelConfig(tensor_model_parallel_size=tp_size)),
           "generation": generation,
           "source": {"hf_folder": os.path.abspath(hf_dir),
                      "architecture": (cfg.get("architectures") or
                                       [cfg.get("_class_name") or cfg.get("model_type")])[0]}}
    if hf_parcae.is_parcae(cfg):  # what export-hf writes back into Parcae's config.json
        run["source"]["parcae_keys"] = hf_parcae.kept_keys(cfg)
    save_weights(save_dir, 0, model, run_config=run)
    if generation["exit"]:
        print(f"> default exit rule {generation['exit']} (from {generation['source']}): "
              f"generate, serve and lm-eval use it unless --exit says otherwise")
    return training_flags(model_cfg, loop, vocab, tp_size, save_dir)


def looped_tensors(cfg: dict, reader: SafetensorsFolder, model_cfg: ModelConfig,
                   loop: LoopConfig) -> dict:
    """A looped folder's tensors under megaloop's names at TP = 1: Huginn's names through
    ``hf_huginn``, Parcae's through ``hf_parcae``, every other looped layout through
    ``layout.from_hf``."""
    if hf_huginn.is_huginn(cfg):
        return hf_huginn.from_huginn(reader.get, reader.names(), model_cfg, loop)
    if hf_parcae.is_parcae(cfg):
        return hf_parcae.from_parcae(reader.get, reader.names(), model_cfg, loop)
    if hf_loopformer.is_loopformer(cfg):
        return hf_loopformer.from_loopformer(reader.get, reader.names(), model_cfg, loop)
    heads = Heads(model_cfg.num_attention_heads, model_cfg.num_query_groups,
                  model_cfg.kv_channels)
    layers = {"prelude": loop.num_prelude_layers, "coda": loop.num_coda_layers,
              "core": loop.num_core_layers(model_cfg.num_layers)}
    return from_hf(reader.get, reader.names(), heads, layers)


def table_rows(cfg: dict) -> int:
    """The embedding table's rows of a looped config.json: vocab_size, or Parcae's
    padded_vocab_size (its tables are padded; its vocab_size is the tokenizer's)."""
    return hf_parcae.table_rows(cfg) if hf_parcae.is_parcae(cfg) else cfg["vocab_size"]


# --- A looped folder (export-hf's, or Ouro's) -> a model, for generation --------------------------
def exported_configs(cfg: dict) -> tuple[ModelConfig, LoopConfig]:
    """(ModelConfig, LoopConfig) of a looped folder's config.json (``hf_looped.looped_configs``);
    ValueError for a config.json that is not one, naming what to do instead (a dense family:
    import-hf converts it)."""
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch in SUPPORTED:
        raise ValueError(f"this folder holds a dense {arch} (not a looped model): convert it "
                         f"first with `tools/convert_checkpoint.py import-hf --hf-dir FOLDER "
                         f"--save CKPT ...` and pass --load CKPT")
    if not is_looped_config(cfg):
        raise ValueError(f"config.json (architecture {arch!r}, model_type "
                         f"{cfg.get('model_type')!r}) is not a megaloop or Ouro export: --load "
                         f"reads megaloop checkpoints and looped Hugging Face folders "
                         f"({' / '.join(EXPORT_ARCHITECTURES)})")
    return looped_configs(cfg)


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
                  transformer_impl: str | None = None, precision: str = "fp32"):
    """(model at TP = ``tp_size``, ModelConfig, LoopConfig, a run-config dict naming them and the
    tokenizer) of a folder written by export-hf (``hf_export.write_hf_folder``): config.json read
    back exactly (``exported_configs``), the tensors through the reverse of the export's names
    (``layout.from_hf``), each rank's TP slice cut from the full tensors; the tokenizer is the
    folder's tokenizer.json, else ``tokenizer``. The layers are ``transformer_impl``'s (an export
    does not record the backend it came from; the generation entry points choose it), None:
    ModelConfig's default. The model is built for inference in ``precision`` (fp32, bf16 or
    fp16: megaloop.model.inference_model.build_inference_model), the tensors rounded into it.
    Collective like ``megaloop.checkpoint.load.load_model``: needs megatron-core's parallel state
    at that TP size."""
    from megaloop.model.inference_model import build_inference_model

    cfg = read_hf_config(folder)
    model_cfg, loop = exported_configs(cfg)
    if transformer_impl is not None:
        model_cfg.transformer_impl = transformer_impl
    reader = check_folder(folder, cfg)  # sizes against the tensors and memory, before building
    rows = table_rows(cfg)
    tok_cfg = exported_tokenizer(folder, rows, tokenizer)
    model = build_inference_model(model_cfg, loop, rows, tp_size=tp_size, precision=precision)
    load_sharded(model, looped_tensors(cfg, reader, model_cfg, loop))
    run = {"model": asdict(model_cfg), "loop": asdict(loop), "tokenizer": asdict(tok_cfg),
           "hf_folder": os.path.abspath(folder), "generation": default_exit(cfg)}
    return model, model_cfg, loop, run
