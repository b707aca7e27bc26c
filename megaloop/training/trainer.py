"""The training loop: megatron-core DDP, optimizer, LR schedule and forward-backward schedule.

megatron-core 0.16 ships no training loop, so this is megaloop's: it wires
``DistributedDataParallel`` + ``get_megatron_optimizer`` + ``OptimizerParamScheduler`` +
``get_forward_backward_func`` around the LoopedGPTModel, reads data through megatron-core's
dataset builder, and logs one line per interval with the per-step losses and exit distribution.

The loss is a per-token mean over the global batch (``calculate_per_token_loss``): each
micro-batch returns the *sum* of its per-token objective and its token count, and
``finalize_model_grads`` divides the gradients by the token count summed over all micro-batches
and data-parallel ranks. Masked tokens (SFT prompts) therefore weigh exactly nothing, whatever
micro-batch they land in.

Context parallelism (--context-parallel-size) is megatron-core's: every batch reaches the model
already cut to this rank's two chunks of each sequence (megaloop.data.datasets), the rotary table
is cut alike, attention is Transformer Engine's CP ring, ``finalize_model_grads`` sums the token
counts over data x context-parallel ranks and megatron-core's DDP reduces gradients over the same
group (``get_data_parallel_group(with_context_parallel=True)``); the statistics are summed there
too (``reduce_stats``). CP ranks of a data-parallel rank read the same samples: the data-parallel
size and rank here exclude CP.
"""

from __future__ import annotations

import os
import time
from functools import partial
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import (OptimizerConfig, get_megatron_optimizer,
                                     get_standard_config_overrides)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from megaloop.data.broadcast import BatchSpec, batch_stream, reads_data
from megaloop.data.datasets import build_train_valid_test_datasets
from megaloop.data.tokenizers import build_tokenizer
from megaloop.device import current_device
from megaloop.model.looped_gpt import build_model
from megaloop.model.loss import loss_func, reduce_stats
from megaloop.model.shortcut_objective import draw_route, route_generator
from megaloop.training import checkpointing
from megaloop.training.random_depth import draw_depth, no_grad_steps
from megaloop.training.exit_conditions import ExitConditions, RunError, write_exit_status
from megaloop.training.diagnostics import (GEOMETRY_KEYS, LoopDiagnostics, NonFiniteGuard,
                                           describe_samples)
from megaloop.training.async_checkpointing import AsyncSaver, checkpoint_save_strategy
from megaloop.training.startup import StartupTimer
from megaloop.training.metrics import (MetricsLogger, RunClock, flops_per_iteration,
                                       format_train_line, format_valid_line, peak_memory_gib)
from megaloop.runtime import print_rank_0
from megaloop.training.save_lock import SaveLock
from megaloop.training.step_hooks import StepHooks, params_norm
from megaloop.training.run_config import RunConfig

# Run-config sections no flag sets, which a loaded checkpoint passes on to this run's saves: the
# model's default exit rule and where it came from (import-hf of a looped folder writes them).
INHERITED_SECTIONS = ("generation", "source")


# --- one micro-batch ---------------------------------------------------------------------------
def forward_step(data_iterator, model, num_loops: int, no_grad_steps: int = 0, routes=None):
    """``routes``: --loopformer-objective's shorter route for each micro-batch, in order."""
    batch = next(data_iterator)
    extra = {} if routes is None else {"short_route": next(routes)}
    out = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                labels=batch["labels"], num_loops=num_loops, no_grad_steps=no_grad_steps,
                **extra)
    return out, partial(loss_func, batch["loss_mask"], num_loops)


# --- building the pieces -----------------------------------------------------------------------
def build_optimizer(cfg: RunConfig, model):
    opt = cfg.optim
    config = OptimizerConfig(optimizer="adam", lr=opt.lr, min_lr=opt.min_lr,
                             weight_decay=opt.weight_decay, adam_beta1=opt.adam_beta1,
                             adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps,
                             clip_grad=opt.clip_grad, bf16=cfg.training.bf16,
                             params_dtype=torch.bfloat16 if cfg.training.bf16 else torch.float32,
                             use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
                             decoupled_lr=opt.decoupled_lr, decoupled_min_lr=opt.decoupled_min_lr)
    overrides = param_group_overrides(config)
    if opt.optimizer == "muon":
        from megaloop.training.muon import get_muon_optimizer

        optimizer = get_muon_optimizer(config, [model], momentum=opt.muon_momentum,
                                       nesterov=opt.muon_use_nesterov,
                                       ns_steps=opt.muon_num_ns_steps,
                                       scale_mode=opt.muon_scale_mode,
                                       extra_scale_factor=opt.muon_extra_scale_factor,
                                       config_overrides=overrides)
    else:
        optimizer = get_megatron_optimizer(config, [model], config_overrides=overrides)
    scheduler = build_scheduler(cfg, optimizer, parallel_state.get_data_parallel_world_size())
    return optimizer, scheduler


