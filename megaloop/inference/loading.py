"""Loading a trained model for generation: process groups, weights, tokenizer."""

from __future__ import annotations

import os
import sys
from typing import Optional

from megaloop import runtime
from megaloop.checkpoint.tracker import TRACKER
from megaloop.inference.flags import check_num_loops, cli_name


def setup_processes(seed: int = 1234) -> int:
    """One process, or a torchrun launch whose ranks are all tensor parallel; returns TP."""
    from megaloop import cpu_shim
    from megaloop.parallel.config import ParallelConfig
    from megaloop.parallel.initialize import initialize, initialize_single_process

    cpu_shim.enable()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        initialize_single_process(seed=seed)
    else:
        initialize(ParallelConfig(tensor_model_parallel_size=world), seed)
    return world


CHECKPOINT_TRACKER = TRACKER  # (the name tools and tests know)


def is_hf_folder(path: str) -> bool:
    """A folder written by ``tools/convert_checkpoint.py export-hf`` (or any Hugging Face folder):
    config.json and *.safetensors (or the torch state dict of a Parcae folder, model.pt or
    pytorch_model.bin), or no config.json and LoopFormer's train.py checkpoint (``*.pt`` /
    ``*.pth``: megaloop.convert.hf_loopformer), and no megaloop checkpoint tracker."""
    import glob

    from megaloop.convert.hf_parcae import weights_file

    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, CHECKPOINT_TRACKER)):
        return False
    if not os.path.isfile(os.path.join(path, "config.json")):
        return any(glob.glob(os.path.join(glob.escape(path), ext)) for ext in ("*.pt", "*.pth"))
    return (bool(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
            or weights_file(path) is not None)


# The layer backend tools/generate.py and tools/serve.py build unless told otherwise. The server
# runs only it: it batches rows of different lengths, left-padded under a mask that Transformer
# Engine's attention drops in decode (Generator's engine then forwards rows of one length apart,
# the ``grouped`` layout of megaloop/inference/engine.py, which a server's mix would make
# nearly one forward per request).
GENERATION_IMPL = "local"
GENERATION_IMPLS = ("local", "transformer_engine")


def check_transformer_impl(value: Optional[str], engine: bool, spell=cli_name) -> str:
    """The layer backend to load with: ``value`` (--transformer-impl; None: GENERATION_IMPL).
    ValueError naming the value where the entry point cannot run it: Transformer Engine under
    the batching engine (``engine``), or on a machine without a GPU or without TE (where it
    would build the local layers after all)."""
    if value is None:
        return GENERATION_IMPL
    if value not in GENERATION_IMPLS:
        raise ValueError(f"{spell('transformer_impl')} {value}: choose one of "
                         f"{', '.join(GENERATION_IMPLS)}")
    if value == "transformer_engine":
        import importlib.util

        import torch

        if engine:
            raise ValueError(f"{spell('transformer_impl')} transformer_engine: the server "
                             f"batches rows of different lengths under an attention mask, "
                             f"which Transformer Engine's attention ignores in decode; leave "
                             f"the flag out (local: a checkpoint saved with transformer_engine "
                             f"loads into it by name)")
        if not torch.cuda.is_available():
            raise ValueError(f"{spell('transformer_impl')} transformer_engine: its kernels "
                             f"need a GPU, and this machine has none; leave the flag out "
                             f"(local)")
        if importlib.util.find_spec("transformer_engine") is None:
            raise ValueError(f"{spell('transformer_impl')} transformer_engine: Transformer "
                             f"Engine is not installed; install it, or leave the flag out "
                             f"(local)")
    return value


def load_for_generation(load_dir: str, tp_size: int = 1, tokenizer=None,
                        ckpt_step: Optional[int] = None, transformer_impl: Optional[str] = None,
                        purpose: str = "generating", precision=None, spell=cli_name):
    """(model in eval mode on this rank's device, tokenizer, run config dict) of ``load_dir``:
    a megaloop checkpoint (its latest iteration, or ``ckpt_step``; the saved run config names the
    model and the tokenizer), or a folder written by export-hf (``is_hf_folder``; config.json
    names the model, the folder's tokenizer.json the tokenizer, else ``tokenizer``, a
    TokenizerConfig, is used: it is ignored for checkpoints and for folders that have their
    own). The layers are ``transformer_impl``'s (checked by ``check_transformer_impl``), whatever
    the checkpoint was saved with: both backends save the same tensor names; where the saved
    flag would build other layers on this machine, rank 0 says so in one line on stderr,
    beginning with ``purpose`` (``_backend_note``: the flag's value, not a claim about the
    layers its run built). None:
    the backend the checkpoint was saved with (an export: ModelConfig's default), resolved on
    this machine (megaloop.model.config.use_transformer_engine). The model is held in the
    precision ``precision`` (a megaloop.inference.precision.PrecisionConfig; None: no flag) asks
    for, else the default rule's (``resolve_precision``: on a GPU the checkpoint's, on CPU fp32),
    its flags named as ``spell`` writes them."""
    from megaloop.checkpoint.config import config_from_dict
    from megaloop.data.config import TokenizerConfig
    from megaloop.data.tokenizers import build_tokenizer
    from megaloop.device import current_device
    from megaloop.inference.precision import resolve_precision, trained_precision

    dtype = resolve_precision(precision, *trained_precision(load_dir, ckpt_step), spell=spell)
    if is_hf_folder(load_dir):
        from megaloop.convert.hf_import import load_exported

        model, _, _, run = load_exported(load_dir, tp_size=tp_size, tokenizer=tokenizer,
                                         transformer_impl=transformer_impl, precision=dtype)
    else:
        model, run, saved = _load_checkpoint(load_dir, tp_size, ckpt_step, transformer_impl,
                                             dtype)
        note = _backend_note(transformer_impl, saved)
        if note and runtime.is_rank_zero():
            print(f"{purpose} with --transformer-impl {transformer_impl}: {note}",
                  file=sys.stderr, flush=True)
    model.to(current_device()).eval()
    tokenizer = build_tokenizer(config_from_dict(TokenizerConfig, run.get("tokenizer", {})))
    return model, tokenizer, run


def _backend_note(impl: Optional[str], saved: str) -> Optional[str]:
    """The line's text when the layers loaded (``impl``; None: the saved flag's) are not those
    the checkpoint's flag ``saved`` builds on this machine, else None: there is then nothing to
    say (on CPU every flag builds the local layers).

    The run config records the flag's value, not the layers its run built: Megatron-LM's
    default ``transformer_engine`` (and ``auto``) built Transformer Engine's layers on a GPU
    but the local ones on CPU, and which machine trained is not recorded. So the line names
    the flag and claims a backend only for ``local``, which builds the local layers anywhere."""
    from megaloop.model.config import ModelConfig, use_transformer_engine

    if impl is None:
        return None
    here = "transformer_engine" if use_transformer_engine(
        ModelConfig(transformer_impl=saved)) else "local"
    if impl == here:
        return None
    if saved == "local":
        return "the checkpoint was trained with the local layers; the weights map by name"
    where = "on a GPU with Transformer Engine installed" if saved == "auto" else "on a GPU"
    return (f"the checkpoint's run config says --transformer-impl {saved}, which builds "
            f"Transformer Engine's layers {where} and the local ones on CPU (which its run "
            f"built is not recorded); either's weights map onto {impl}'s by name")


def _load_checkpoint(load_dir: str, tp_size: int, iteration: Optional[int],
                     transformer_impl: Optional[str], precision: str = "fp32"):
    """(model, run config, the transformer_impl the run config was saved with): load_model's
    steps with the layer backend replaced (unless None), since the saved one is what the
    training machine could run (Megatron-LM's default transformer_engine, even for a run on
    CPU), not what this entry point can; the model built for inference in ``precision``
    (megaloop.model.inference_model.build_inference_model)."""
    from megatron.core import dist_checkpointing

    from megaloop.checkpoint.config import config_from_dict, read_run_config
    from megaloop.checkpoint.load import load_weights
    from megaloop.checkpoint.tracker import checkpoint_dir, read_tracker
    from megaloop.model.config import LoopConfig, ModelConfig
    from megaloop.model.inference_model import build_inference_model

    run = read_run_config(load_dir, iteration)
    fp8 = run["model"].get("fp8_format")
    if fp8 is not None:
        # Decoding multiplies rows x 1 tokens; Transformer Engine's FP8 GEMMs need multiples of 16.
        run["model"]["fp8_format"] = None
        if runtime.is_rank_zero():
            print(f"loading without the checkpoint's --fp8-format {fp8}: inference runs in "
                  f"{precision} (FP8 GEMMs refuse the token counts of decoding)",
                  file=sys.stderr, flush=True)
    saved = run["model"].get("transformer_impl", ModelConfig.transformer_impl)
    run["model"]["transformer_impl"] = transformer_impl or saved
    model_cfg = config_from_dict(ModelConfig, run["model"])
    loop = config_from_dict(LoopConfig, run["loop"])
    # The padded table size is in the checkpoint itself (as load_model reads it).
    path = checkpoint_dir(load_dir, read_tracker(load_dir) if iteration is None else iteration)
    rows = dist_checkpointing.load_tensors_metadata(path)[
        "embedding.word_embeddings.weight"].global_shape[0]
    model = build_inference_model(model_cfg, loop, rows, tp_size=tp_size, precision=precision)
    load_weights(load_dir, model, iteration=iteration)
    return model, run, saved


def context_length(run: dict):
    """The model's context in tokens (its --max-position-embeddings; None if the run config does
    not say): what a prompt and the tokens generated after it must fit in."""
    value = run.get("model", {}).get("max_position_embeddings")
    return int(value) if value else None


def parse_prompt_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: write comma-separated token ids, e.g. "
                         f"5,6,7") from None


