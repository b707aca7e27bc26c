"""Constructing Transformer Engine's modules on a machine without a GPU (structure tests only).

TE 2.11's PyTorch modules import without an NVIDIA driver, and megatron-core's TE layer spec
builds from them on the CPU shim (megaloop.cpu_shim): their parameters, state dicts, sharded state
dicts, extra state and dist-checkpointing save / load are plain torch. One thing stops the
construction: TE's base module (``TransformerEngineBaseModule``, under every TE linear and norm)
asserts ``torch.cuda.is_available()`` in its ``__init__``. ``te_modules_constructible()`` answers
True to that question *during that call only*, so nothing else sees a GPU (the shim stays on,
megaloop still resolves the local spec unless told otherwise). No TE kernel can run: the first one
fails without a driver, and ``DotProductAttention`` asserts CUDA inputs.

    with te_modules_constructible():
        model = LoopedGPTModel(..., use_te=True)

The patch is on the class, so ranks forked inside the ``with`` inherit it (tests/distributed.py
forks them). Importing this module does not import TE: megaloop never requires it.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def te_modules_constructible():
    """Within: TE modules can be constructed without a GPU (``torch.cuda.is_available()``
    answers True inside ``TransformerEngineBaseModule.__init__`` only). Needs TE installed."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule as base

    original = base.__dict__["__init__"]

    def init(self, *args, **kwargs):
        answer = torch.cuda.is_available
        torch.cuda.is_available = lambda: True
        try:
            original(self, *args, **kwargs)
        finally:
            torch.cuda.is_available = answer

    base.__init__ = init
    try:
        yield
    finally:
        base.__init__ = original
