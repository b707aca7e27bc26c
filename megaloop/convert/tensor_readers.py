"""Reading a folder's tensors by name, one interface for every file kind import-hf meets.

A reader has ``names()``, ``shape(name)`` (from a file's header where the format has one) and
``get(name)``: the tensor in float32, refused by name when it holds NaN or inf (a corrupt copy,
or weights saved after training diverged). ``hf_folder.SafetensorsFolder`` reads *.safetensors
files; ``StateDictTensors`` holds a torch state dict loaded from one file (Parcae's model.pt,
LoopFormer's ckpt.pt). ``check_named_shapes`` compares a config's sizes with the tensors' before
a model is built, so a folder whose config.json and weights disagree is refused by key.
"""

from __future__ import annotations

import torch


def checked_float(tensor: torch.Tensor, name: str, where: str) -> torch.Tensor:
    """``tensor`` in float32; ValueError naming it and ``where`` it came from when it holds NaN
    or inf."""
    tensor = tensor.float()
    bad = tensor.numel() - int(torch.isfinite(tensor).sum())
    if bad:
        raise ValueError(f"{where}: tensor {name} holds {bad} NaN or infinite value(s) of "
                         f"{tensor.numel()}: these weights are broken (a corrupt copy, or saved "
                         f"after training diverged); use a good copy of the model")
    return tensor


class StateDictTensors:
    """A state dict of named tensors read from ``path`` (held, memory-mapped where loaded so)."""

    def __init__(self, state: dict, path: str):
        self.state, self.path = state, path

    def names(self) -> set:
        return set(self.state)

    def shape(self, name: str) -> tuple:
        return tuple(self.state[name].shape)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise KeyError(f"tensor {name!r} is missing from {self.path}")
        return checked_float(self.state[name], name, self.path)


def check_named_shapes(source: str, where: str, reader, want: dict, blocks: dict = None,
                       files: str = "the weights") -> None:
    """ValueError unless every tensor of ``want`` ({name: (shape, the config keys that size
    it)}) is in ``reader`` with that shape, and each block of ``blocks`` ({(name prefix, config
    key): count}) holds layers 0..count-1. ``source``: the folder (a missing tensor),
    ``where``: the config file (a size that differs), ``files``: how the weights are named."""
    names = reader.names()
    for tensor, (shape, keys) in want.items():
        if tensor not in names:
            raise ValueError(f"{source}: tensor {tensor} is missing from {files}; copy the "
                             f"folder again")
        if tuple(reader.shape(tensor)) != tuple(shape):
            raise ValueError(f"{where}: {keys} = {list(shape)} does not match the tensor {tensor}, "
                             f"whose shape is {list(reader.shape(tensor))}; config.json and the "
                             f"weights come from different models (copy the folder again)")
    for (block, key), count in (blocks or {}).items():
        found = {int(n.split(".")[2]) for n in names
                 if n.startswith(block + ".") and n.split(".")[2].isdigit()}
        if found != set(range(count)):
            raise ValueError(f"{where}: {key} {count} does not match {files}, which hold "
                             f"{len(found)} {block}.* layers; config.json and the weights come "
                             f"from different models (copy the folder again)")
