"""Loading a trained model for generation: process groups, weights, tokenizer."""

from __future__ import annotations

import os
from typing import Optional

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
    config.json and *.safetensors, and no megaloop checkpoint tracker."""
    import glob

    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
            and bool(glob.glob(os.path.join(path, "*.safetensors")))
            and not os.path.isfile(os.path.join(path, CHECKPOINT_TRACKER)))


def load_for_generation(load_dir: str, tp_size: int = 1, tokenizer=None,
                        ckpt_step: Optional[int] = None):
    """(model in eval mode on this rank's device, tokenizer, run config dict) of ``load_dir``:
    a megaloop checkpoint (its latest iteration, or ``ckpt_step``; the saved run config names the
    model and the tokenizer), or a folder written by export-hf (``is_hf_folder``; config.json
    names the model, the folder's tokenizer.json the tokenizer, else ``tokenizer``, a
    TokenizerConfig, is used: it is ignored for checkpoints and for folders that have their
    own)."""
    from megaloop.checkpoint.config import config_from_dict
    from megaloop.checkpoint.load import load_model
    from megaloop.data.config import TokenizerConfig
    from megaloop.data.tokenizers import build_tokenizer
    from megaloop.device import current_device

    if is_hf_folder(load_dir):
        from megaloop.convert.hf_import import load_exported

        model, _, _, run = load_exported(load_dir, tp_size=tp_size, tokenizer=tokenizer)
    else:
        model, _, _, run = load_model(load_dir, tp_size=tp_size, iteration=ckpt_step)
    model.to(current_device()).eval()
    tokenizer = build_tokenizer(config_from_dict(TokenizerConfig, run.get("tokenizer", {})))
    return model, tokenizer, run


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
    loaded: the early-exit rule (or None); ValueError naming the flag otherwise."""
    from megaloop.inference.early_exit import parse_exit
    from megaloop.inference.kv_cache import parse_policy

    check_num_loops(num_loops, spell)
    if kv_policy != "none":
        parse_policy(kv_policy)
    rule = parse_exit(exit_text)
    check_load(load, ckpt_step, spell)
    return rule


def check_load(load: str, ckpt_step: Optional[int] = None, spell=cli_name) -> None:
    """``load`` is a directory; ``ckpt_step`` (a step of a megaloop checkpoint directory, whose
    folder the load itself checks, naming the steps there) is not given for an exported
    folder, which holds one set of weights."""
    if not os.path.isdir(load):
        raise ValueError(f"{spell('load')} {load}: no such directory")
    if ckpt_step is not None and is_hf_folder(load):
        raise ValueError(f"{spell('ckpt_step')} {ckpt_step}: {load} is an exported folder (one "
                         f"set of weights, no checkpoint steps); leave it out")
