"""Training, optimizer and logging configuration (Megatron-LM's flag names)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Literal, Optional

from megaloop.checkpoint.config import LoadConfig
from megaloop.checkpoint.tracker import check_training_load


@dataclass
class TrainingConfig:
    """Batch shape, schedule length, precision and evaluation cadence."""

    seq_length: int = 64
    """Tokens per sample."""

    micro_batch_size: int = 2
    """Samples per forward/backward on one data-parallel rank."""

    global_batch_size: Optional[int] = None
    """Samples per optimizer step over all data-parallel ranks (default: micro x DP, no
    accumulation). Gradient accumulation = global / (micro x DP)."""

    train_iters: Optional[int] = None
    """Optimizer steps to train for (default 20, unless --train-samples gives the length)."""

    train_samples: Optional[int] = None
    """Train on this many samples instead of --train-iters (Megatron-LM's sample-based
    training): the iterations follow from the (ramped) global batch size, a last partial batch
    is dropped, and the LR schedule counts samples (--lr-warmup-samples, --lr-decay-samples)."""

    rampup_batch_size: Optional[list[int]] = field(default=None, metadata={"nargs": 3})
    """START INCREMENT SAMPLES: the global batch size grows from START by INCREMENT, in equal
    steps over the first SAMPLES samples, up to --global-batch-size (Megatron-LM's ramp-up;
    every size must be a multiple of --micro-batch-size x data-parallel size). The LR schedule
    then counts samples. Unlike Megatron-LM it also works with --train-iters (iterations at the
    ramped batch sizes; Megatron-LM refuses the pair, which its own GPT-3 example passes)."""

    seed: int = 1234
    """Seed of weights, data order and dropout (the same on every rank)."""

    bf16: bool = False
    """bf16 parameters and compute with fp32 main weights (GPU)."""

    eval_interval: int = 1000
    """Run validation every this many iterations (and at the end)."""

    eval_iters: int = 100
    """Validation micro-batch rounds per evaluation (each round is one global batch; 0: no
    validation)."""

    calculate_per_token_loss: bool = False
    """Accepted for Megatron-LM command lines: megaloop always weighs every loss token of the
    global batch equally (Megatron-LM's per-token loss; without this flag Megatron-LM averages
    per micro-batch first)."""

    manual_gc: bool = False
    """Turn Python's automatic garbage collection off and collect every --manual-gc-interval
    iterations and around evaluations (Megatron-LM's flag: avoids collections at random steps
    on some ranks, which stall every other rank)."""

    manual_gc_interval: int = 0
    """With --manual-gc: collect every this many iterations (0: only around evaluations)."""

    empty_unused_memory_level: Literal[0, 1, 2] = 0
    """Release the CUDA caching allocator's unused memory: 1 after every training step, 2 also
    after every evaluation (Megatron-LM's levels; no effect without a GPU)."""

    check_for_nan_in_loss_and_grad: bool = True
    """Check every step's loss and gradients on every rank (as Megatron-LM's flag); a step where
    any is NaN or infinite is skipped (no update, no LR-schedule step) and counted in the log's
    "skipped". `false` applies every step as it comes (a diverged run then stops at its next save,
    which refuses non-finite weights)."""

    max_skipped_steps_in_a_row: int = 10
    """Stop the run (exit code 1, nothing saved after the last good checkpoint) when this many
    steps in a row were skipped: the run has diverged and skipping will not bring it back."""

    def num_microbatches(self, dp_size: int, consumed_samples: Optional[int] = None) -> int:
        """Micro-batches per step (at ``consumed_samples`` under --rampup-batch-size)."""
        gbs = (self.resolved_global_batch(dp_size) if consumed_samples is None
               else self.global_batch_at(consumed_samples, dp_size))
        return gbs // (self.micro_batch_size * dp_size)

    def resolved_global_batch(self, dp_size: int) -> int:
        return self.global_batch_size or self.micro_batch_size * dp_size

    def counts_samples(self) -> bool:
        """Whether the LR schedule counts samples (as Megatron-LM always does) rather than
        iterations: only where the two differ by more than the constant global batch factor,
        i.e. with --train-samples or --rampup-batch-size (a checkpoint's schedule keeps its
        unit)."""
        return self.train_samples is not None or self.rampup_batch_size is not None

    def global_batch_at(self, consumed_samples: int, dp_size: int) -> int:
        """The global batch of the step that starts after ``consumed_samples`` samples: megatron-
        core's RampupBatchsizeNumMicroBatchesCalculator rule (START + INCREMENT x floor(consumed
        / (SAMPLES / number of increments)) until SAMPLES, then --global-batch-size)."""
        gbs = self.resolved_global_batch(dp_size)
        if self.rampup_batch_size is None:
            return gbs
        start, increment, ramp = self.rampup_batch_size
        if consumed_samples > ramp or start == gbs:
            return gbs
        per_increment = ramp / ((gbs - start) // increment)
        return start + int(consumed_samples / per_increment) * increment

    def resolve(self, dp_size: int) -> None:
        """Fill --train-iters: 20 by default, or the iterations --train-samples takes (Megatron-
        LM's update_train_iters: the ramp-up's steps, then whole global batches)."""
        if self.train_samples is None:
            if self.train_iters is None:
                self.train_iters = 20
            return
        iterations, consumed = 0, 0
        if self.rampup_batch_size is not None:
            while consumed <= self.rampup_batch_size[2] and consumed <= self.train_samples:
                consumed += self.global_batch_at(consumed, dp_size)
                iterations += 1
        if self.train_samples > consumed:
            iterations += (self.train_samples - consumed) // self.resolved_global_batch(dp_size)
        self.train_iters = iterations

    def train_samples_total(self, dp_size: int) -> int:
        """Samples the --train-iters steps consume (with the ramp-up's smaller batches)."""
        consumed = 0
        for _ in range(self.train_iters):
            consumed += self.global_batch_at(consumed, dp_size)
        return consumed

    def validate(self, dp_size: int, max_position_embeddings: int) -> None:
        from megaloop.inference.flags import PROCESS_SEED_RANGE, check_seed

        # (it seeds numpy's global generator and megatron-core's datasets' sample order)
        check_seed(self.seed, valid=PROCESS_SEED_RANGE,
                   why="numpy's seed range: the run seeds numpy and its data order with it")
        if self.train_samples is not None and self.train_samples < 1:
            raise ValueError(f"--train-samples {self.train_samples} must be >= 1")
        given = self.train_iters
        if self.train_samples is not None:
            self.train_iters = None
        self.resolve(dp_size)
        # A config validated before (or saved by a run) holds the iterations it resolved.
        if self.train_samples is not None and given not in (None, self.train_iters):
            raise ValueError(f"--train-samples {self.train_samples} and --train-iters "
                             f"{given}: the run's length is one or the other; drop one (as "
                             f"Megatron-LM)")
        if self.micro_batch_size < 1 or self.train_iters < 0 or self.seq_length < 1:
            raise ValueError("--micro-batch-size and --seq-length must be >= 1, --train-iters >= 0")
        gbs = self.resolved_global_batch(dp_size)
        if self.rampup_batch_size is not None:
            start, increment, ramp = self.rampup_batch_size
            chunk = self.micro_batch_size * dp_size
            if start < 1 or increment < 1 or ramp < 0 or start > gbs or (gbs - start) % increment:
                raise ValueError(
                    f"--rampup-batch-size {start} {increment} {ramp}: needs START >= 1, "
                    f"INCREMENT >= 1, SAMPLES >= 0 and --global-batch-size {gbs} - START a "
                    f"multiple of INCREMENT")
            if start % chunk or increment % chunk:
                raise ValueError(
                    f"--rampup-batch-size {start} {increment} {ramp}: every ramped global batch "
                    f"must be a multiple of --micro-batch-size {self.micro_batch_size} x "
                    f"data-parallel size {dp_size} = {chunk}; choose START and INCREMENT so")
        if gbs % (self.micro_batch_size * dp_size):
            raise ValueError(
                f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
                f"{self.micro_batch_size} x data-parallel size {dp_size}; use a multiple of "
                f"{self.micro_batch_size * dp_size}")
        if self.seq_length > max_position_embeddings:
            raise ValueError(
                f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                f"{max_position_embeddings}; raise --max-position-embeddings")
        if self.eval_interval < 1 or self.eval_iters < 0:
            raise ValueError("--eval-interval must be >= 1 and --eval-iters >= 0")
        if self.max_skipped_steps_in_a_row < 1:
            raise ValueError(f"--max-skipped-steps-in-a-row {self.max_skipped_steps_in_a_row} "
                             "must be >= 1")


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    optimizer: Literal["adam", "muon"] = "adam"
    """`adam`: megatron-core's AdamW (decoupled weight decay) for every parameter. `muon` ("What
    Makes Recurrence Effective in Looped Language Models?" (arXiv 2609.36636)): Muon for the 2-D
    hidden matrices of attention and MLP, AdamW for embeddings, LM head, norms, gate and other
    vectors; both follow --lr, the LR schedule, --weight-decay and --clip-grad."""

    lr: float = 1e-3
    """Peak learning rate."""

    min_lr: float = 0.0
    """Learning rate at the end of the decay."""

    lr_warmup_iters: int = 0
    """Linear warmup from 0 to --lr over this many iterations."""

    lr_warmup_fraction: Optional[float] = None
    """Warmup over this fraction of the decay length (--lr-decay-iters or --lr-decay-samples;
    instead of --lr-warmup-iters / --lr-warmup-samples)."""

    lr_warmup_samples: int = 0
    """With --train-samples: linear warmup over this many samples."""

    lr_decay_samples: Optional[int] = None
    """With --train-samples: samples over which the LR decays (default: --train-samples)."""

    lr_wsd_decay_samples: Optional[int] = None
    """With --train-samples and WSD: samples of the final decay phase."""

    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "linear"
    """Shape of the decay after warmup (Megatron-LM's default linear; the recipes use cosine)."""

    lr_decay_iters: Optional[int] = None
    """Iterations over which the LR decays (default: --train-iters)."""

    lr_wsd_decay_iters: Optional[int] = None
    """WSD only: length of the final decay phase."""

    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = "exponential"
    """WSD only: shape of the final decay phase."""

    decoupled_lr: Optional[float] = None
    """Peak LR of the input embedding and the output layer (megatron-core's decoupled LR;
    default: --lr). Follows the same schedule."""

    decoupled_min_lr: Optional[float] = None
    """Final LR of the input embedding and output layer with --decoupled-lr (default:
    --min-lr)."""

    override_opt_param_scheduler: bool = field(
        default=False, metadata={"flag": "--override-opt_param-scheduler"})
    """On --load, take the LR / weight-decay schedule from these flags even where the
    checkpoint's differs (e.g. a longer --train-iters)."""

    use_checkpoint_opt_param_scheduler: bool = field(
        default=False, metadata={"flag": "--use-checkpoint-opt_param-scheduler"})
    """On --load, keep the checkpoint's LR / weight-decay schedule even where these flags
    differ. Without either flag a difference is an error (as in Megatron-LM)."""

    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to norms and biases)."""

    adam_beta1: float = 0.9
    """Adam beta1."""

    adam_beta2: float = 0.999
    """Adam beta2."""

    adam_eps: float = 1e-8
    """Adam epsilon."""

    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""

    muon_momentum: float = 0.9
    """Muon momentum (Megatron-LM's default 0.9; What Makes Recurrence Effective: 0.95)."""

    muon_use_nesterov: bool = field(default=False, metadata={"aliases": ["--muon-nesterov"]})
    """Muon uses Nesterov momentum (What Makes Recurrence Effective: yes; Megatron-LM's default:
    no)."""

    muon_num_ns_steps: int = field(default=5, metadata={"aliases": ["--muon-ns-steps"]})
    """Newton-Schulz iterations per Muon step (What Makes Recurrence Effective: 5)."""

    muon_scale_mode: Literal["spectral", "unit_rms_norm", "shape_scaling", "rms-match"] = field(
        default="spectral", metadata={"value_aliases": {"shape": "shape_scaling"}})
    """Scale of the orthogonalised update of a rows x cols matrix, times
    --muon-extra-scale-factor (Megatron-LM's modes): `spectral` sqrt(max(rows, cols)),
    `unit_rms_norm` sqrt(rows / cols), `shape_scaling` sqrt(max(1, rows / cols)) (Jordan et al.
    2024, usually with a larger --lr); megaloop's `rms-match` is `spectral` times 0.2 (Liu et al.
    2025: matches AdamW's update RMS, so one --lr serves both parts; What Makes Recurrence
    Effective)."""

    muon_extra_scale_factor: float = 1.0
    """Extra factor on every Muon update (Megatron-LM's flag)."""

    def schedule_steps(self, training: "TrainingConfig", dp_size: int) -> dict:
        """OptimizerParamScheduler's step counts, in the unit the trainer steps it by
        (``TrainingConfig.counts_samples``: samples, as Megatron-LM, or iterations, the same
        schedule divided by the constant global batch): lr_warmup_steps, lr_decay_steps,
        wd_incr_steps, wsd_decay_steps (Megatron-LM's get_optimizer_param_scheduler)."""
        if training.train_samples is not None:
            decay = self.lr_decay_samples or training.train_samples
            warmup, total, wsd = self.lr_warmup_samples, training.train_samples, \
                self.lr_wsd_decay_samples
        else:
            unit = training.resolved_global_batch(dp_size) if training.counts_samples() else 1
            decay = (self.lr_decay_iters or training.train_iters) * unit
            warmup, total = self.lr_warmup_iters * unit, training.train_iters * unit
            wsd = self.lr_wsd_decay_iters * unit if self.lr_wsd_decay_iters else None
        if self.lr_warmup_fraction is not None:
            warmup = self.lr_warmup_fraction * decay
        return {"lr_warmup_steps": warmup, "lr_decay_steps": max(decay, 1),
                "wd_incr_steps": max(total, 1), "wsd_decay_steps": wsd}

    def validate(self, training: "TrainingConfig", dp_size: int) -> None:
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError("--override-opt_param-scheduler and --use-checkpoint-opt_param-"
                             "scheduler contradict each other: pass one of them")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= --min-lr ({self.min_lr}) <= --lr ({self.lr}) and --lr > 0")
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise ValueError("--decoupled-min-lr needs --decoupled-lr")
        if self.decoupled_lr is not None and not (
                0 <= (self.decoupled_min_lr or 0.0) <= self.decoupled_lr):
            raise ValueError(f"need 0 <= --decoupled-min-lr ({self.decoupled_min_lr}) <= "
                             f"--decoupled-lr ({self.decoupled_lr})")
        # Megatron-LM's rule: iteration-based and sample-based schedule flags do not mix.
        if training.train_samples is not None:
            for flag, value in (("--lr-warmup-iters", self.lr_warmup_iters),
                                ("--lr-decay-iters", self.lr_decay_iters),
                                ("--lr-wsd-decay-iters", self.lr_wsd_decay_iters)):
                if value:
                    raise ValueError(f"{flag} {value} with --train-samples: the schedule counts "
                                     f"samples; use {flag.replace('iters', 'samples')}")
        else:
            for flag, value in (("--lr-warmup-samples", self.lr_warmup_samples),
                                ("--lr-decay-samples", self.lr_decay_samples),
                                ("--lr-wsd-decay-samples", self.lr_wsd_decay_samples)):
                if value:
                    raise ValueError(f"{flag} {value} needs --train-samples (the schedule counts "
                                     f"iterations); use {flag.replace('samples', 'iters')}")
        if self.lr_warmup_fraction is not None:
            if not 0.0 <= self.lr_warmup_fraction < 1.0:
                raise ValueError(f"--lr-warmup-fraction {self.lr_warmup_fraction} must be in "
                                 f"[0, 1)")
            if self.lr_warmup_iters or self.lr_warmup_samples:
                raise ValueError("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples: "
                                 "pass one of them (as Megatron-LM)")
        steps = self.schedule_steps(training, dp_size)
        warmup, decay = steps["lr_warmup_steps"], steps["lr_decay_steps"]
        # megatron-core's scheduler asserts warmup < decay steps, whatever the decay style.
        if warmup < 0 or (warmup > 0 and warmup >= decay):
            what = "samples" if training.train_samples is not None else "iters"
            raise ValueError(f"--lr-warmup-{what} ({warmup}) must be >= 0 and below "
                             f"--lr-decay-{what} ({decay}; default the run's length)")
        if self.lr_decay_style == "WSD" and not steps["wsd_decay_steps"]:
            raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or "
                             "--lr-wsd-decay-samples with --train-samples)")
        if self.optimizer == "muon":
            if not 0.0 <= self.muon_momentum < 1.0:
                raise ValueError(f"--muon-momentum {self.muon_momentum} must be in [0, 1)")
            if self.muon_num_ns_steps < 1:
                raise ValueError(f"--muon-num-ns-steps {self.muon_num_ns_steps} must be >= 1")
            if self.muon_extra_scale_factor <= 0:
                raise ValueError(f"--muon-extra-scale-factor {self.muon_extra_scale_factor} "
                                 f"must be > 0")


def _require_backend(flag: str, module: str, package: str) -> None:
    """ValueError (one line) unless ``module`` imports: what to pip install for ``flag``."""
    try:
        __import__(module)
    except ModuleNotFoundError as exc:
        raise ValueError(f"{flag} needs the {package} package, which is not installed ({exc}): "
                         f"pip install {package}") from exc
    except Exception as exc:  # installed but broken (a version clash): say how it fails
        why = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"{flag} needs the {package} package, which does not import "
                         f"({type(exc).__name__}: {why}): pip install --upgrade {package}") from exc


