"""The whole run's configuration: one dataclass per concern, parsed from one command line.

``parse_args`` builds every config from its dataclass (megaloop.arguments derives the flags) and
``RunConfig.validate`` checks them all *before* any process group starts, so a bad flag is a
one-line error that names the flag and the fix instead of a hang or a stack trace on N ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from megaloop.arguments import (ArgumentParser, FlagCheck, add_dataclass_args,
                                add_refused_flags, check_ranges, dataclass_from_args)
from megaloop.data.config import DataConfig, TokenizerConfig
from megaloop.model.config import LoopConfig, ModelConfig
from megaloop.parallel.config import ParallelConfig, RecomputeConfig
from megaloop.training.config import (CheckpointConfig, LoggingConfig, OptimConfig,
                                      TrainingConfig)

# The smallest value of every size, count and interval flag (None = unset is not checked): a 0
# here otherwise ends in a ZeroDivisionError or an empty tensor inside megatron-core.
SIZE_LIMITS = {
    "model": {"num_layers": 1, "hidden_size": 1, "ffn_hidden_size": 1, "num_attention_heads": 1,
              "num_query_groups": 1, "kv_channels": 1, "max_position_embeddings": 1,
              "make_vocab_size_divisible_by": 1, "fp8_margin": 0, "fp8_amax_history_len": 1,
              "num_layers_at_start_in_bf16": 0, "num_layers_at_end_in_bf16": 0},
    "loop": {"num_loops": 1, "num_prelude_layers": 0, "num_coda_layers": 0, "history_window": 1,
             "mesh_slots": 0, "lora_rank": 0, "random_depth_max": 0,
             "truncated_backprop_steps": 0, "loop_readout_chunk_tokens": 1},
    "parallel": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                 "context_parallel_size": 1},
    "recompute": {"recompute_num_layers": 1},
    "training": {"seq_length": 1, "micro_batch_size": 1, "global_batch_size": 1,
                 "train_iters": 0, "eval_interval": 1, "eval_iters": 0,
                 "max_skipped_steps_in_a_row": 1},
    "optim": {"lr_warmup_iters": 0, "lr_decay_iters": 1, "lr_wsd_decay_iters": 1,
              "lr_warmup_samples": 0, "lr_decay_samples": 1, "lr_wsd_decay_samples": 1,
              "muon_num_ns_steps": 1},
    "logging": {"log_interval": 1, "loss_spike_window": 1, "p0_collapse_iters": 1},
    "checkpoint": {"save_interval": 1, "ckpt_step": 0, "exit_interval": 1},
    "data": {"num_workers": 0},
    "tokenizer": {"vocab_size": 1},
}

# Megatron-LM flags of features megaloop does not have: each fails with its reason, not as an
# "unrecognized argument" (a Megatron-LM user then knows it is not a typo).
_MOE = "mixture-of-experts layers are not implemented in megaloop (its looped core is dense)"
_FP16 = ("fp16 training with loss scaling is not implemented; use --bf16 (the same speed on "
         "Ampere and newer, no loss scaling needed)")
_FSDP = "FSDP is not supported; shard optimizer state with --use-distributed-optimizer"
REFUSED_MEGATRON_FLAGS = {
    **{flag: _MOE for flag in (
        "--num-experts", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
        "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-grouped-gemm", "--moe-layer-freq",
        "--moe-router-load-balancing-type", "--moe-aux-loss-coeff", "--moe-token-dispatcher-type",
        "--moe-shared-expert-intermediate-size", "--moe-router-score-function")},
    **{flag: _FP16 for flag in ("--fp16", "--loss-scale", "--initial-loss-scale",
                                "--min-loss-scale", "--loss-scale-window", "--hysteresis")},
    "--use-torch-fsdp2": _FSDP, "--use-megatron-fsdp": _FSDP,
    "--num-layers-per-virtual-pipeline-stage": (
        "megaloop's virtual pipeline chunks are its loop steps (one per --num-loops step, each "
        "holding all of the stage's core layers, which they share), so layers per virtual "
        "stage has no meaning; drop it"),
    "--num-virtual-stages-per-pipeline-rank": (
        "the virtual stages per pipeline rank are the --num-loops loop steps; drop it"),
    "--use-legacy-models": "megaloop builds megatron-core models only; drop it",
    "--multi-latent-attention": "multi-latent attention is not implemented in megaloop",
}

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

    def check_flags(self, world_size: int | None = None) -> None:
        """The first part of validate(): every size flag against its smallest value
        (SIZE_LIMITS), then each concern's own checks (model, loop, parallel, recompute), each
        part's refusals all reported at once. Pure Python (nothing imports torch or
        megatron-core), so the trainer runs it before those load: a command line's mistakes
        come back in a fraction of a second."""
        flags = FlagCheck()
        for name, limits in SIZE_LIMITS.items():
            with flags.check():
                check_ranges(getattr(self, name), limits)
        flags.raise_any()  # first: the checks below divide by sizes
        with flags.check():
            self.model.validate()
        with flags.check():
            self.loop.validate(self.model.num_layers)
        with flags.check():
            self.parallel.validate(self.model.num_attention_heads, self.model.num_query_groups,
                                   world_size)
        with flags.check():
            self.recompute.validate()
        flags.raise_any()

    def validate(self, world_size: int | None = None) -> None:
        """Every check that needs no process group; raises ValueError with the flag to change.
        First it sets Transformer Engine's attention switches for --attention-backend
        (megaloop.runtime.set_attention_backend_env): the checks below may import TE, and TE
        must see them from its import on."""
        from megaloop import runtime

        runtime.set_attention_backend_env(self.model.attention_backend)
        self.check_flags(world_size)
        dp = self.parallel.data_parallel_size(world_size)
        self.training.validate(dp, self.model.max_position_embeddings)
        self.parallel.validate_pipeline(self.loop.num_core_layers(self.model.num_layers))
        self.optim.validate(self.training, dp)
        if self.optim.optimizer == "muon" and self.parallel.use_distributed_optimizer:
            raise ValueError("--optimizer muon does not support --use-distributed-optimizer (Muon "
                             "needs whole matrices; the distributed optimizer shards flat buffers "
                             "over data-parallel ranks): drop one of the two")
        self.logging.validate()
        self._check_compatibility(world_size)
        self.checkpoint.validate()
        self.tokenizer.validate()
        self.data.validate(eval_iters=self.training.eval_iters)

    def _check_compatibility(self, world_size: int | None) -> None:
        """Every "X does not work with Y" rule between features, in one place. (Checks of one
        flag's own value stay with its dataclass.)"""
        loop, par, log = self.loop, self.parallel, self.logging
        if self.optim.optimizer == "muon" and par.use_distributed_optimizer:
            raise ValueError("--optimizer muon does not support --use-distributed-optimizer (Muon "
                             "needs whole matrices; the distributed optimizer shards flat buffers "
                             "over data-parallel ranks): drop one of the two")
        if log.log_grad_norm_per_step and self.recompute.recompute_granularity == "full":
            raise ValueError("--log-grad-norm-per-step cannot be used with "
                             "--recompute-granularity full (the recomputed forward bypasses the "
                             "per-step weight views); drop one of the two")
        if loop.loopformer_objective and par.sequence_parallel:
            raise ValueError("--loopformer-objective with --sequence-parallel: the two routes' "
                             "states are compared per token, which sequence parallelism splits "
                             "over the TP ranks; drop --sequence-parallel (TP without SP works)")
        if self.model.value_embeddings and par.sequence_parallel:
            raise ValueError("--value-embeddings with --sequence-parallel: the value gate reads "
                             "every token's attention input, which sequence parallelism splits "
                             "over the TP ranks; drop --sequence-parallel (TP without SP works)")
        self._check_context_parallel()
        self._check_gpu_paths()
        self._check_kernels()
        self._check_pipeline(world_size)
        self._check_random_depth(world_size)
        self._check_spiral()

    def _check_pipeline(self, world_size: int | None) -> None:
        pp, T = self.parallel.pipeline_model_parallel_size, self.loop.num_loops
        if pp > 1 and self.loop.timestep_conditioning == "loopformer":
            raise ValueError(f"--timestep-conditioning loopformer with "
                             f"--pipeline-model-parallel-size {pp}: its step embedder is shared "
                             f"by every core layer, so every stage would hold a copy whose "
                             f"gradients are not summed over stages; use "
                             f"--pipeline-model-parallel-size 1 (TP and DP are supported)")
        readouts = self.parallel.first_stage_readout_steps()
        if readouts:
            from megaloop.parallel.balance import first_readout_blocker

            flag = f"--pipeline-first-stage-readouts {self.parallel.pipeline_first_stage_readouts}"
            blocker = first_readout_blocker(self.model, self.loop)
            if blocker:
                raise ValueError(f"{flag}: {blocker}")
            if readouts[-1] > T - 1:
                raise ValueError(f"{flag}: step {readouts[-1]} is not before the last of "
                                 f"--num-loops {T} (the last step's loss is read out on the last "
                                 f"stage); give steps 1..{T - 1}")
        if pp == 1 or T == 1:
            return
        microbatches = self.training.num_microbatches(self.parallel.data_parallel_size(world_size))
        # Interleaved 1F1B (one virtual chunk per loop step) runs micro-batches in groups of the
        # pipeline size (megatron-core's microbatch_group_size_per_vp_stage default).
        ramp = self.training.rampup_batch_size
        if ramp is not None:
            dp = self.parallel.data_parallel_size(world_size)
            gbs = self.training.resolved_global_batch(dp)
            odd = [b for b in range(ramp[0], gbs, ramp[1])
                   if (b // (self.training.micro_batch_size * dp)) % pp]
            if odd:
                raise ValueError(
                    f"--rampup-batch-size {' '.join(map(str, ramp))} with --num-loops {T} and "
                    f"--pipeline-model-parallel-size {pp}: the ramped global batch {odd[0]} "
                    f"gives a number of micro-batches that is not a multiple of {pp}, which the "
                    f"interleaved pipeline schedule needs; choose START and INCREMENT so")
        if microbatches % pp:
            raise ValueError(
                f"{microbatches} micro-batches per step (--global-batch-size / (--micro-batch-size "
                f"x data-parallel size)) with --num-loops {T}: the interleaved pipeline schedule "
                f"needs a multiple of --pipeline-model-parallel-size {pp}; raise "
                f"--global-batch-size")
        if self.parallel.overlap_grad_reduce:
            raise ValueError(
                f"--overlap-grad-reduce with --pipeline-model-parallel-size {pp} and --num-loops "
                f"{T}: each loop step's chunk runs its own backward pass into the shared layers, "
                f"so a gradient bucket is complete only after the last chunk and megatron-core "
                f"would reduce it early; drop --overlap-grad-reduce")

    def _check_random_depth(self, world_size: int | None) -> None:
        loop = self.loop
        if not (loop.random_depth_mean > 0 or loop.truncated_backprop_steps > 0):
            return
        what = "--random-depth-mean" if loop.random_depth_mean > 0 else "--truncated-backprop-steps"
        if self.logging.log_grad_norm_per_step:
            raise ValueError(f"{what} cannot be used with --log-grad-norm-per-step (the per-step "
                             f"weight views are built for --num-loops steps, all with gradient); "
                             f"drop one of the two")
        if loop.exit_loss == "adaptive-gate":
            raise ValueError(f"{what} cannot be used with --exit-loss adaptive-gate (stage II "
                             f"trains the gate at the fixed --num-loops); drop one of the two")
        if loop.random_depth_mean > 0 and loop.exit_loss != "last" and loop.num_loops < 2:
            raise ValueError("--random-depth-mean draws T > 1, whose --exit-loss "
                             f"{loop.exit_loss} needs an exit gate, built only with --num-loops "
                             ">= 2; use --exit-loss last (Huginn's objective) or --num-loops >= 2")
        pp = self.parallel.pipeline_model_parallel_size
        microbatches = self.training.num_microbatches(self.parallel.data_parallel_size(world_size))
        if loop.random_depth_mean > 0 and pp > 1 and microbatches % pp:
            raise ValueError(f"--random-depth-mean with --pipeline-model-parallel-size {pp}: a "
                             f"drawn T > 1 runs the interleaved schedule, which needs the "
                             f"{microbatches} micro-batches per step to be a multiple of {pp}; "
                             f"change --global-batch-size or --micro-batch-size")

    def _check_spiral(self) -> None:
        from megaloop.model.spiral_schedule import chunk_sizes, is_active

        loop = self.loop
        sizes = chunk_sizes(loop)
        coarse = any(g > 1 for g in sizes)
        if coarse and loop.loop_topology == "plain":
            raise ValueError("--loop-resolutions with a coarse step (r < 1) needs --loop-topology "
                             "anchor or mesh: the shifted update is zero on its first tokens, the "
                             "topology supplies the state it is added to")
        if is_active(loop) and loop.random_depth_mean > 0:
            raise ValueError("--loop-resolutions / --loop-topology fix one operator per loop "
                             "step: they cannot be combined with --random-depth-mean; drop one")
        reason = loop.supports(sequence_parallel=self.parallel.sequence_parallel)
        if reason:
            raise ValueError(reason)
        if coarse and self.training.seq_length < max(sizes):
            raise ValueError(f"--seq-length {self.training.seq_length} is shorter than the "
                             f"coarsest chunk ({max(sizes)} tokens) of --loop-resolutions")

    def _check_context_parallel(self) -> None:
        """--context-parallel-size > 1: what megatron-core's CP (TE attention, load-balanced
        sequence split) needs, and the features that would read across the split."""
        from megaloop.model.config import use_transformer_engine
        from megaloop.model.spiral_schedule import chunk_sizes

        cp, par = self.parallel.context_parallel_size, self.parallel
        if cp == 1:
            return
        te = use_transformer_engine(self.model)
        if not te and not _cp_test_route():
            raise ValueError(
                f"--context-parallel-size {cp} needs the Transformer Engine layer spec: "
                f"megatron-core's local attention asserts context_parallel_size == 1 and only TE "
                f"attention runs the CP ring; run on a GPU with --transformer-impl "
                f"transformer_engine (or auto with TE installed), or use "
                f"--context-parallel-size 1")
        if te and not self.training.bf16:
            raise ValueError(
                f"--context-parallel-size {cp} needs --bf16: Transformer Engine runs "
                f"context-parallel attention only in its flash and fused backends, which take "
                f"16-bit inputs (fp32 would fail at the first forward); add --bf16")
        backend = getattr(self.model, "attention_backend", None)  # --attention-backend, if any
        if te and str(backend) in ("unfused", "local"):
            raise ValueError(
                f"--context-parallel-size {cp} with --attention-backend {backend}: TE runs "
                f"context-parallel attention only with its flash or fused backends; use "
                f"--attention-backend auto (or flash / fused)")
        seq = self.training.seq_length
        if seq % (2 * cp):
            raise ValueError(
                f"--seq-length {seq} is not divisible by 2 x --context-parallel-size {cp}: "
                f"megatron-core's load-balanced split cuts each sequence into {2 * cp} equal "
                f"chunks; use a --seq-length that is a multiple of {2 * cp}")
        tp = par.tensor_model_parallel_size
        if par.sequence_parallel and (seq // cp) % tp:
            raise ValueError(
                f"--seq-length {seq} / --context-parallel-size {cp} = {seq // cp} tokens per CP "
                f"rank is not divisible by --tensor-model-parallel-size {tp} (--sequence-parallel "
                f"splits them again); use a --seq-length that is a multiple of {2 * cp * tp}")
        if self.data.reset_attention_mask:
            raise ValueError(
                f"--reset-attention-mask with --context-parallel-size {cp}: TE's CP attention "
                f"is causal over the whole sequence and reads no per-document mask; drop "
                f"--reset-attention-mask or use --context-parallel-size 1")
        if any(g > 1 for g in chunk_sizes(self.loop)):
            raise ValueError(
                f"--loop-resolutions with a coarse step (r < 1) and --context-parallel-size {cp}: "
                f"a coarse step pools runs of consecutive tokens, and megatron-core's "
                f"load-balanced split gives each CP rank two non-adjacent chunks, so runs (and "
                f"the shift that keeps them causal) straddle ranks; use --context-parallel-size 1 "
                f"or full-resolution steps")

    def _check_gpu_paths(self) -> None:
        """Combinations that megatron-core or Transformer Engine would get wrong on a GPU (or
        assert on), refused before any process group."""
        from megaloop.model.config import use_transformer_engine

        te = use_transformer_engine(self.model)  # as the model builder resolves it
        if self.data.reset_attention_mask and te:
            raise ValueError(
                "--reset-attention-mask with the Transformer Engine layer spec: TE's causal "
                "attention reads no explicit mask, so packed documents would silently attend to "
                "each other; use --transformer-impl local (megatron-core's attention applies the "
                "mask) or drop --reset-attention-mask")
        if self.parallel.sequence_parallel and not te:
            raise ValueError(
                "--sequence-parallel needs the Transformer Engine layer spec: the local spec's "
                "norms (megatron-core's torch norm wrapper) assert that sequence parallelism is "
                "off; run on a GPU with --transformer-impl transformer_engine (or auto with TE "
                "installed), or drop --sequence-parallel")
        loop = self.loop
        varying = [flag for flag, on in (("--random-depth-mean", loop.random_depth_mean > 0),
                                         ("--truncated-backprop-steps",
                                          loop.truncated_backprop_steps > 0)) if on]
        if self.parallel.overlap_grad_reduce and varying:
            lora = (" (with --lora-rank, the adapters of steps not run get none, and a drawn T "
                    "beyond --num-loops reuses the last adapter)") if loop.lora_rank else ""
            raise ValueError(
                f"--overlap-grad-reduce with {' and '.join(varying)}: megatron-core's DDP counts "
                f"each parameter's gradient hooks on the first batch and starts a bucket's "
                f"reduction only when a later batch reaches the same counts; a loop count or a "
                f"number of steps with gradient that changes from step to step changes how often "
                f"the shared and per-step parameters receive gradients{lora}, so the reduction "
                f"never starts; drop --overlap-grad-reduce")

    def _check_kernels(self) -> None:
        """Fusion, attention-backend and FP8 flags (megaloop.model.config.kernel_settings turns
        them into the TransformerConfig): what a looped model or this machine cannot run."""
        import torch

        from megaloop.model import config as model_config
        from megaloop.model.config import use_transformer_engine

        m, loop = self.model, self.loop
        cuda = torch.cuda.is_available()
        te = use_transformer_engine(m)
        if te and m.transformer_impl == "transformer_engine" and not _te_installed():
            raise ValueError("--transformer-impl transformer_engine (Megatron-LM's default) needs "
                             "Transformer Engine, which is not installed: install it (the GPU "
                             "image has it) or pass --transformer-impl local")
        if m.apply_layernorm_1p and not te:
            raise ValueError("--apply-layernorm-1p needs the Transformer Engine layer spec "
                             "(megatron-core's torch LayerNorm has no zero-centered gamma): run "
                             "on a GPU with Transformer Engine, or drop --apply-layernorm-1p")
        if m.attention_backend in ("flash", "fused", "unfused") and not te:
            raise ValueError(
                f"--attention-backend {m.attention_backend} is a Transformer Engine attention "
                f"backend, but the layers are megatron-core's local spec; run on a GPU with "
                f"--transformer-impl transformer_engine, or use --attention-backend auto")
        if m.attention_backend == "local" and te:
            raise ValueError(
                "--attention-backend local is the local spec's attention (Megatron-LM allows it "
                "only with --spec local), but the layers are Transformer Engine's; add "
                "--transformer-impl local or choose flash, fused, unfused or auto")
        if (self.data.reset_attention_mask and cuda and not te and not m.no_masked_softmax_fusion
                and model_config._fused_softmax_available()):
            raise ValueError(
                "--reset-attention-mask on a GPU with the local spec: megatron-core's fused "
                "masked softmax (on by default where apex's kernel exists, as here) applies only "
                "the causal mask under causal attention and drops the explicit document mask; "
                "add --no-masked-softmax-fusion")
        if (cuda and m.cross_entropy_loss_fusion and m.cross_entropy_fusion_impl == "te"
                and not _te_installed()):
            raise ValueError("--cross-entropy-fusion-impl te needs Transformer Engine installed; "
                             "use --cross-entropy-fusion-impl native")
        if m.cross_entropy_loss_fusion and loop.loop_readout == "chunked":
            raise ValueError("--cross-entropy-loss-fusion fuses the cross-entropy of "
                             "--loop-readout logits; --loop-readout chunked computes its own "
                             "(no logits kept): pass --loop-readout logits or drop the fusion")
        if m.gradient_accumulation_fusion:
            repeated = loop.num_loops > 1 or loop.random_depth_mean > 0
            if te and repeated:
                raise ValueError(
                    f"--gradient-accumulation-fusion with Transformer Engine layers and "
                    f"--num-loops {loop.num_loops}"
                    f"{' / --random-depth-mean' if loop.random_depth_mean > 0 else ''}: a core "
                    f"layer runs several times per micro-batch, TE adds its weight gradient into "
                    f"main_grad only when is_first_microbatch is false, and the backward of loop "
                    f"step 1 (run last) overwrites the gradients of steps 2..T (Megatron-LM PR "
                    f"#6965); drop --gradient-accumulation-fusion (autograd then sums the T "
                    f"contributions)")
            if self.logging.log_grad_norm_per_step:
                raise ValueError(
                    "--gradient-accumulation-fusion cannot be used with --log-grad-norm-per-step: "
                    "the per-step weight views have no main_grad for the fused accumulation; "
                    "drop one of the two")
        self._check_fp8(cuda, te)

    def _check_fp8(self, cuda: bool, te: bool) -> None:
        m, par, tr = self.model, self.parallel, self.training
        if m.fp8_format is None:
            for flag, on in (("--fp8-param-gather", m.fp8_param_gather),
                             ("--first-last-layers-bf16", m.first_last_layers_bf16)):
                if on:
                    raise ValueError(f"{flag} needs --fp8-format (it only changes FP8 training)")
            return
        fmt = f"--fp8-format {m.fp8_format}"
        if not cuda:
            raise ValueError(f"{fmt} needs a GPU with Transformer Engine (FP8 GEMMs are TE "
                             f"kernels); this machine has no GPU: drop {fmt}")
        if not te:
            raise ValueError(f"{fmt} needs the Transformer Engine layer spec: add "
                             f"--transformer-impl transformer_engine (or auto with TE installed)")
        if not tr.bf16:
            raise ValueError(f"{fmt} needs --bf16 (FP8 GEMMs inside bf16 training, as "
                             f"Megatron-LM); add --bf16")
        if m.fp8_recipe == "mxfp8" and torch_capability() < (10, 0):
            raise ValueError("--fp8-recipe mxfp8 needs a Blackwell GPU (compute capability >= "
                             "10.0); use --fp8-recipe tensorwise")
        if m.fp8_param_gather and not par.use_distributed_optimizer:
            raise ValueError("--fp8-param-gather needs --use-distributed-optimizer (as "
                             "Megatron-LM): add it or drop --fp8-param-gather")
        if m.first_last_layers_bf16:
            if m.fp8_recipe == "delayed":
                raise ValueError("--first-last-layers-bf16 does not work with --fp8-recipe "
                                 "delayed (megatron-core: entering FP8 per layer breaks the amax "
                                 "reduction); use --fp8-recipe tensorwise, blockwise or mxfp8")
            if self.loop.num_prelude_layers or self.loop.num_coda_layers:
                raise ValueError(
                    "--first-last-layers-bf16 with --num-prelude-layers / --num-coda-layers: "
                    "megatron-core counts the BF16 layers per block, so prelude, core and coda "
                    "would each keep their first and last layers in BF16, not the network's; "
                    "drop it, or use a core-only layout (its first and last layers then run in "
                    "BF16 at every loop step)")
            per_stage = self.loop.num_core_layers(m.num_layers) // \
                par.pipeline_model_parallel_size
            for flag, n in (("--num-layers-at-start-in-bf16", m.num_layers_at_start_in_bf16),
                            ("--num-layers-at-end-in-bf16", m.num_layers_at_end_in_bf16)):
                if n > per_stage:
                    raise ValueError(f"{flag} {n} exceeds the {per_stage} core layers per "
                                     f"pipeline stage; lower it")
        from megaloop.model.config import fp8_gemm_dims

        align = 32 if m.fp8_recipe == "mxfp8" else 16
        for name, size, fix in fp8_gemm_dims(self):
            if size % align:
                raise ValueError(
                    f"{fmt} --fp8-recipe {m.fp8_recipe}: {name} is {size}, not a multiple of "
                    f"{align}. Transformer Engine runs an FP8 GEMM only when its rows are a "
                    f"multiple of 8 and its columns of 16 (MXFP8: blocks of 32), and the backward "
                    f"GEMMs transpose both, so every dimension per rank must be a multiple of "
                    f"{align}; {fix}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# TEST ONLY. CP's batch split, loss reduction and DP x CP gradient reduction are checked on CPU
# with a model whose layers have no attention (tests/test_context_parallel.py swaps the layer
# spec); megatron-core's local attention cannot run CP. With this variable set *inside pytest*,
# validation lets --context-parallel-size > 1 through without Transformer Engine.
CP_TEST_ROUTE_ENV = "MEGALOOP_TEST_CP_WITHOUT_ATTENTION"


def _cp_test_route() -> bool:
    import os

    return os.environ.get(CP_TEST_ROUTE_ENV) == "1" and "PYTEST_CURRENT_TEST" in os.environ


def _te_installed() -> bool:
    import importlib.util
    import sys

    if sys.modules.get("transformer_engine") is not None:  # imported already
        return True
    return importlib.util.find_spec("transformer_engine") is not None


def torch_capability() -> tuple:
    """Compute capability of the current GPU ((0, 0) without one)."""
    import torch

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description="Train a looped language model (layout P + K x T + C) on megatron-core.",
        allow_abbrev=False)
    for cls in SECTIONS.values():
        add_dataclass_args(parser, cls)
    add_refused_flags(parser, "Megatron-LM flags megaloop refuses", REFUSED_MEGATRON_FLAGS)
    return parser


def parse_args(argv=None) -> RunConfig:
    namespace = build_parser().parse_args(argv)
    return RunConfig(**{name: dataclass_from_args(cls, namespace)
                        for name, cls in SECTIONS.items()})


def check_before_imports(cfg: RunConfig) -> None:
    """``cfg.check_flags`` at the start of an entry point, before torch and megatron-core load
    (validate() repeats it later), so a command line's mistakes come back in a fraction of a
    second. Skipped where the values may still change or the world is not known yet:
    --use-checkpoint-args (the checkpoint may replace a value given on the command line), and
    SLURM tasks started without a launcher (single_process_env refuses those first)."""
    import os

    from megaloop import runtime

    world = os.environ.get("WORLD_SIZE")
    if world is None and int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        world = "1"  # what single_process_env will set up
    if cfg.checkpoint.use_checkpoint_args or world is None:
        return
    runtime.set_attention_backend_env(cfg.model.attention_backend)  # (TE reads it at import)
    cfg.check_flags(int(world))
