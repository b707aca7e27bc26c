"""Pretrain a looped language model: ``torchrun --nproc_per_node N pretrain_looplm.py [flags]``.

Flags keep Megatron-LM's names (``--tensor-model-parallel-size``, ``--num-layers``, ``--lr``,
...); the loop adds ``--num-loops``, ``--num-prelude-layers``, ``--num-coda-layers`` and the exit
options. ``python pretrain_looplm.py --help`` lists them all.
"""

import sys


def main(argv=None) -> int:
    # Only the standard library and the config dataclasses load before argparse: `--help` and a
    # bad flag answer without importing torch or megatron-core.
    from megaloop import runtime
    from megaloop.training.run_config import parse_args

    cfg = parse_args(argv)
    runtime.quiet_megatron()  # validate() may import megatron-core; filter its warnings first
    try:
        cfg.validate()  # before any process group starts: a bad flag fails fast on every rank
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from megaloop import cpu_shim

    if cpu_shim.enable():
        runtime.print_rank_0("> CPU development mode: megatron-core's CUDA calls run on CPU "
                             "(megaloop.cpu_shim)")
    from megaloop.parallel import initialize
    from megaloop.training.trainer import Trainer

    initialize.initialize(cfg.parallel, cfg.training.seed)
    try:
        Trainer(cfg).train()
    finally:
        if cpu_shim.is_enabled() and cpu_shim.call_sites():
            runtime.print_rank_0("> CPU shim call sites:\n" + cpu_shim.format_call_sites())
        initialize.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