@dataclass
class LoggingConfig:
    """What is logged where."""

    log_interval: int = 100
    """Print (and record) one line every this many iterations."""

    log_throughput: bool = False
    """Accepted for Megatron-LM command lines: megaloop logs tokens/s and TFLOP/s per GPU on
    every log line anyway."""

    log_timers_to_tensorboard: bool = False
    """Accepted for Megatron-LM command lines: with --tensorboard-dir megaloop writes the step
    time (ms_per_iter) with every logged iteration anyway."""

    log_params_norm: bool = False
    """Log the L2 norm of all parameters on every log line (`params_norm`; each parameter
    counted once across tensor- and pipeline-parallel ranks)."""

    profile: bool = False
    """Record a torch profiler trace of iterations --profile-step-start to --profile-step-end
    (Megatron-LM's --profile with --use-pytorch-profiler; on a GPU Megatron-LM's default records
    for nsys instead) as a Chrome trace into --tensorboard-dir (without it: profile/ in --save,
    or in the working directory), on --profile-ranks."""

    use_pytorch_profiler: bool = False
    """Accepted for Megatron-LM command lines: --profile always uses the torch profiler."""

    profile_step_start: int = 10
    """First profiled iteration."""

    profile_step_end: int = 12
    """Iteration at which the profile stops."""

    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks that record a profile."""

    log_jsonl: Optional[str] = None
    """Append one JSON object per logged iteration (and per evaluation) to this file."""

    tensorboard_dir: Optional[str] = None
    """Write TensorBoard scalars here (requires `pip install megaloop[log]`)."""

    wandb_project: Optional[str] = None
    """Log to this Weights & Biases project (offline works: WANDB_MODE=offline)."""

    wandb_exp_name: Optional[str] = None
    """W&B run name."""

    wandb_save_dir: Optional[str] = None
    """Local directory for W&B files."""

    log_grad_norm_per_step: bool = False
    """On logged iterations, log the gradient norm of every core layer per loop step ("Closing the
    Loop" (arXiv 2610.00673) Fig. 6: post-norm shows as gradients vanishing below the last layer).
    Costs T x core-parameter fp32 buffers on those iterations; needs pipeline size 1 and no
    activation recomputation."""

    log_loop_geometry: bool = True
    """At validation, log per loop step the angular distance and relative update norm between
    the core's input and output state, and the state variance normalised by the last step's
    (What Makes Recurrence Effective App. C.4). Pipeline size 1 only (skipped otherwise)."""

    loss_spike_threshold: float = 0.5
    """A loss spike: an iteration's loss more than this above the median of the previous
    --loss-spike-window iterations (Closing the Loop App. A) and more than 6 x the run's own
    loss noise (small batches scatter further than the paper's); a run of such iterations counts
    once, and none is counted before the window and 20 measured excesses have filled."""

    loss_spike_window: int = 15
    """Iterations in the rolling median of the loss-spike counter."""

    p0_collapse_threshold: float = 0.95
    """Exit-gate collapse: p0 (probability of exiting after the first loop) above this ..."""

    p0_collapse_iters: int = 100
    """... for this many iterations in a row prints a warning (Closing the Loop Sec. 3.3, App.
    B)."""

    def validate(self) -> None:
        if self.log_interval < 1:
            raise ValueError("--log-interval must be >= 1")
        if self.profile and not 0 <= self.profile_step_start < self.profile_step_end:
            raise ValueError(f"--profile-step-start {self.profile_step_start} must be >= 0 and "
                             f"below --profile-step-end {self.profile_step_end}")
        if self.loss_spike_window < 1 or self.loss_spike_threshold <= 0:
            raise ValueError(f"--loss-spike-window ({self.loss_spike_window}) must be >= 1 and "
                             f"--loss-spike-threshold ({self.loss_spike_threshold}) > 0")
        if self.p0_collapse_iters < 1 or not 0.0 <= self.p0_collapse_threshold < 1.0:
            raise ValueError(f"--p0-collapse-iters ({self.p0_collapse_iters}) must be >= 1 and "
                             f"--p0-collapse-threshold ({self.p0_collapse_threshold}) in [0, 1)")
        # The logging backends are optional packages: import them here, before any process
        # group, so a missing one is one line naming the install instead of a traceback from
        # every rank at the first log line. tools/setup_venv.sh installs TensorBoard; wandb
        # (large, with a service binary of its own) only on request.
        if self.tensorboard_dir:
            _require_backend("--tensorboard-dir", "torch.utils.tensorboard", "tensorboard")
        if self.wandb_project:
            _require_backend("--wandb-project", "wandb", "wandb")


@dataclass
class CheckpointConfig(LoadConfig):
    """Saving, loading and stopping (Megatron-LM's flags and directory layout).

    --load and --ckpt-step are megaloop.checkpoint.config.LoadConfig's, which the tools share."""

    save: Optional[str] = None
    """Directory to save checkpoints to (iter_XXXXXXX/ + latest_checkpointed_iteration.txt)."""

    save_interval: Optional[int] = None
    """Save every this many iterations (and at the end of training, and on exit). Nothing is
    saved while steps are being skipped (--check-for-nan-in-loss-and-grad): a save that falls on
    a skipped step is made after the next applied one, and none at the end or on exit."""

    no_load_optim: bool = False
    """Do not load the optimizer and LR-scheduler state (the model's weights only)."""

    no_load_rng: bool = False
    """Do not restore the random-number generators."""

    no_save_optim: bool = False
    """Save the model without the optimizer state and LR schedule (smaller checkpoints; a run
    loading one starts its optimizer and schedule afresh)."""

    no_save_rng: bool = False
    """Save without the random-number generator states (a load then keeps its own)."""

    ckpt_format: Literal["torch_dist", "torch", "torch_dcp", "zarr", "fsdp_dtensor"] = "torch_dist"
    """Checkpoint format: megatron-core's `torch_dist` distributed checkpoint, the only one
    megaloop writes and reads (Megatron-LM's other formats are refused: `fsdp_dtensor` needs
    Megatron FSDP, which megaloop does not use; `torch`, `torch_dcp` and `zarr` are legacy or
    FSDP-only)."""

    use_checkpoint_args: bool = False
    """On --load, take the model's architecture flags (sizes, norm, activation, position
    embedding, loop layout, loop count and exit objective) from the checkpoint instead of the
    command line."""

    finetune: bool = False
    """Load the model's weights only and start at iteration 0 with fresh data position,
    optimizer, scheduler and RNG (a new run initialised from the checkpoint)."""

    exit_signal_handler: bool = False
    """On SIGTERM (SLURM's preemption/time-limit signal) finish the current step, save, exit 0."""

    exit_interval: Optional[int] = None
    """Save and exit when the iteration is a multiple of this."""

    exit_duration_in_mins: Optional[float] = None
    """Save and exit once this many minutes have passed since the process started (Megatron-LM's
    meaning: start-up included). examples/slurm/pretrain_looplm.sbatch sets it from the job's end
    time."""

    ckpt_checksums: bool = True
    """Write a checksum of every file of a checkpoint at save (megaloop_manifest.json) and verify
    it at load, naming the file that is missing, cut short or changed; `false` skips both (for
    checkpoints too large to read twice)."""

    async_save: bool = False
    """Write checkpoints in the background (megatron-core's asynchronous torch_dist save): the
    loop blocks for the save's planning and a fork, each rank's writer process writes and hashes
    its shards while training goes on, and the checkpoint is published (manifest, rename,
    latest_checkpointed_iteration.txt) once every rank's writer has finished. The end of
    training and a SIGTERM exit wait for a pending save; a crash during one leaves the previous
    checkpoint named."""

    ckpt_fully_parallel_save: bool = field(
        default=True, metadata={"set_flags": {"--no-ckpt-fully-parallel-save": False}})
    """Megatron-LM's default: the data-parallel replicas of the model and optimizer split the
    writing of replicated tensors between them (megatron-core's FullyParallelSaveStrategyWrapper)
    instead of data-parallel rank 0 writing all of it."""

    ckpt_fully_parallel_load: bool = False
    """Megatron-LM's flag (off by default there too): data-parallel ranks each read a share and
    exchange it (megatron-core's FullyParallelLoadStrategyWrapper). Refused when on: the wrapper
    fails on CPU and is not verified on GPU here; every rank reads its own shards."""

    ckpt_assume_constant_structure: bool = False
    """Megatron-LM's flag: the checkpoint's structure (which tensors, which shards) is the same
    at every save, so megatron-core plans the save once and reuses the plan (less blocking
    time per save)."""

    exit_status_file: Optional[str] = None
    """Rank 0 writes how the run ended here (one JSON line: status completed, saved-and-stopped or
    failed, the reason, the iteration): for launchers whose own exit code hides the run's
    (torchrun exits 1 whenever it is signalled). examples/slurm/pretrain_looplm.sbatch reads it."""

    save_lock_timeout: float = 60.0
    """Minutes after which the lock file of --save (megaloop_run.lock: one run per folder) that a
    run on another host took counts as stale and is taken over: its holder refreshes it about
    once a minute while it trains. On this host a lock is stale as soon as its pid is gone, and
    anywhere as soon as squeue says the SLURM job that took it has ended."""

    def validate(self) -> None:
        super().validate()
        if self.ckpt_format != "torch_dist":
            raise ValueError(f"--ckpt-format {self.ckpt_format}: megaloop writes and reads "
                             f"megatron-core's torch_dist checkpoints only; use --ckpt-format "
                             f"torch_dist (convert others with Megatron-LM's tools)")
        if self.use_checkpoint_args and not self.load:
            raise ValueError("--use-checkpoint-args needs --load DIR (the checkpoint to read "
                             "the architecture from)")
        if self.save_interval is not None and self.save_interval < 1:
            raise ValueError(f"--save-interval {self.save_interval} must be >= 1")
        if self.save_interval and not self.save:
            raise ValueError("--save-interval needs --save DIR (where to write the checkpoints)")
        if self.exit_interval is not None and self.exit_interval < 1:
            raise ValueError(f"--exit-interval {self.exit_interval} must be >= 1")
        if self.save_lock_timeout <= 0:
            raise ValueError(f"--save-lock-timeout {self.save_lock_timeout} must be > 0 (minutes)")
        if self.exit_duration_in_mins is not None and self.exit_duration_in_mins <= 0:
            raise ValueError(f"--exit-duration-in-mins {self.exit_duration_in_mins} must be > 0")
        if self.finetune and not self.load:
            raise ValueError("--finetune needs --load DIR (the checkpoint to start from)")
        # Without this, a mistyped path or a Hugging Face folder would quietly train from
        # random weights (an empty --load equal to --save is a first launch: allowed).
        check_training_load(self.load, self.ckpt_step, save=self.save, finetune=self.finetune)
        if self.async_save and not self.save:
            raise ValueError("--async-save needs --save DIR (where to write the checkpoints)")
        if self.ckpt_fully_parallel_load:
            raise ValueError("--ckpt-fully-parallel-load is not supported: megatron-core's "
                             "FullyParallelLoadStrategyWrapper fails on CPU and is not verified "
                             "on GPU here; drop it (every rank reads its own shards)")
        if self.save:
            check_writable_dir(self.save, "--save")
        if self.exit_status_file:
            check_writable_dir(os.path.dirname(os.path.abspath(self.exit_status_file)),
                               "--exit-status-file's folder")


def check_writable_dir(path: str, what: str) -> None:
    """Fail now, not at the first save hours later, when ``path`` cannot be created or written:
    the nearest existing folder on its way must be a folder we can create a file in (tried for
    real: permission bits say nothing for root or on a read-only mount). Creates nothing."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"{what} {path}: {probe} is not a folder; choose another path")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        raise ValueError(f"{what} {path}: cannot write in {probe} ({exc.strerror}); choose a "
                         f"writable path") from None
