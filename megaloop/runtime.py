"""Process setup shared by every entry point that imports megatron-core.

``quiet_megatron()`` runs once, before the first megatron-core import (the warnings below fire at
import time or on first use, one copy per rank), so a run's output is its configuration and its log
lines. ``is_rank_zero()`` / ``print_rank_0()`` keep banners to one copy on a multi-rank launch, also
before the process group exists (torchrun's ``RANK`` then decides).

This module imports only the standard library: ``pretrain_looplm.py --help`` loads it without
torch or megatron-core.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

# megatron-core messages that say nothing about a megaloop run, as (message regex, category) or
# (message regex, category, the warning module's name regex).
KNOWN_WARNINGS = (
    # Printed by four modules at import where TE/apex are absent (every CPU run): megatron-core
    # then uses its torch implementations, which megaloop's CPU mode relies on.
    (r".*(Transformer Engine|Apex) .*not installed", UserWarning),
    # TransformerConfig's own default cuda_graph_scope="full" warns in __post_init__ on every
    # config megatron-core builds; megaloop never captures CUDA graphs.
    (r"full scope is deprecated", UserWarning),
    # The first TP linear backward advises CUDA_DEVICE_MAX_CONNECTIONS=1 (comm/compute overlap
    # ordering on GPU); it fires on CPU too, where the variable means nothing.
    (r"When using (async grad allreduce|sequence parallelism) it is recommended to set the "
     r"environment variable CUDA_DEVICE_MAX_CONNECTIONS", UserWarning),
    # dist_checkpointing's torch_dist loader (megatron-core 0.16.1) still calls torch's
    # deprecated DCP entry point and ShardedTensor on every --load: nothing a user can change.
    (r"`load_state_dict` is deprecated", FutureWarning),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
    # megatron-core 0.16.1's tensor-parallel gathers and scatters (logits at TP > 1 in
    # tools/generate.py, sequence parallelism, the distributed optimizer) call the collectives
    # torch 2.13 renamed: one FutureWarning per rank, nothing a user can change.
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
     FutureWarning),
    # megatron-core 0.19 warns at import that its multimodal MIMO classes are experimental
    # (imported by the models package; megaloop never builds one).
    (r".*is experimental and still under active development", UserWarning),
    # megatron-core 0.19 reads a checkpoint's common state through torch's DCP with no_dist
    # (a --load's config read before any process group): torch says it assumes one process.
    (r"torch\.distributed is disabled, unavailable or uninitialized", UserWarning),
    # ... passing torch DCP's load its storage reader positionally, which torch 2.13 warns of.
    (r"The argument order of (load|save) has been changed", UserWarning),
    # The distributed optimizer's fp32 parameter shards are views of the parameters (non-leaf
    # tensors), and megatron-core's zero_grad reads their .grad: torch warns once per rank in every
    # run with --use-distributed-optimizer. Only from that module: elsewhere it would mean a bug.
    (r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed", UserWarning,
     r"megatron\.core\.optimizer\.optimizer"),
)

# megatron-core logging records (logger name, message substring) dropped the same way. GPTDataset
# leaves path_to_cache None only for the mock dataset (--mock-data), which has nothing to cache,
# yet logs that at WARNING on every rank.
KNOWN_LOG_RECORDS = (
    ("megatron.core.datasets.gpt_dataset", "indexes because path_to_cache is None"),
    # Importing megatron-core's Megatron-FSDP package (pulled in by megatron.core.distributed,
    # which megaloop uses for DDP, not FSDP) logs at INFO which FSDP backend it would use;
    # a tool that configures logging at INFO (tools/serve.py) printed three such lines.
    ("megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision",
     "Using Megatron-FSDP without Transformer Engine"),
    ("megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer",
     "using Megatron-FSDP with Megatron"),
    ("megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp",
     "using Megatron-FSDP with Megatron"),
    # megatron-core 0.19 calls its own asynchronous checkpoint writer (the one megaloop drives,
    # megaloop.compat.async_save_options) deprecated in favour of nvidia-resiliency-ext's.
    ("megatron.core.dist_checkpointing.strategies.torch", "MCore's async save is deprecated"),
    # ... and reads a checkpoint's common.pt (which megaloop writes for 0.16's sake,
    # megaloop.compat.write_common_file) through a function it calls deprecated.
    ("megatron.core.dist_checkpointing.strategies.common", "load_common is deprecated"),
)


class _DropRecords(logging.Filter):
    def __init__(self, substring: str):
        super().__init__()
        self.substring = substring

    def filter(self, record: logging.LogRecord) -> bool:
        return self.substring not in record.getMessage()


# --attention-backend -> Transformer Engine's switches (Megatron-LM's arguments.py does the
# same). TE never reads TransformerConfig.attention_backend: it chooses its attention from these
# variables, and reads NVTE_DEBUG / NVTE_DEBUG_LEVEL when it is imported, so they are set before
# transformer_engine is imported, in every rank (a launcher's environment reaches its ranks, but
# each rank sets them again: RunConfig.validate calls set_attention_backend_env first). `auto`
# and `local` leave the environment as it is (TE then tries flash, fused and unfused in turn;
# megatron-core's LanguageModule sets and checks the same values when the model is built).
ATTENTION_BACKEND_ENV = {
    "flash": {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
    "fused": {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"},
    "unfused": {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "1"},
}


def set_attention_backend_env(backend: str, environ=None) -> dict:
    """Set TE's NVTE_* attention switches for ``--attention-backend backend`` in ``environ``
    (default: this process's environment); returns the variables set (none for auto/local)."""
    values = ATTENTION_BACKEND_ENV.get(str(backend), {})
    (os.environ if environ is None else environ).update(values)
    return dict(values)


_quieted = False


def quiet_megatron() -> None:
    """Filter megatron-core's known warnings and log records; idempotent, cheap, stdlib only."""
    global _quieted
    if _quieted:
        return
    _quieted = True
    for message, category, *module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category,
                                module=module[0] if module else "")
    for name, substring in KNOWN_LOG_RECORDS:
        logging.getLogger(name).addFilter(_DropRecords(substring))


def is_rank_zero() -> bool:
    """Global rank 0: from the process group once it exists, from torchrun's RANK before."""
    dist = sys.modules.get("torch.distributed")  # never import torch just to ask
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def print_rank_0(text: str) -> None:
    if is_rank_zero():
        print(text, flush=True)
