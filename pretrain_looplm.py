"""Pretrain a looped language model: ``torchrun --nproc_per_node N pretrain_looplm.py [flags]``.

Flags keep Megatron-LM's names (``--tensor-model-parallel-size``, ``--num-layers``, ``--lr``,
...); the loop adds ``--num-loops``, ``--num-prelude-layers``, ``--num-coda-layers`` and the exit
options. ``python pretrain_looplm.py --help`` lists them all; ``python pretrain_looplm.py
[flags]`` without torchrun runs as one process.

The run sequence is ``megaloop.training.run`` (megaloop/training/run.py). Exit codes
(megaloop/training/exit_conditions.py): 0 trained to the end, or stopped early after saving
(SIGTERM with --exit-signal-handler, --exit-interval, --exit-duration-in-mins); 1 the run failed
(non-finite steps in a row, a failed save or load); 2 bad flags, a --load that holds no
checkpoint (a Hugging Face folder: convert it with tools/convert_checkpoint.py import-hf; a
--load equal to --save with nothing saved yet starts from scratch), or a checkpoint that does
not fit them. torchrun exits 1 when it is signalled itself whatever its ranks did:
--exit-status-file says which of the three it was.
"""

import sys


def main(argv=None) -> int:
    from megaloop.training import run

    return run(argv)


if __name__ == "__main__":  # required: checkpoint writers may re-import __main__
    sys.exit(main())
