"""Parallel layout: sizes of the tensor-, context-, pipeline- and data-parallel groups."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class ParallelConfig:
    """Parallelism (Megatron-LM's flags)."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size: attention heads, MLP and vocabulary are split over this many ranks."""

    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size: the core's layers are split over this many stages (prelude on the
    first, coda/gate/head on the last) and each micro-batch travels the ring once per loop step."""

    context_parallel_size: int = 1
    """Context-parallel size (megatron-core's CP): each sequence is split over this many ranks
    in megatron-core's load-balanced layout (2 x CP chunks, rank r keeps chunks r and
    2 x CP - 1 - r), attention runs Transformer Engine's CP ring (the looped core reuses the same
    ring at every loop step), and gradients and token counts are reduced over data x context
    parallel ranks. Needs the Transformer Engine layer spec (GPU) and --seq-length divisible by
    2 x CP."""

    decoder_first_pipeline_num_layers: Optional[int] = None
    """Uneven pipeline split (Megatron-LM's rule, applied to the core): core layers on the first
    stage, which also holds the embedding and prelude. Default: an even split."""

    decoder_last_pipeline_num_layers: Optional[int] = None
    """Uneven pipeline split: core layers on the last stage, which also holds the coda, step norm,
    exit gate and LM head. Default: an even split."""

    pipeline_balance: Literal["even", "auto"] = "even"
    """How the core's layers split over the pipeline stages when --decoder-first/last-pipeline-
    num-layers are not given: `even` (Megatron-LM's default) or `auto`, the split (and, unless
    --pipeline-first-stage-readouts is given, the steps whose LM loss moves to the first stage)
    that a replay of the schedule on a FLOP cost model of every chunk finds fastest (the last
    stage also reads out at every loop step; megaloop/parallel/balance.py). Either way the
    start-up prints the layout and its predicted bubble."""

    pipeline_first_stage_readouts: Optional[str] = None
    """Loop steps whose LM loss (head and cross-entropy) the first pipeline stage computes
    instead of the last, comma-separated (e.g. `1,3`; each below --num-loops): step t's is read
    out as step t + 1 enters the first stage, from the state it carries, and the last stage
    reads out only the step's exit gate and sends the loss weight along. The objective is
    unchanged; the last stage sheds those readouts. Needs a tied LM head, no coda and the
    recurrent step norm. Under --random-depth-mean a drawn T moves the given steps below it.
    Default: none, or under --pipeline-balance auto the steps the cost model's schedule replay
    finds fastest (megaloop/parallel/balance.py)."""

    sequence_parallel: bool = False
    """Split norms and dropout over the sequence within the TP group (GPU, Transformer Engine)."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (megatron-core distributed optimizer)."""

    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with the backward pass."""

    overlap_param_gather: bool = False
    """With --use-distributed-optimizer: all-gather the updated parameters during the next
    forward pass (each module waits for its bucket) instead of right after the optimizer step."""

    grad_reduce_in_bf16: bool = False
    """Reduce gradients over data-parallel ranks in bf16 instead of fp32 (half the traffic;
    megatron-core DDP's grad_reduce_in_fp32 off)."""

    distributed_timeout_minutes: int = 10
    """Timeout of the collectives (torch.distributed's process-group timeout)."""

    distributed_backend: Literal["nccl", "gloo", "auto"] = "nccl"
    """Collective backend (Megatron-LM's default nccl); `auto` = nccl on GPU, gloo on CPU. On a
    machine without a GPU collectives always run on gloo (nccl needs CUDA), so a Megatron-LM
    command line runs there unchanged; the start-up banner says so."""

    def world_size(self) -> int:
        """World size as the launcher announces it (torchrun/SLURM), before any group exists."""
        return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))

    def data_parallel_size(self, world_size: int | None = None) -> int:
        world = self.world_size() if world_size is None else world_size
        return world // self.model_parallel_size()

    def model_parallel_size(self) -> int:
        """Ranks that hold one replica of the model and see one stream of samples: TP x CP x PP
        (context-parallel ranks share their samples, each keeping a part of every sequence)."""
        return (self.tensor_model_parallel_size * self.context_parallel_size
                * self.pipeline_model_parallel_size)

    def validate(self, num_attention_heads: int, num_query_groups: int | None,
                 world_size: int | None = None) -> None:
        world = self.world_size() if world_size is None else world_size
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        cp = self.context_parallel_size
        if tp < 1 or pp < 1 or cp < 1:
            raise ValueError("--tensor-model-parallel-size, --context-parallel-size and "
                             "--pipeline-model-parallel-size must be >= 1")
        if world % (tp * cp * pp):
            raise ValueError(
                f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
                f"--context-parallel-size {cp} x --pipeline-model-parallel-size {pp}; launch a "
                f"multiple of {tp * cp * pp} processes")
        if num_attention_heads % tp:
            raise ValueError(
                f"--num-attention-heads {num_attention_heads} is not divisible by "
                f"--tensor-model-parallel-size {tp}; pick a TP size that divides the head count")
        groups = num_query_groups or num_attention_heads
        if groups % tp:
            raise ValueError(
                f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp}")
        if self.sequence_parallel and tp == 1:
            # Megatron-LM's rule (its Llama 3 example passes --sequence-parallel at TP=1).
            from megaloop.runtime import print_rank_0

            print_rank_0("> --sequence-parallel is off: --tensor-model-parallel-size is 1")
            self.sequence_parallel = False
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("--overlap-param-gather needs --use-distributed-optimizer (the "
                             "parameters are gathered from its shards): add it or drop "
                             "--overlap-param-gather")

    def first_stage_readout_steps(self) -> Optional[tuple]:
        """--pipeline-first-stage-readouts as sorted steps (None: not given)."""
        value = self.pipeline_first_stage_readouts
        if value is None:
            return None
        try:
            steps = tuple(sorted({int(x) for x in value.split(",") if x.strip()}))
        except ValueError:
            steps = (0,)
        if any(t < 1 for t in steps):
            raise ValueError(f"--pipeline-first-stage-readouts {value!r}: give loop steps >= 1, "
                             f"comma-separated (e.g. 1,3)")
        return steps

    def validate_pipeline(self, num_core_layers: int) -> None:
        """How the core's layers split over the stages (before any process group; the rules
        between pipeline parallelism and other features are in ``RunConfig.validate``)."""
        pp = self.pipeline_model_parallel_size
        first, last = self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers
        readouts = self.first_stage_readout_steps()
        if pp == 1:
            if first is not None or last is not None or self.pipeline_balance != "even" \
                    or readouts:
                raise ValueError("--decoder-first/last-pipeline-num-layers, --pipeline-balance "
                                 "auto and --pipeline-first-stage-readouts need "
                                 "--pipeline-model-parallel-size > 1")
            return
        if self.pipeline_balance == "auto" and (first is not None or last is not None):
            raise ValueError("--pipeline-balance auto chooses --decoder-first/last-pipeline-num-"
                             "layers itself: drop those flags, or --pipeline-balance auto")
        if pp > num_core_layers:
            raise ValueError(
                f"--pipeline-model-parallel-size {pp} exceeds the {num_core_layers} core layers "
                f"(--num-layers minus prelude and coda): every stage needs at least one core "
                f"layer; use a pipeline size <= {num_core_layers} or more layers")
        for flag, n in (("first", first), ("last", last)):
            if n is not None and n < 1:
                raise ValueError(f"--decoder-{flag}-pipeline-num-layers {n} must be >= 1")
        middle_stages = pp - (first is not None) - (last is not None)
        middle_layers = num_core_layers - (first or 0) - (last or 0)
        if first is None and last is None and self.pipeline_balance == "auto":
            return  # megaloop/parallel/balance.py picks a split the rule allows
        if first is None and last is None:
            if num_core_layers % pp:
                raise ValueError(
                    f"the {num_core_layers} core layers do not split evenly over "
                    f"--pipeline-model-parallel-size {pp}; use a pipeline size that divides "
                    f"them, or set --decoder-first-pipeline-num-layers / "
                    f"--decoder-last-pipeline-num-layers for an uneven split")
        elif middle_layers < middle_stages or (middle_stages == 0 and middle_layers != 0) \
                or (middle_stages and middle_layers % middle_stages):
            raise ValueError(
                f"--decoder-first-pipeline-num-layers {first} and --decoder-last-pipeline-num-"
                f"layers {last} leave {middle_layers} of the {num_core_layers} core layers for "
                f"{middle_stages} other stage(s); each other stage needs the same number >= 1")


