"""Training, optimizer and logging configuration (Megatron-LM's flag names)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Literal, Optional


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

    train_iters: int = 20
    """Optimizer steps to train for."""

    seed: int = 1234
    """Seed of weights, data order and dropout (the same on every rank)."""

    bf16: bool = False
    """bf16 parameters and compute with fp32 main weights (GPU)."""

    eval_interval: int = 1000
    """Run validation every this many iterations (and at the end)."""

    eval_iters: int = 100
    """Validation micro-batch rounds per evaluation (each round is one global batch; 0: no
    validation)."""

    check_for_nan_in_loss_and_grad: bool = True
    """Check every step's loss and gradients on every rank (as Megatron-LM's flag); a step where
    any is NaN or infinite is skipped (no update, no LR-schedule step) and counted in the log's
    "skipped". `false` applies every step as it comes (a diverged run then stops at its next save,
    which refuses non-finite weights)."""

    max_skipped_steps_in_a_row: int = 10
    """Stop the run (exit code 1, nothing saved after the last good checkpoint) when this many
    steps in a row were skipped: the run has diverged and skipping will not bring it back."""

    def num_microbatches(self, dp_size: int) -> int:
        return self.resolved_global_batch(dp_size) // (self.micro_batch_size * dp_size)

    def resolved_global_batch(self, dp_size: int) -> int:
        return self.global_batch_size or self.micro_batch_size * dp_size

    def validate(self, dp_size: int, max_position_embeddings: int) -> None:
        if self.micro_batch_size < 1 or self.train_iters < 0 or self.seq_length < 1:
            raise ValueError("--micro-batch-size and --seq-length must be >= 1, --train-iters >= 0")
        gbs = self.resolved_global_batch(dp_size)
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

    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "linear"
    """Shape of the decay after warmup (Megatron-LM's default linear; the recipes use cosine)."""

    lr_decay_iters: Optional[int] = None
    """Iterations over which the LR decays (default: --train-iters)."""

    lr_wsd_decay_iters: Optional[int] = None
    """WSD only: length of the final decay phase."""

    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = "exponential"
    """WSD only: shape of the final decay phase."""

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

    def validate(self, train_iters: int) -> None:
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError("--override-opt_param-scheduler and --use-checkpoint-opt_param-"
                             "scheduler contradict each other: pass one of them")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= --min-lr ({self.min_lr}) <= --lr ({self.lr}) and --lr > 0")
        decay = self.lr_decay_iters or train_iters
        # megatron-core's scheduler asserts warmup < decay steps, whatever the decay style.
        if self.lr_warmup_iters < 0 or (self.lr_warmup_iters > 0
                                        and self.lr_warmup_iters >= max(decay, 1)):
            raise ValueError(f"--lr-warmup-iters {self.lr_warmup_iters} must be >= 0 and below "
                             f"--lr-decay-iters ({decay}; default --train-iters)")
        if self.lr_decay_style == "WSD" and not self.lr_wsd_decay_iters:
            raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters")
        if self.optimizer == "muon":
            if not 0.0 <= self.muon_momentum < 1.0:
                raise ValueError(f"--muon-momentum {self.muon_momentum} must be in [0, 1)")
            if self.muon_num_ns_steps < 1:
                raise ValueError(f"--muon-num-ns-steps {self.muon_num_ns_steps} must be >= 1")
            if self.muon_extra_scale_factor <= 0:
                raise ValueError(f"--muon-extra-scale-factor {self.muon_extra_scale_factor} "
                                 f"must be > 0")


@dataclass
class LoggingConfig:
    """What is logged where."""

    log_interval: int = 100
    """Print (and record) one line every this many iterations."""

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
    --loss-spike-window iterations (Closing the Loop App. A); a run of such iterations counts
    once."""

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
        if self.loss_spike_window < 1 or self.loss_spike_threshold <= 0:
            raise ValueError(f"--loss-spike-window ({self.loss_spike_window}) must be >= 1 and "
                             f"--loss-spike-threshold ({self.loss_spike_threshold}) > 0")
        if self.p0_collapse_iters < 1 or not 0.0 <= self.p0_collapse_threshold < 1.0:
            raise ValueError(f"--p0-collapse-iters ({self.p0_collapse_iters}) must be >= 1 and "
                             f"--p0-collapse-threshold ({self.p0_collapse_threshold}) in [0, 1)")
        if self.tensorboard_dir:
            try:
                import torch.utils.tensorboard  # noqa: F401
            except Exception as exc:
                raise ValueError(f"--tensorboard-dir needs tensorboard ({exc}); "
                                 "pip install -e '.[log]'") from exc
        if self.wandb_project:
            try:
                import wandb  # noqa: F401
            except Exception as exc:
                raise ValueError(f"--wandb-project needs wandb ({exc}); pip install -e '.[log]'") \
                    from exc


@dataclass
class CheckpointConfig:
    """Saving, loading and stopping (Megatron-LM's flags and directory layout)."""

    save: Optional[str] = None
    """Directory to save checkpoints to (iter_XXXXXXX/ + latest_checkpointed_iteration.txt)."""

    save_interval: Optional[int] = None
    """Save every this many iterations (and at the end of training, and on exit)."""

    load: Optional[str] = None
    """Directory to resume from (its latest checkpoint); a directory without one starts fresh."""

    ckpt_step: Optional[int] = None
    """Load this iteration instead of the one named in latest_checkpointed_iteration.txt."""

    no_load_optim: bool = False
    """Do not load the optimizer and LR-scheduler state (the model's weights only)."""

    no_load_rng: bool = False
    """Do not restore the random-number generators."""

    finetune: bool = False
    """Load the model's weights only and start at iteration 0 with fresh data position,
    optimizer, scheduler and RNG (a new run initialised from the checkpoint)."""

    exit_signal_handler: bool = False
    """On SIGTERM (SLURM's preemption/time-limit signal) finish the current step, save, exit 0."""

    exit_interval: Optional[int] = None
    """Save and exit when the iteration is a multiple of this."""

    exit_duration_in_mins: Optional[float] = None
    """Save and exit once the run has trained for this many minutes."""

    ckpt_checksums: bool = True
    """Write a checksum of every file of a checkpoint at save (megaloop_manifest.json) and verify
    it at load, naming the file that is missing, cut short or changed; `false` skips both (for
    checkpoints too large to read twice)."""

    exit_status_file: Optional[str] = None
    """Rank 0 writes how the run ended here (one JSON line: status completed, saved-and-stopped or
    failed, the reason, the iteration): for launchers whose own exit code hides the run's
    (torchrun exits 1 whenever it is signalled). examples/slurm/pretrain_looplm.sbatch reads it."""

    def validate(self) -> None:
        if self.save_interval is not None and self.save_interval < 1:
            raise ValueError(f"--save-interval {self.save_interval} must be >= 1")
        if self.save_interval and not self.save:
            raise ValueError("--save-interval needs --save DIR (where to write the checkpoints)")
        if self.exit_interval is not None and self.exit_interval < 1:
            raise ValueError(f"--exit-interval {self.exit_interval} must be >= 1")
        if self.exit_duration_in_mins is not None and self.exit_duration_in_mins <= 0:
            raise ValueError(f"--exit-duration-in-mins {self.exit_duration_in_mins} must be > 0")
        if self.ckpt_step is not None and not self.load:
            raise ValueError("--ckpt-step needs --load DIR")
        if self.finetune and not self.load:
            raise ValueError("--finetune needs --load DIR (the checkpoint to start from)")
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