def check_generation_flags(load: str, kv_policy: str, exit_text, num_loops=None,
                           spell=cli_name, ckpt_step: Optional[int] = None):
    """The flags generate.py, serve.py and the lm-eval adapter share, checked before any model is
    loaded: the early-exit rule (or None); ValueError naming the flag otherwise. Without
    ``exit_text`` (the flag not given) the rule is the model's own default (``default_exit_rule``:
    an imported Ouro folder's early_exit_threshold), announced in one line on rank 0's stderr;
    ``none`` is full depth whatever the model says."""
    from megaloop.inference.early_exit import parse_exit
    from megaloop.inference.kv_cache import parse_policy

    check_num_loops(num_loops, spell)
    if kv_policy != "none":
        parse_policy(kv_policy)
    rule = parse_exit(exit_text)
    check_load(load, ckpt_step, spell)
    if exit_text is None:
        text, source = default_exit_rule(load, ckpt_step)
        if text:
            rule = parse_exit(text)
            if runtime.is_rank_zero():
                print(f"early exit {text} from the model ({source}); {spell('exit')} none for "
                      f"full depth, or {spell('exit')} RULE for another", file=sys.stderr,
                      flush=True)
    return rule


def default_exit_rule(load: str, ckpt_step: Optional[int] = None):
    """(rule text, where it came from) of the model in ``load``, or (None, None): a looped
    Hugging Face folder's early_exit_step / early_exit_threshold
    (``megaloop.convert.hf_looped.default_exit``), or a checkpoint run config's ``generation``
    section (written by import-hf of such a folder and passed on by the runs that trained from
    it). A checkpoint that cannot be read here answers (None, None): its load says why."""
    if is_hf_folder(load):
        from megaloop.convert.hf_import import read_hf_config
        from megaloop.convert.hf_looped import default_exit, is_looped_config

        cfg = read_hf_config(load)
        generation = default_exit(cfg) if is_looped_config(cfg) else {}
    else:
        from megaloop.checkpoint.config import read_run_config

        runtime.quiet_megatron()  # reading a checkpoint imports megatron-core (its warnings)
        try:
            generation = read_run_config(load, ckpt_step).get("generation") or {}
        except (OSError, ValueError, KeyError, RuntimeError):
            return None, None  # the load itself reports an unreadable checkpoint by name
    return generation.get("exit"), generation.get("source")


def check_load(load: str, ckpt_step: Optional[int] = None, spell=cli_name) -> None:
    """``load`` is a directory; ``ckpt_step`` (a step of a megaloop checkpoint directory, whose
    folder the load itself checks, naming the steps there) is not given for an exported
    folder, which holds one set of weights; an exported folder's config.json agrees with its
    tensors (``megaloop.convert.hf_folder.check_folder``)."""
    if not os.path.isdir(load):
        raise ValueError(f"{spell('load')} {load}: no such directory")
    if ckpt_step is not None and is_hf_folder(load):
        raise ValueError(f"{spell('ckpt_step')} {ckpt_step}: {load} is an exported folder (one "
                         f"set of weights, no checkpoint steps); leave it out")
    if is_hf_folder(load):
        from megaloop.convert.hf_folder import check_folder

        # config.json's types and sizes against the tensors and memory, before the process
        # groups and the model (whose allocation a wrong size would otherwise break). A missing
        # shard is bad input like the rest: the entry points refuse ValueErrors in one line.
        try:
            check_folder(load)
        except FileNotFoundError as exc:
            raise ValueError(str(exc)) from None
