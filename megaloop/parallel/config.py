"""Parallel layout: sizes of the tensor-, pipeline- and data-parallel groups."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal


@dataclass
class ParallelConfig:
    """Parallelism (Megatron-LM's flags)."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size: attention heads, MLP and vocabulary are split over this many ranks."""

    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size (looped pipelines are a later milestone: only 1 is accepted now)."""

    sequence_parallel: bool = False
    """Split norms and dropout over the sequence within the TP group (GPU, Transformer Engine)."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (megatron-core distributed optimizer)."""

    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with the backward pass."""

    distributed_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend: auto = nccl on GPU, gloo on CPU."""

    def world_size(self) -> int:
        """World size as the launcher announces it (torchrun/SLURM), before any group exists."""
        return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))

    def data_parallel_size(self, world_size: int | None = None) -> int:
        world = self.world_size() if world_size is None else world_size
        return world // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)

    def validate(self, num_attention_heads: int, num_query_groups: int | None,
                 world_size: int | None = None) -> None:
        world = self.world_size() if world_size is None else world_size
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if tp < 1 or pp < 1:
            raise ValueError("--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
        if world % (tp * pp):
            raise ValueError(
                f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
                f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} processes")
        if pp != 1:
            raise ValueError(
                f"--pipeline-model-parallel-size {pp}: pipeline parallelism for looped models is "
                "not implemented yet; use 1")
        if num_attention_heads % tp:
            raise ValueError(
                f"--num-attention-heads {num_attention_heads} is not divisible by "
                f"--tensor-model-parallel-size {tp}; pick a TP size that divides the head count")
        groups = num_query_groups or num_attention_heads
        if groups % tp:
            raise ValueError(
                f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp}")
        if self.sequence_parallel and tp == 1:
            raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
