"""Pretrain a looped language model: ``torchrun --nproc_per_node N pretrain_looplm.py [flags]``.

Flags keep Megatron-LM's names (``--tensor-model-parallel-size``, ``--num-layers``, ``--lr``,
...); the loop adds ``--num-loops``, ``--num-prelude-layers``, ``--num-coda-layers`` and the exit
options. ``python pretrain_looplm.py --help`` lists them all; ``python pretrain_looplm.py
[flags]`` without torchrun runs as one process.

Exit codes (megaloop/training/exit_conditions.py): 0 trained to the end, or stopped early after
saving (SIGTERM with --exit-signal-handler, --exit-interval, --exit-duration-in-mins); 1 the run
failed (non-finite steps in a row, a failed save or load); 2 bad flags, or a checkpoint that does
not fit them. torchrun exits 1 when it is signalled itself whatever its ranks did:
--exit-status-file says which of the three it was.
"""

import sys


def main(argv=None) -> int:
    # Only the standard library and the config dataclasses load before argparse: `--help` and a
    # bad flag answer without importing torch or megatron-core.
    from megaloop import runtime
    from megaloop.training.run_config import parse_args
    from megaloop.training.startup import StartupTimer

    startup = StartupTimer()  # the first phase counts from the process's start
    cfg = parse_args(argv)
    # TE's attention switches for --attention-backend, before anything imports megatron-core
    # (whose import imports Transformer Engine); validate() sets them again.
    runtime.set_attention_backend_env(cfg.model.attention_backend)
    runtime.quiet_megatron()  # validate() may import megatron-core; filter its warnings first
    try:
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
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from megaloop import cpu_shim

    if cpu_shim.enable():
        runtime.print_rank_0("> CPU development mode: megatron-core's CUDA calls run on CPU "
                             "(megaloop.cpu_shim), collectives on gloo, layers on the local spec")
    from megaloop.parallel import initialize
    from megaloop.training.exit_conditions import RunError, write_exit_status
    from megaloop.training.trainer import Trainer

    startup.mark("imports")  # with flag parsing and validation
    initialize.initialize(cfg.parallel, cfg.training.seed)
    startup.mark("process groups")
    trainer = None
    try:
        trainer = Trainer(cfg, startup)
        trainer.train()  # writes --exit-status-file itself (before the ranks may leave)
    except RunError as exc:  # exit 2 for a refusal before training (a checkpoint that does
        # not fit the flags), else 1. Every rank raises the same error at the same point; one
        # copy is enough.
        if runtime.is_rank_zero():
            print(f"error: {exc}", file=sys.stderr, flush=True)
            if cfg.checkpoint.exit_status_file:
                write_exit_status(cfg.checkpoint.exit_status_file, "failed", str(exc),
                                  trainer.iteration if trainer else 0,
                                  trainer.last_saved if trainer else None)
        return exc.exit_code
    finally:
        if cpu_shim.is_enabled() and cpu_shim.call_sites():
            runtime.print_rank_0("> CPU shim call sites:\n" + cpu_shim.format_call_sites())
        initialize.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