@dataclass
class RecomputeConfig:
    """Activation recomputation (Megatron-LM's flags and meanings)."""

    recompute_granularity: Optional[Literal["full", "selective"]] = None
    """`full`: keep only each recomputed layer's input and rerun the layer in the backward pass;
    `selective`: recompute only the core attention (megatron-core's default module). Applies at
    every loop step."""

    recompute_method: Optional[Literal["uniform", "block"]] = None
    """With `full`: `uniform` recomputes every layer in groups of --recompute-num-layers; `block`
    recomputes the first --recompute-num-layers layers of each block on each pipeline stage
    (prelude, this stage's core layers, coda) and keeps the rest."""

    recompute_num_layers: Optional[int] = None
    """With `full`: layers per recomputed group (`uniform`) or recomputed layers per block and
    stage (`block`)."""

    def validate(self) -> None:
        g, m, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if g is None:
            if m is not None or n is not None:
                raise ValueError("--recompute-method / --recompute-num-layers need "
                                 "--recompute-granularity full")
        elif g == "full":
            if m is None or n is None:
                raise ValueError("--recompute-granularity full needs --recompute-method "
                                 "(uniform or block) and --recompute-num-layers N")
            if n < 1:
                raise ValueError(f"--recompute-num-layers {n} must be >= 1")
        elif m is not None or n is not None:
            raise ValueError("--recompute-granularity selective takes no --recompute-method or "
                             "--recompute-num-layers (it recomputes the core attention)")

    def transformer_kwargs(self) -> dict:
        """The megatron-core TransformerConfig fields (same names)."""
        return {"recompute_granularity": self.recompute_granularity,
                "recompute_method": self.recompute_method,
                "recompute_num_layers": self.recompute_num_layers}
