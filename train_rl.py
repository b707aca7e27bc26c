"""Reinforcement learning of a looped language model (GRPO, RLTT):
``torchrun --nproc_per_node N train_rl.py [flags]``.

Every pretraining flag that applies (model, loop, parallelism, optimizer and LR schedule, --load,
--save, --log-jsonl, ...) keeps its meaning; the RL flags (--env, --prompts-per-step,
--group-size, --objective, --loop-weighting, --kl-beta, ...) are megaloop.rl.config.RLConfig's.
``--train-iters`` is the number of policy updates. ``python train_rl.py --help`` lists them all.

The run is megaloop.rl.train.run (megaloop/rl/train.py). Exit codes as pretrain_looplm.py: 0
trained (or stopped early after saving), 1 the run failed, 2 bad flags, a --load that holds no
checkpoint, or a checkpoint that does not fit them.
"""

import sys


def main(argv=None) -> int:
    from megaloop.rl.train import run

    return run(argv)


if __name__ == "__main__":  # required: checkpoint writers may re-import __main__
    sys.exit(main())
