"""Pretrain a looped language model: ``torchrun --nproc_per_node N pretrain_looplm.py [flags]``.

Flags keep Megatron-LM's names (``--tensor-model-parallel-size``, ``--num-layers``, ``--lr``,
...); the loop adds ``--num-loops``, ``--num-prelude-layers``, ``--num-coda-layers`` and the exit
options. ``python pretrain_looplm.py --help`` lists them all.
"""

import sys
import warnings


def main(argv=None) -> int:
    from megaloop.training.run_config import parse_args

    cfg = parse_args(argv)
    try:
        cfg.validate()  # before any process group starts: a bad flag fails fast on every rank
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")
    from megaloop import cpu_shim

    if cpu_shim.enable():
        print("> CPU development mode: megatron-core's CUDA calls run on CPU (megaloop.cpu_shim)",
              flush=True)
    from megaloop.parallel import initialize
    from megaloop.training.trainer import Trainer

    initialize.initialize(cfg.parallel, cfg.training.seed)
    try:
        Trainer(cfg).train()
    finally:
        if cpu_shim.is_enabled() and cpu_shim.call_sites():
            print("> CPU shim call sites:\n" + cpu_shim.format_call_sites(), flush=True)
        initialize.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