def param_group_overrides(config: OptimizerConfig) -> dict:
    """megatron-core's standard parameter groups (no weight decay on biases and 1-D parameters;
    the embedding and output layer at --decoupled-lr / --decoupled-min-lr) with the decoupled
    groups marked ``is_decoupled_lr``. megatron-core 0.16.1 leaves that mark False on every
    group, yet matches a checkpoint's groups to this run's by (wd_mult, lr_mult,
    is_expert_parallel, is_decoupled_lr): a decoupled group and the default one then share a key
    and a resume fails (or hands one group's LR bounds to the other)."""
    overrides = get_standard_config_overrides(config)
    for override in overrides.values():
        if "max_lr" in override:  # the --decoupled-lr group's override
            override["is_decoupled_lr"] = True
    return overrides


def build_scheduler(cfg: RunConfig, optimizer, dp_size: int) -> OptimizerParamScheduler:
    """megatron-core's LR / weight-decay scheduler. It counts samples (as Megatron-LM) under
    --train-samples or --rampup-batch-size and iterations otherwise (the same schedule divided by
    the constant global batch); Trainer.train_step steps it by the matching increment."""
    opt = cfg.optim
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=opt.lr, min_lr=opt.min_lr,
        lr_decay_style=opt.lr_decay_style, start_wd=opt.weight_decay, end_wd=opt.weight_decay,
        wd_incr_style="constant", lr_wsd_decay_style=opt.lr_wsd_decay_style,
        **opt.schedule_steps(cfg.training, dp_size),
        # megatron-core defaults to the checkpoint's schedule, silently; Megatron-LM's trainer
        # (and megaloop) refuse a difference unless one of the two flags says which to take.
        override_opt_param_scheduler=opt.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=opt.use_checkpoint_opt_param_scheduler)


def build_training_model(cfg: RunConfig, vocab_size: int):
    """The LoopedGPTModel (or its pipeline stage) wrapped for bf16 and megatron-core DDP."""
    if cfg.parallel.pipeline_model_parallel_size > 1:
        from megaloop.parallel.pipeline import build_pipeline_stage, schedule_config

        model = build_pipeline_stage(cfg, vocab_size)
        config = schedule_config(model.config)
    else:
        model = build_model(cfg.model, cfg.loop, vocab_size,
                            tp_size=cfg.parallel.tensor_model_parallel_size,
                            sequence_parallel=cfg.parallel.sequence_parallel,
                            bf16=cfg.training.bf16, recompute=cfg.recompute.transformer_kwargs())
        config = model.config
    if cfg.loop.exit_loss == "adaptive-gate":  # Ouro stage II: only the exit gate trains
        for name, p in model.named_parameters():
            p.requires_grad = name.startswith("exit_gate.")
    model.cuda(current_device())  # under the CPU shim a no-op that its placement check sees
    if cfg.training.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not cfg.parallel.grad_reduce_in_bf16,
        overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
        overlap_param_gather=cfg.parallel.overlap_param_gather,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    if cfg.parallel.overlap_grad_reduce:
        config.no_sync_func = model.no_sync
        config.grad_sync_func = model.start_grad_sync
    return model, config


def count_parameters(model) -> int:
    """Parameters of the whole model (summed over tensor-parallel shards and pipeline stages;
    shared counted once: the last stage's copy of a tied embedding is marked `shared`)."""
    local = sum(p.numel() for p in model.parameters()
                if (getattr(p, "tensor_model_parallel", False)
                    or parallel_state.get_tensor_model_parallel_rank() == 0)
                and not getattr(p, "shared", False))
    total = torch.tensor([local], dtype=torch.float64, device=current_device())  # for NCCL
    torch.distributed.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return int(total.item())


