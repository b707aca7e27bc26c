"""Loading a trained model for generation: process groups, weights, tokenizer."""

from __future__ import annotations

import os

import torch


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


def load_for_generation(load_dir: str, tp_size: int = 1):
    """(model in eval mode on this rank's device, tokenizer, saved run config) of ``load_dir``'s
    latest megaloop checkpoint (its run config names the model and the tokenizer)."""
    from megaloop.convert.hf_export import config_from_dict, load_model
    from megaloop.data.config import TokenizerConfig
    from megaloop.data.tokenizers import build_tokenizer
    from megaloop.device import current_device

    model, _, _, run = load_model(load_dir, tp_size=tp_size)
    model.to(current_device()).eval()
    tokenizer = build_tokenizer(config_from_dict(TokenizerConfig, run.get("tokenizer", {})))
    return model, tokenizer, run


def parse_prompt_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: write comma-separated token ids, e.g. "
                         f"5,6,7") from None
