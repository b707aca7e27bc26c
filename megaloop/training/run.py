"""The run sequence of a training process: ``run(argv) -> exit code``, which pretrain_looplm.py
calls, in three pieces a caller may also take one by one (the tests drive training through them):

1. ``configure(argv)``: flags -> a validated RunConfig, before any process group (a bad flag or
   a checkpoint that does not fit the flags is a ValueError: exit 2);
2. ``start(cfg)``: the CPU shim where there is no CUDA, then torch.distributed, megatron-core's
   groups and the RNGs;
3. ``train(cfg)``: the Trainer to --train-iters, or to an early stop after a save; a RunError or
   CheckpointError is printed once and becomes its exit code (--exit-status-file says which).

Exit codes (megaloop/training/exit_conditions.py): 0 trained to the end, or stopped early after
saving; 1 the run failed (non-finite steps in a row, a failed save or load); 2 bad flags, or a
checkpoint that does not fit them.

Only the standard library and the config dataclasses load before the flags are parsed: ``--help``
and a bad flag answer without importing torch or megatron-core.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional


def configure(argv: Optional[list] = None):
    """Parse and validate the flags (``argv``: sys.argv[1:] if None) into a RunConfig: TE's
    attention switches set, --use-checkpoint-args applied, the checkpoint to resume checked
    (readable, of this architecture). Raises ValueError for a refusal; argparse's own exit
    (--help, an unknown flag) is a SystemExit."""
    from megaloop import runtime
    from megaloop.training import sigterm
    from megaloop.training.run_config import check_before_imports, parse_args

    cfg = parse_args(argv)
    check_before_imports(cfg)  # the flags' own mistakes, before the imports below take seconds
    if cfg.checkpoint.exit_signal_handler:
        sigterm.catch()  # now, not at the first step: the start-up takes a while (see there)
    # A GPU node whose CUDA does not start must not train in the CPU development mode.
    from megaloop.device import refuse_cpu_fallback

    refuse_cpu_fallback(sys.argv[1:] if argv is None else argv)
    # TE's attention switches for --attention-backend, before anything imports megatron-core
    # (whose import imports Transformer Engine); validate() sets them again.
    runtime.set_attention_backend_env(cfg.model.attention_backend)
    runtime.quiet_megatron()  # validate() may import megatron-core; filter its warnings first
    from megaloop.parallel.initialize import single_process_env
    from megaloop.training import checkpointing

    single_process_env()  # no launcher: a world of one (validation reads the world size)
    if cfg.checkpoint.use_checkpoint_args:
        changed = checkpointing.apply_checkpoint_args(cfg)
        if changed:
            runtime.print_rank_0("> --use-checkpoint-args: from the checkpoint "
                                 + ", ".join(changed))
    cfg.validate()  # before any process group starts: a bad flag fails fast on every rank
    # The checkpoint to resume: readable, and of this architecture (no process group needed).
    checkpointing.check_resume(cfg.checkpoint.load, cfg.checkpoint.ckpt_step, cfg.to_dict())
    return cfg


def start(cfg, startup=None) -> None:
    """The CPU shim (only without CUDA), then the process groups and RNGs of ``cfg``.
    ``startup``: a StartupTimer, marked after the imports and after the process groups."""
    from megaloop import cpu_shim, runtime

    if cpu_shim.enable():
        runtime.print_rank_0("> CPU development mode: megatron-core's CUDA calls run on CPU "
                             "(megaloop.cpu_shim), collectives on gloo, layers on the local spec")
    from megaloop.parallel import initialize
    from megaloop.training import trainer  # noqa: F401  (its imports count as start-up imports)

    if startup is not None:
        startup.mark("imports")  # with flag parsing and validation
    initialize.initialize(cfg.parallel, cfg.training.seed)
    if startup is not None:
        startup.mark("process groups")


def train(cfg, startup=None, on_trainer: Optional[Callable] = None,
          trainer_class: Optional[type] = None) -> int:
    """Build the Trainer and train (collective); returns the exit code. ``startup``: the
    StartupTimer whose phases so far the first log line reports. ``on_trainer(trainer)`` runs
    once the trainer is built, before it trains (a caller that watches or drives it).
    ``trainer_class``: a Trainer subclass to build instead (train_rl.py's RLTrainer)."""
    from megaloop import runtime
    from megaloop.checkpoint.errors import CheckpointError
    from megaloop.training.exit_conditions import RunError, write_exit_status
    from megaloop.training.trainer import Trainer

    trainer = None
    try:
        trainer = (trainer_class or Trainer)(cfg, startup)
        if on_trainer is not None:
            on_trainer(trainer)
        trainer.train()  # writes --exit-status-file itself (before the ranks may leave)
    except (RunError, CheckpointError) as exc:  # exit 2 for a refusal before training (a
        # checkpoint that does not fit the flags), else 1. Every rank raises the same error at
        # the same point; one copy is enough.
        if runtime.is_rank_zero():
            print(f"error: {exc}", file=sys.stderr, flush=True)
            if cfg.checkpoint.exit_status_file:
                write_exit_status(cfg.checkpoint.exit_status_file, "failed", str(exc),
                                  trainer.iteration if trainer else 0,
                                  trainer.last_saved if trainer else None)
        return exc.exit_code
    return 0


def run(argv: Optional[list] = None) -> int:
    """The whole sequence (configure, start, train, then the process groups are destroyed);
    returns the process's exit code."""
    from megaloop.training.startup import StartupTimer

    startup = StartupTimer()  # the first phase counts from the process's start
    try:
        cfg = configure(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # argparse: --help (0) or a flag it cannot parse (2)
        return exc.code if isinstance(exc.code, int) else 2
    from megaloop import cpu_shim, runtime
    from megaloop.parallel import initialize

    try:
        start(cfg, startup)
        return train(cfg, startup)
    finally:
        if cpu_shim.is_enabled() and cpu_shim.call_sites():
            runtime.print_rank_0("> CPU shim call sites:\n" + cpu_shim.format_call_sites())
        initialize.destroy()
