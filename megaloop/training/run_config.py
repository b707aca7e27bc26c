"""The whole run's configuration: one dataclass per concern, parsed from one command line.

``parse_args`` builds every config from its dataclass (megaloop.arguments derives the flags) and
``RunConfig.validate`` checks them all *before* any process group starts, so a bad flag is a
one-line error that names the flag and the fix instead of a hang or a stack trace on N ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from megaloop.arguments import add_dataclass_args, dataclass_from_args
from megaloop.data.config import DataConfig, TokenizerConfig
from megaloop.model.config import LoopConfig, ModelConfig
from megaloop.parallel.config import ParallelConfig, RecomputeConfig
from megaloop.training.config import (CheckpointConfig, LoggingConfig, OptimConfig,
                                      TrainingConfig)

SECTIONS = {
    "model": ModelConfig,
    "loop": LoopConfig,
    "parallel": ParallelConfig,
    "recompute": RecomputeConfig,
    "training": TrainingConfig,
    "optim": OptimConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
    "data": DataConfig,
    "tokenizer": TokenizerConfig,
}


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)

    def validate(self, world_size: int | None = None) -> None:
        """Every check that needs no process group; raises ValueError with the flag to change."""
        # Imported here, not at module level: both modules import torch (spiral also megatron-core),
        # and `pretrain_looplm.py --help` builds the parser from this module without either.
        from megaloop.model.spiral import validate_parallel as validate_spiral_parallel
        from megaloop.training.random_depth import validate_random_depth

        self.model.validate()
        self.loop.validate(self.model.num_layers)
        self.parallel.validate(self.model.num_attention_heads, self.model.num_query_groups,
                               world_size)
        dp = self.parallel.data_parallel_size(world_size)
        self.training.validate(dp, self.model.max_position_embeddings)
        self.parallel.validate_pipeline(self.loop.num_core_layers(self.model.num_layers),
                                        self.loop.num_loops, self.training.num_microbatches(dp))
        self.recompute.validate()
        self.optim.validate(self.training.train_iters)
        if self.optim.optimizer == "muon" and self.parallel.use_distributed_optimizer:
            raise ValueError("--optimizer muon does not support --use-distributed-optimizer (Muon "
                             "needs whole matrices; the distributed optimizer shards flat buffers "
                             "over data-parallel ranks): drop one of the two")
        self.logging.validate()
        validate_random_depth(self)
        if self.loop.exit_loss == "adaptive-gate" and self.parallel.pipeline_model_parallel_size > 1:
            raise ValueError("--exit-loss adaptive-gate (stage II) needs --pipeline-model-parallel-"
                             "size 1: only the last stage would have a trainable parameter")
        if self.logging.log_grad_norm_per_step:
            if self.parallel.pipeline_model_parallel_size > 1:
                raise ValueError("--log-grad-norm-per-step needs --pipeline-model-parallel-size 1 "
                                 "(it follows the core's calls within one module)")
            if self.recompute.recompute_granularity == "full":
                raise ValueError("--log-grad-norm-per-step cannot be used with "
                                 "--recompute-granularity full (the recomputed forward bypasses the "
                                 "per-step weight views); drop one of the two")
        if self.parallel.pipeline_model_parallel_size > 1 and (
                self.loop.history_injection != "none"
                or self.loop.timestep_conditioning == "loop-gating"):
            raise ValueError("--history-injection and --timestep-conditioning loop-gating pass "
                             "states between loop steps inside one stage: they need "
                             "--pipeline-model-parallel-size 1")
        validate_spiral_parallel(self)
        self.checkpoint.validate()
        self.tokenizer.validate()
        self.data.validate()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train a looped language model (layout P + K x T + C) on megatron-core.",
        allow_abbrev=False)
    for cls in SECTIONS.values():
        add_dataclass_args(parser, cls)
    return parser


def parse_args(argv=None) -> RunConfig:
    namespace = build_parser().parse_args(argv)
    return RunConfig(**{name: dataclass_from_args(cls, namespace)
                        for name, cls in SECTIONS.items()})