# --- the loop ----------------------------------------------------------------------------------
class Trainer:
    def __init__(self, cfg: RunConfig, startup: Optional[StartupTimer] = None):
        self.cfg = cfg
        # Phases so far (imports, process groups) come from the entry point; the trainer marks
        # the rest up to the end of the first step (megaloop.training.startup).
        self.startup = startup or StartupTimer(from_process_start=False)
        # One run per --save folder: the lock comes first (a refused run builds nothing, opens no
        # log) and before anything in the folder is removed or written
        # (megaloop.training.save_lock); released if the start-up fails.
        self.save_lock = SaveLock.acquire(cfg.checkpoint.save, cfg.checkpoint.save_lock_timeout,
                                          print_rank_0)
        tr = cfg.training
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.gbs = tr.resolved_global_batch(self.dp_size)
        self.num_microbatches = tr.num_microbatches(self.dp_size)
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        if cfg.parallel.pipeline_model_parallel_size > 1:
            from megaloop.parallel.balance import plan

            split = plan(cfg, self.tokenizer.vocab_size, self.num_microbatches)
            print_rank_0(f"> pipeline: {split.describe()}")
        self.model, self.config = build_training_model(cfg, self.tokenizer.vocab_size)
        self.startup.mark("model")
        self.optimizer, self.scheduler = build_optimizer(cfg, self.model)
        self.startup.mark("optimizer")
        self.iteration, self.consumed_samples, self.skipped = 0, 0, 0
        self.last_saved = None
        self.inherited = {}  # run-config sections a loaded checkpoint passes on (_load)
        self.save_due = False  # a --save-interval save that fell on skipped steps
        self.logger = MetricsLogger(cfg.logging, cfg.to_dict(),
                                    is_writer=torch.distributed.get_rank() == 0)
        self.forward_backward = get_forward_backward_func()
        self.pipeline = None
        if cfg.parallel.pipeline_model_parallel_size > 1:
            from megaloop.parallel.pipeline import LoopPipeline

            self.pipeline = LoopPipeline(self.model, self.config, cfg.loop)
        self.diagnostics = LoopDiagnostics(cfg, self.model, self.logger)
        self.guard = NonFiniteGuard(tr.check_for_nan_in_loss_and_grad,
                                    tr.max_skipped_steps_in_a_row)
        self.hooks = StepHooks(tr, cfg.logging, torch.distributed.get_rank(),
                               cfg.checkpoint.save)
        ck = cfg.checkpoint
        self.save_strategy = checkpoint_save_strategy(ck.ckpt_fully_parallel_save,
                                                      ck.ckpt_assume_constant_structure)
        self.async_saver = AsyncSaver() if ck.async_save else None
        try:
            self._remove_stale_saves()
            self.load_info = self._load()
            self.startup.mark("checkpoint load")
            self._build_data()
            self.startup.mark("data index")
        except BaseException:
            self.save_lock.release()
            raise

    def _remove_stale_saves(self) -> None:
        """Saves that never finished (killed, disk full) left iter_*.tmp folders: rank 0 removes
        them before anything is saved or loaded, and says so."""
        if torch.distributed.get_rank() == 0:
            for path in checkpointing.remove_stale_saves(self.cfg.checkpoint.save):
                self.logger.print(f"> removed {path}, left by a save that did not finish")
        torch.distributed.barrier()

    def _load(self):
        """Resume from --load (weights, optimizer, scheduler, RNG, position in the data)."""
        ck = self.cfg.checkpoint
        if not ck.load:
            return None
        info = checkpointing.load_checkpoint(
            ck.load, self.model, self.optimizer, self.scheduler, iteration=ck.ckpt_step,
            load_optim=not ck.no_load_optim, load_rng=not ck.no_load_rng, finetune=ck.finetune,
            run_config=self.cfg.to_dict(), verify=ck.ckpt_checksums)
        if info is None:
            self.logger.print(f"> no checkpoint in --load {ck.load}: starting from scratch")
            return None
        self.iteration, self.consumed_samples = info["iteration"], info["consumed_samples"]
        saved = info["run_config"] or {}
        self.inherited = {k: saved[k] for k in INHERITED_SECTIONS if k in saved}
        self.last_saved = self.iteration if ck.save == ck.load else None
        self.skipped = info["extra"].get("skipped_iters", 0)
        for note in info["notes"]:
            self.logger.print(note)
        self.logger.print(
            f"> loaded {info['path']} (iteration {self.iteration}, consumed samples "
            f"{self.consumed_samples}, optimizer {'yes' if info['loaded_optim'] else 'no'}, "
            f"rng {'yes' if info['loaded_rng'] else 'no'})")
        return info

    def sync_params(self) -> None:
        """With --overlap-param-gather the updated weights arrive during the next forward pass;
        whatever reads them outside one (a save, the parameter norm) gathers them first."""
        if self.cfg.parallel.overlap_param_gather:
            self.model.disable_forward_pre_hook(param_sync=True)
            self.model.enable_forward_pre_hook()

    def save_if_due(self, applied: bool) -> None:
        """After a step (``applied``: it was not skipped): save at a --save-interval iteration.
        Nothing is saved while steps are being skipped (`latest` stays on the weights from
        before them); a save that falls there is made after the first step applied again."""
        ck = self.cfg.checkpoint
        if ck.save and ck.save_interval and (self.iteration % ck.save_interval == 0
                                             or self.save_due):
            self.save_due = not applied
            if applied:
                self.save()

    def save(self) -> None:
        self.finalize_saves(blocking=True)  # the previous --async-save is published (or failed)
        self.sync_params()
        ck = self.cfg.checkpoint
        start = time.time()
        # --no-save-optim leaves out the optimizer and the LR schedule (as Megatron-LM); a load
        # then starts both afresh, as --no-load-optim would.
        optim = (None, None) if ck.no_save_optim else (self.optimizer, self.scheduler)
        path = checkpointing.save_checkpoint(
            ck.save, self.iteration, self.model, *optim,
            run_config={**self.cfg.to_dict(), **self.inherited},
            consumed_samples=self.consumed_samples, extra=self.checkpoint_extra(),
            checksums=ck.ckpt_checksums,
            save_rng=not ck.no_save_rng, saver=self.async_saver, strategy=self.save_strategy)
        self.last_saved = self.iteration
        if self.async_saver is None:
            self.logger.print(f"> saved {path} in {time.time() - start:.2f} s")
        else:
            self.logger.print(f"> saving {path} in the background (the loop waited "
                              f"{time.time() - start:.2f} s)")

    def checkpoint_extra(self) -> dict:
        """The trainer's counters a checkpoint keeps (a subclass adds its own: the RL trainer's
        reference policy, megaloop/rl/train.py)."""
        return {"skipped_iters": self.skipped}

    def finalize_saves(self, blocking: bool) -> None:
        """--async-save: publish the pending save once every rank's writer is done (collective
        while one is pending); ``blocking`` waits for it (end of training, exit)."""
        try:
            done = self.async_saver.maybe_finalize(blocking) if self.async_saver else None
        except checkpointing.CheckpointError:
            # That save was never published (its .tmp is removed): the run's last checkpoint,
            # which --exit-status-file reports, is still the one `latest` names.
            self.last_saved = checkpointing.read_tracker(self.cfg.checkpoint.save)
            raise
        if done is not None:
            self.logger.print(f"> saved {done[1]} ({done[2]:.2f} s after it started)")

    def _build_data(self):
        """Datasets and batch streams. Only the first tensor-parallel rank of the first and last
        pipeline stages builds datasets and samples (megaloop.data.broadcast); every rank gets
        its stream."""
        tr = self.cfg.training
        spec = BatchSpec(tr.micro_batch_size, tr.seq_length, self.cfg.data.reset_attention_mask,
                         self.tokenizer.vocab_size)
        evals = (tr.train_iters // tr.eval_interval + 1) * tr.eval_iters * self.gbs
        train, valid, _ = build_train_valid_test_datasets(
            self.cfg.data, self.tokenizer, tr.seq_length, tr.seed,
            (tr.train_samples_total(self.dp_size), evals, 0),
            built_on_this_rank=reads_data(spec))
        self.train_dataset = train  # names the data of a loss spike's batch (rank 0 reads)
        self.train_iter = batch_stream(
            train, spec, self.consumed_samples, self.dp_rank, self.dp_size,
            num_workers=self.cfg.data.num_workers)
        # Whether validation data exists is known to the reading ranks only.
        has_valid = torch.tensor([float(valid is not None)], device=current_device())
        torch.distributed.all_reduce(has_valid, op=torch.distributed.ReduceOp.MAX)
        self.valid_iter = None
        if has_valid.item() and tr.eval_iters > 0:
            # Validation continues where the evaluations before a resume stopped.
            valid_consumed = (self.iteration // tr.eval_interval) * tr.eval_iters * self.gbs
            self.valid_iter = batch_stream(
                valid, spec, valid_consumed, self.dp_rank, self.dp_size,
                num_workers=self.cfg.data.num_workers, cyclic=True)

    def describe(self) -> None:
        m, loop = self.cfg.model, self.cfg.loop
        params = count_parameters(self.model)
        self.logger.print(
            f"> LoopedGPT layout {loop.num_prelude_layers} + {loop.num_core_layers(m.num_layers)} "
            f"x {loop.num_loops} + {loop.num_coda_layers} | physical depth {m.num_layers} | "
            f"effective depth {loop.effective_depth(m.num_layers)} | parameters {params:,} | "
            f"exit loss {loop.exit_loss} | TP {self.cfg.parallel.tensor_model_parallel_size} "
            f"CP {self.cfg.parallel.context_parallel_size} "
            f"PP {self.cfg.parallel.pipeline_model_parallel_size} "
            f"DP {self.dp_size} | micro-batches per step {self.num_microbatches}")

    def depth(self, iteration: int) -> int:
        """Loop count of training iteration ``iteration`` (1-based): --num-loops, or the random
        depth drawn from (seed, iteration), the same on every rank and after a resume."""
        loop = self.cfg.loop
        if loop.random_depth_mean <= 0:
            return loop.num_loops
        return draw_depth(loop.random_depth_mean, loop.random_depth_sigma,
                          self.cfg.training.seed, iteration, loop.random_depth_max)

    def _run(self, data_iterator, forward_only: bool, num_loops: Optional[int] = None):
        tr = self.cfg.training
        T = num_loops or self.cfg.loop.num_loops
        # Every micro-batch of one call runs the same T (and truncation) on every rank.
        truncated = 0 if forward_only else no_grad_steps(
            self.cfg.loop.truncated_backprop_steps, T, self.cfg.loop.backprop_last_steps)
        if self.pipeline is not None:
            return self.pipeline.run(data_iterator, self.num_microbatches, tr.seq_length,
                                     tr.micro_batch_size, forward_only, num_loops=T,
                                     no_grad_steps=truncated)
        routes = None
        if self.cfg.loop.loopformer_objective and not forward_only:
            # This step's shorter routes: from (seed, iteration, micro-batch), as after a resume.
            routes = iter([draw_route(T, route_generator(tr.seed, self.iteration + 1, m))
                           for m in range(self.num_microbatches)])
        return self.forward_backward(
            forward_step_func=partial(forward_step, num_loops=T, no_grad_steps=truncated,
                                      routes=routes),
            data_iterator=data_iterator, model=[self.model],
            num_microbatches=self.num_microbatches, seq_length=tr.seq_length,
            micro_batch_size=tr.micro_batch_size, forward_only=forward_only)

    def train_step(self) -> tuple[dict, float, bool]:
        tr = self.cfg.training
        # --rampup-batch-size: this step's global batch follows the samples consumed so far.
        self.step_gbs = tr.global_batch_at(self.consumed_samples, self.dp_size)
        self.num_microbatches = self.step_gbs // (tr.micro_batch_size * self.dp_size)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        depth = self.depth(self.iteration + 1)
        reports = self._run(self.train_iter, forward_only=False, num_loops=depth)
        # The rate this step applies to the groups that follow --lr (megatron-core's
        # "default_config" groups; the --decoupled-lr ones follow their own bounds).
        self.lr = next(g["lr"] for g in self.optimizer.param_groups if g["default_config"])
        # The stats hold the step losses of this iteration's T (the same on every rank).
        stats = reduce_stats(reports, depth, device=current_device())
        # --check-for-nan-in-loss-and-grad: a non-finite step is skipped on every rank alike.
        if self.guard.step_is_finite(self.model, stats["loss"]):
            ok, grad_norm, _ = self.optimizer.step()
        else:
            ok, grad_norm = False, float("nan")
        if ok:
            self.scheduler.step(increment=self.step_gbs if tr.counts_samples() else 1)
        else:
            self.skipped += 1
        return {**stats, "depth": depth}, grad_norm, ok

    @torch.no_grad()
    def evaluate(self) -> dict:
        # Validation rounds are whole --global-batch-size batches, whatever the ramp-up is at.
        self.num_microbatches = self.cfg.training.num_microbatches(self.dp_size)
        self.model.eval()
        reports = []
        self.diagnostics.eval_start()
        for _ in range(self.cfg.training.eval_iters):
            reports.extend(self._run(self.valid_iter, forward_only=True))
        geometry = self.diagnostics.eval_finish()
        self.model.train()
        stats = reduce_stats(reports, self.cfg.loop.num_loops, device=current_device())
        return {**stats, **geometry}

    def log_eval(self) -> None:
        if self.valid_iter is None:
            return
        with self.hooks.around_eval():
            r = self.evaluate()
        geometry = {k: r[k] for k in GEOMETRY_KEYS if k in r}
        record = {"iteration": self.iteration, "split": "valid", "loss": r["loss"],
                  "step_losses": r["step_losses"], "exit_probs": r["exit_probs"], **geometry}
        self.logger.log(record, line=format_valid_line(record))

    def train(self) -> Optional[str]:
        """Train to --train-iters; returns why it stopped early (a save was made), else None.
        The --save folder's lock is released at the end, however the run ends."""
        try:
            return self._train()
        finally:
            self.save_lock.release()
            self.hooks.close()

    def _train(self) -> Optional[str]:
        # --exit-duration-in-mins counts from the process's start, as Megatron-LM's does (the
        # SLURM script derives it from the job's end time, start-up included).
        exits = ExitConditions(self.cfg.checkpoint, start_time=self.startup.start)
        exits.install()
        start_iteration = self.iteration
        try:
            reason = self._train_loop(exits)
        finally:
            exits.uninstall()
        ck = self.cfg.checkpoint
        saved = bool(ck.save) and self.last_saved == self.iteration
        # Stopped before the first step (a SIGTERM during the start-up): the run's state is the
        # checkpoint it started from, or none yet; nothing to save (and megatron-core's optimizer
        # has no state to save before its first step).
        untrained = reason is not None and self.iteration == start_iteration
        if untrained:
            kept = (f"the run's state is checkpoint iteration {self.iteration} in {ck.load}"
                    if self.load_info else "no checkpoint yet, a resubmission starts from scratch")
            reason += f"; nothing trained, so nothing to save: {kept}"
        elif ck.save and not saved:
            if self.guard.in_a_row:  # the run ends on skipped steps: nothing saved (see above)
                self.logger.print(
                    f"> not saving iteration {self.iteration}: its last {self.guard.in_a_row} "
                    f"steps were skipped (non-finite loss or gradients); {checkpointing.TRACKER} "
                    f"names {self.last_saved}")
            else:
                self.save()
                saved = True
        self.finalize_saves(blocking=True)  # a pending --async-save is published before exit
        if reason is None:
            self.log_eval()
        else:
            self.logger.print(f"> exiting: {reason}")
        if ck.exit_status_file:
            # Written before the ranks may leave: once one exits, a launcher (srun
            # --kill-on-bad-exit) may kill the others, rank 0 included.
            if torch.distributed.get_rank() == 0:
                status = "completed" if reason is None else (
                    "saved-and-stopped" if saved or untrained else "stopped")
                write_exit_status(ck.exit_status_file, status, reason or "trained to "
                                  "--train-iters", self.iteration, self.last_saved)
            torch.distributed.barrier()
        self.logger.close()
        return reason

    def _after_divergence(self) -> str:
        """The second half of the stop message of a diverged run: what is kept, how to resume.
        Collective (all ranks stop at the same step). When the skipped steps began right after a
        checkpoint, that checkpoint's weights are the ones that diverged: it is set aside and
        `latest` goes back to the one before (``checkpointing.set_aside_diverged``)."""
        self.finalize_saves(blocking=True)  # an --async-save in flight is published first
        ck, lr = self.cfg.checkpoint, self.cfg.optim.lr
        lower = f"--lr {lr / 10:g} --override-opt_param-scheduler"
        text = "Nothing was saved while steps were skipped"
        if ck.save and self.last_saved is not None and self.last_saved == self.guard.first - 1:
            was = checkpointing.checkpoint_dir(ck.save, self.last_saved)
            self.last_saved = checkpointing.set_aside_diverged(ck.save, self.last_saved)
            text += (f"; {was}, saved right before them from the weights that gave them, is set "
                     f"aside as {os.path.basename(was)}.diverged")
        if self.last_saved is not None:
            return (f"{text}. {checkpointing.TRACKER} in {ck.save} names iteration "
                    f"{self.last_saved}, from before the skipped steps: resume from it with a "
                    f"lower LR, e.g. --load {ck.save} {lower} (or a longer --lr-warmup-iters, a "
                    f"smaller --clip-grad)")
        if self.load_info is not None and ck.load != ck.save:
            return (f"{text}. This run saved no checkpoint before them: resume from --load "
                    f"{ck.load} (iteration {self.load_info['iteration']}) with a lower LR, e.g. "
                    f"{lower}")
        return (f"{text}. No checkpoint was saved before them: start again with a lower LR "
                f"(e.g. --lr {lr / 10:g}), a longer --lr-warmup-iters or a smaller --clip-grad")

    def _train_loop(self, exits: ExitConditions) -> Optional[str]:
        tr, log = self.cfg.training, self.cfg.logging
        world = torch.distributed.get_world_size()
        self.describe()
        window_start, window_iters, window_flops, window_samples = time.time(), 0, 0.0, 0
        clock = RunClock(tr.train_iters)  # elapsed and ETA of this process's training
        startup = None
        reason = exits.before_training(self.iteration)
        if reason is not None:
            return reason
        while self.iteration < tr.train_iters:
            self.diagnostics.before_step(
                will_log=(self.iteration + 1) % log.log_interval == 0
                or self.iteration + 1 == tr.train_iters)
            consumed_before = self.consumed_samples
            self.hooks.before_step(self.iteration)
            stats, grad_norm, applied = self.train_step()
            self.finalize_saves(blocking=False)
            if not self.startup.done:
                startup = self.startup.finish("first step")
                self.logger.print(self.startup.line())
            self.iteration += 1
            clock.step_done(self.iteration)
            self.hooks.after_step(self.iteration)
            self.save_lock.refresh()
            gbs = self.step_gbs
            diagnostics = self.diagnostics.after_step(
                stats, self.iteration, describe_batch=lambda: describe_samples(
                    self.train_dataset, consumed_before, gbs))
            self.consumed_samples += gbs
            window_iters += 1
            window_samples += gbs
            # Each iteration counts at the loop count it ran (random depth draws it per step).
            window_flops += flops_per_iteration(self.cfg.model, self.cfg.loop,
                                                self.tokenizer.vocab_size, tr.seq_length, gbs,
                                                num_loops=stats["depth"])
            if self.iteration % log.log_interval == 0 or self.iteration == tr.train_iters:
                elapsed = (time.time() - window_start) / window_iters
                probs = stats["exit_probs"]
                record = {
                    "iteration": self.iteration, "split": "train", "train_iters": tr.train_iters,
                    "consumed_samples": self.consumed_samples, "loss": stats["loss"],
                    "step_losses": stats["step_losses"], "exit_probs": probs,
                    "p0": probs[0] if probs else None,
                    "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                    "lr": self.lr,
                    "ms_per_iter": elapsed * 1000.0,
                    "tokens_per_sec": window_samples * tr.seq_length / elapsed / window_iters,
                    "tflops_per_gpu": window_flops / window_iters / elapsed / world / 1e12,
                    "skipped_iters": self.skipped, "mem_gib": peak_memory_gib(),
                    "depth": stats["depth"],
                    "elapsed_s": clock.elapsed_s(), "eta_s": clock.eta_s(),
                    **diagnostics,
                }
                if startup is not None:  # the first record of this process carries start-up
                    record["startup_s"], startup = startup, None
                if log.log_params_norm:
                    self.sync_params()
                    record["params_norm"] = params_norm(self.model)
                line = format_train_line(record)
                if self.cfg.loop.random_depth_mean > 0:
                    line += f" | depth {record['depth']}"
                self.logger.log(record, line=line)
                window_start, window_iters, window_flops, window_samples = time.time(), 0, 0.0, 0
            # After the log line, so the skipped steps show before the run stops.
            diverged = self.guard.record(applied, self.iteration)
            if diverged:
                raise RunError(f"{diverged}. {self._after_divergence()}")
            if self.iteration % tr.eval_interval == 0 and self.iteration < tr.train_iters:
                self.log_eval()
            self.save_if_due(applied)
            reason = exits.reason(self.iteration)
            if reason is not None:
                return reason
        return None
