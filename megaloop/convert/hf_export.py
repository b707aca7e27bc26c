"""A megaloop checkpoint -> a Hugging Face folder (config.json, model.safetensors, modeling code).

The folder is served by ``hf_modeling/modeling_megaloop.py``, a self-contained plain-torch
implementation of the looped model, loaded with ``trust_remote_code=True`` through config.json's
``auto_map``. An *Ouro-style* model (the whole stack looped, Ouro norm scheme, recurrent step norm,
exit gate, no injection/LoRA/QK-norm/QKV bias/RoPE scaling) is written under Ouro's model type,
architecture name, parameter names and config keys, so tools built for Ouro checkpoints read it;
everything else uses the same names plus a few megaloop keys (prelude, coda, injection, LoRA,
``qkv_bias``); Llama 3.x RoPE scaling is written as Llama 3.x checkpoints write it
(``rope_scaling``). ``--names nanbeige`` (the default for a checkpoint imported from a Nanbeige
folder, while its architecture is still Nanbeige's) writes Nanbeige4.2's config.json, whose
auto_map names Nanbeige's own code (``hf_nanbeige``), and no modeling files. A Huginn-style
model (``hf_huginn.huginn_style``: what Huginn-0125's code computes) is written under Huginn's
config keys and tensor names (``--names huginn``, the default for such a model), whose auto_map
names Huginn's code on the Hub, and no modeling files. A Parcae-style model
(``hf_parcae.parcae_style``) is written as Parcae's save_pretrained writes one (``--names
parcae``, the default for such a model): its config.json (every field of its configuration) and
the state dict ``model.pt``, with the tokenizer's files but no token ids in config.json (Parcae's
loader passes every key to its configuration class).

The folder holds: config.json (with the tokenizer's eos = EOD, bos and pad ids),
generation_config.json (the same ids, so ``generate()`` stops at the end of a document),
model.safetensors, the two modeling files, and the run's tokenizer (``hf_tokenizer``: what
``AutoTokenizer.from_pretrained(folder)`` reads); plain ``transformers`` needs nothing else.

Vocabulary: megaloop's embedding table is padded (``--make-vocab-size-divisible-by``); the export
keeps the padded table and sets ``vocab_size`` to its row count (token ids beyond the tokenizer's
are never produced by it; their logits are those of megaloop's padding rows). ``--vocab-size N``
trims the table to the tokenizer's N real tokens instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch

from megaloop.convert import hf_huginn, hf_nanbeige, hf_parcae
from megaloop.convert.hf_families import LLAMA3_FIXED, decoder_keys
# The looped config.json's form is hf_looped's (the reader's): what the modeling file implements
# (check_exportable, re-exported here, where the tools and tests have always imported it) and the
# exit rule's keys. The export builds on it; hf_looped never imports this module.
from megaloop.convert.hf_looped import check_exportable, threshold_keys  # noqa: F401
from megaloop.convert.layout import Heads, local_names, to_hf
from megaloop.data.config import TokenizerConfig
from megaloop.model.config import LoopConfig, ModelConfig

MODELING_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_modeling")
MODELING_FILES = ("modeling_megaloop.py", "configuration_megaloop.py")


def is_ouro_style(model: ModelConfig, loop: LoopConfig) -> bool:
    return (loop.num_prelude_layers == 0 and loop.num_coda_layers == 0
            and model.norm_scheme == "ouro" and loop.step_norm_placement == "recurrent"
            and loop.gated and loop.input_injection == "none" and loop.lora_rank == 0
            and not model.qk_layernorm
            # Ouro's own modeling code has no q/k/v bias, and Ouro's models plain RoPE only.
            and not model.add_qkv_bias and not model.use_rope_scaling)


def hf_config(model: ModelConfig, loop: LoopConfig, vocab_size: int, ouro: bool) -> dict:
    """config.json: Qwen3/Llama/Ouro keys where they exist, megaloop keys for the rest."""
    prefix = "Ouro" if ouro else "Megaloop"
    cfg = {
        "architectures": [f"{prefix}ForCausalLM"],
        "model_type": "ouro" if ouro else "megaloop",
        "auto_map": {
            "AutoConfig": f"configuration_megaloop.{prefix}Config",
            "AutoModelForCausalLM": f"modeling_megaloop.{prefix}ForCausalLM",
        },
        **decoder_keys(model, loop, vocab_size),
        "total_ut_steps": loop.num_loops,
        "early_exit_threshold": 1.0,
        "norm_scheme": model.norm_scheme,
        "qk_norm": model.qk_layernorm,
        "num_prelude_layers": loop.num_prelude_layers,
        "num_coda_layers": loop.num_coda_layers,
        "step_norm_placement": loop.step_norm_placement,
        "use_exit_gate": loop.gated,
        "input_injection": loop.input_injection,
        "injection_source": loop.injection_source,
        "lora_rank": loop.lora_rank,
        "lora_alpha": loop.lora_alpha,
        "lora_steps": loop.num_loops if loop.lora_rank else 0,
        "use_sliding_window": False,
        "sliding_window": None,
        "use_cache": False,
    }
    # Written only when on, so that a model without them keeps exactly Ouro's keys.
    if model.use_rope_scaling:  # the Llama 3.x form; megatron-core fixes all but the factor
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": model.rope_scaling_factor,
                               **LLAMA3_FIXED}
    if model.add_qkv_bias:
        cfg["qkv_bias"] = True
    return cfg


def write_hf_folder(out_dir: str, model: ModelConfig, loop: LoopConfig, state: dict, *,
                    vocab_size: int | None = None, names: str = "auto",
                    dtype: torch.dtype = torch.float32,
                    tokenizer: TokenizerConfig | None = None,
                    generation: dict | None = None, parcae_keys: dict | None = None) -> dict:
    """Write the folder from a TP=1 megaloop state dict; returns the config written.
    ``tokenizer``: the run's; its files and EOD/BOS/pad ids go into the folder
    (``hf_tokenizer``). ``generation``: the run config's section of that name (the default
    exit rule import-hf read from an Ouro folder), written back as Ouro's early_exit_threshold /
    early_exit_step. ``parcae_keys``: what import-hf recorded of a Parcae folder's config.json
    (``hf_parcae.kept_keys``), written back under ``--names parcae``. Files are written 0644
    and the folders created 0755 whatever the umask: an export is often written by one account
    and served or uploaded by another."""
    from safetensors.torch import save_file

    from megaloop.convert.hf_tokenizer import special_token_ids, write_tokenizer_files
    from megaloop.data.tokenizers import build_tokenizer

    parcae = names == "parcae" or (names == "auto" and
                                   hf_parcae.parcae_style(model, loop) is None)
    if parcae:
        gaps = hf_parcae.parcae_style(model, loop)
        if gaps:
            raise ValueError(f"--names parcae needs a model Parcae's code computes; this one has "
                             f"{gaps}; use --names auto")
    huginn = not parcae and (names == "huginn" or (names == "auto" and
                                                   hf_huginn.huginn_style(model, loop) is None))
    if huginn:
        gaps = hf_huginn.huginn_style(model, loop)
        if gaps:
            raise ValueError(f"--names huginn needs a model Huginn's code computes; this one has "
                             f"{gaps}; use --names auto")
    elif not parcae:
        check_exportable(model, loop)
    # Huginn's config.json has no exit rule (its generate() takes the criterion as an argument).
    # (Parcae's neither: it runs every step.)
    exit_keys = {} if huginn or parcae else threshold_keys(generation)  # refused before writing
    nanbeige = names == "nanbeige"
    if nanbeige:
        gaps = hf_nanbeige.nanbeige_style(model, loop)
        if gaps:
            raise ValueError(f"--names nanbeige needs a model Nanbeige's code computes; this one "
                             f"has {gaps}; use --names auto")
        if exit_keys != threshold_keys(None):
            raise ValueError("--names nanbeige: Nanbeige's config.json has no exit rule, and "
                             f"this checkpoint's default is {generation.get('exit')}")
        exit_keys = {}
    tok = build_tokenizer(tokenizer) if tokenizer is not None else None
    ouro = is_ouro_style(model, loop) and not nanbeige
    if names == "ouro" and not ouro:
        raise ValueError("--names ouro needs an Ouro-style model: no prelude/coda, --norm-scheme "
                         "ouro, --step-norm-placement recurrent, an exit gate, --input-injection "
                         "none, --lora-rank 0, no --qk-layernorm, --add-qkv-bias or "
                         "--use-rope-scaling; use --names auto")
    ouro = ouro and names != "megaloop"
    state = local_names(state)  # a Transformer Engine model's fused norms under their names
    rows = state["embedding.word_embeddings.weight"].shape[0]
    if vocab_size is not None:
        if not 0 < vocab_size <= rows:
            raise ValueError(f"--vocab-size {vocab_size} must be in 1..{rows} (the table's rows)")
        for key in [*("embedding.word_embeddings.weight", "output_layer.weight"),
                    *(k for k in state if k.endswith(".value_embedding"))]:  # (vocab rows too)
            if key in state:
                state[key] = state[key][:vocab_size]
        rows = vocab_size
    if tok is not None and tok.vocab_size > rows:
        raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the exported table "
                         f"{rows} rows: --vocab-size must be at least {tok.vocab_size}")
    heads = Heads(model.num_attention_heads, model.num_query_groups or model.num_attention_heads,
                  model.kv_channels or model.hidden_size // model.num_attention_heads)
    tied = not model.untie_embeddings_and_output_weights
    exported = hf_parcae.to_parcae(state, model, loop) if parcae else \
        hf_huginn.to_huginn(state, model, loop) if huginn else to_hf(state, heads, tied)
    tensors = {k: v.detach().to("cpu", dtype).contiguous().clone() for k, v in exported.items()}
    created = []  # the folders makedirs creates (out_dir and missing parents)
    folder = os.path.abspath(out_dir)
    while not os.path.exists(folder):
        created.append(folder)
        folder = os.path.dirname(folder)
    os.makedirs(out_dir, exist_ok=True)
    # A Nanbeige folder names Nanbeige's own code (auto_map), as the released one does.
    modeling = () if nanbeige or huginn or parcae else MODELING_FILES
    weights = "model.pt" if parcae else "model.safetensors"  # (Parcae's loader reads model.pt)
    if parcae:
        cfg = hf_parcae.parcae_config(model, loop, rows, parcae_keys)
    elif huginn:  # (and Huginn's, as its released folder does)
        cfg = hf_huginn.huginn_config(model, loop, rows)
    elif nanbeige:
        cfg = hf_nanbeige.nanbeige_config(model, loop, rows)
    else:
        cfg = hf_config(model, loop, rows, ouro)
    cfg.update(exit_keys)
    written = [weights, "config.json", *modeling]
    if tok is not None:
        # The tokenizer first: its conversion is the step that can fail (a missing protobuf),
        # and it should fail before the weights are written, not leave a folder without it.
        written += write_tokenizer_files(tokenizer, tok, out_dir, model.max_position_embeddings)
    if tok is not None and not parcae:  # (Parcae's loader takes no token ids in config.json)
        cfg.update(special_token_ids(tok))  # generate() stops at EOD
        with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
            json.dump(special_token_ids(tok), f, indent=2)
        written.append("generation_config.json")
    if parcae:
        torch.save(tensors, os.path.join(out_dir, weights))
    else:
        save_file(tensors, os.path.join(out_dir, weights), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for name in modeling:
        shutil.copy(os.path.join(MODELING_DIR, name), os.path.join(out_dir, name))
    for path in created:
        os.chmod(path, 0o755)
    for name in written:
        os.chmod(os.path.join(out_dir, name), 0o644)
    return cfg


def check_out_dir(out_dir: str) -> None:
    """--output-dir (or --out) is a new or empty folder (ValueError otherwise): an export into a folder that holds
    files would mix them with its own (another model's shards or tokenizer beside this one's
    config.json) or overwrite them without a word."""
    probe = os.path.abspath(out_dir)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "is a file" if probe == os.path.abspath(out_dir) else f"is under the file {probe}"
        raise ValueError(f"--output-dir {out_dir} {where}, not a folder: choose a folder path (a new "
                         f"folder is created)")
    if probe == os.path.abspath(out_dir) and os.listdir(out_dir):
        names = sorted(os.listdir(out_dir))
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise ValueError(f"--output-dir {out_dir} is not empty (it holds {shown}): export-hf "
                         f"writes a new or empty folder; choose another --output-dir, or empty "
                         f"this one")


def export_hf(load_dir: str, out_dir: str, *, vocab_size: int | None = None,
              names: str = "auto", dtype: torch.dtype = torch.float32,
              iteration: int | None = None, tokenizer_model: str | None = None) -> dict:
    """Write the Hugging Face folder of ``load_dir``'s latest checkpoint, or that of
    ``iteration`` (see ``megaloop.checkpoint.load.load_model``), with the run's tokenizer
    (``tokenizer_model``: where its file is on this machine, when not where the run read it)."""
    from megaloop.checkpoint.config import config_from_dict, read_run_config
    from megaloop.checkpoint.load import load_model

    run = read_run_config(load_dir, iteration)
    saved_model = config_from_dict(ModelConfig, run["model"])
    saved_loop = config_from_dict(LoopConfig, run.get("loop", {}))
    if names == "parcae" or (names == "auto" and
                             hf_parcae.parcae_style(saved_model, saved_loop) is None):
        if names == "parcae" and hf_parcae.parcae_style(saved_model, saved_loop):
            raise ValueError(f"--names parcae needs a model Parcae's code computes; this one has "
                             f"{hf_parcae.parcae_style(saved_model, saved_loop)}")
    elif names == "huginn" or (names == "auto" and
                               hf_huginn.huginn_style(saved_model, saved_loop) is None):
        if names == "huginn" and hf_huginn.huginn_style(saved_model, saved_loop):
            raise ValueError(f"--names huginn needs a model Huginn's code computes; this one has "
                             f"{hf_huginn.huginn_style(saved_model, saved_loop)}")
    else:
        check_exportable(saved_model, saved_loop)  # before the slow load
    tokenizer = config_from_dict(TokenizerConfig, run.get("tokenizer", {}))
    if tokenizer_model is not None:
        tokenizer = dataclasses.replace(tokenizer, tokenizer_model=tokenizer_model)
    elif tokenizer.tokenizer_model and not os.path.exists(tokenizer.tokenizer_model):
        raise ValueError(f"the run's tokenizer {tokenizer.tokenizer_model} is not on this "
                         f"machine: pass --tokenizer-model PATH (the file the run trained with)")
    tokenizer.validate()
    model, model_cfg, loop, run = load_model(load_dir, iteration=iteration)
    if names == "auto" and run.get("source", {}).get("architecture") == \
            hf_nanbeige.ARCHITECTURE and hf_nanbeige.nanbeige_style(model_cfg, loop) is None:
        names = "nanbeige"  # an imported Nanbeige goes back to its family's layout
    return write_hf_folder(out_dir, model_cfg, loop, model.state_dict(), vocab_size=vocab_size,
                           names=names, dtype=dtype, tokenizer=tokenizer,
                           generation=run.get("generation"),
                           parcae_keys=run.get("source", {}).get("parcae_keys"))
