"""What a training run leaves of the garbage collector's state in its process: nothing. A
process that goes on after ``train()`` (a notebook, a sweep of runs, a test) must find the
collector as it was: no objects frozen out of its sight (the step hooks used to ``gc.freeze()``
after the first step and never unfreeze), and automatic collection back on after --manual-gc."""

import gc

import pytest

from distributed import run_distributed
from run_helpers import build_trainer
from test_training import BASE

TINY = BASE + ["--micro-batch-size", "2", "--train-iters", "3"]


def _train_and_look(rank, world, flags, fail):
    before = (gc.get_freeze_count(), gc.isenabled())
    trainer = build_trainer(flags)
    if fail:  # a run that ends on an error mid-run: the same clean-up
        step = trainer.train_step

        def step_then_fail():
            if trainer.iteration == 1:
                raise RuntimeError("a step that fails")
            return step()

        trainer.train_step = step_then_fail
        try:
            trainer.train()
        except RuntimeError:
            pass
    else:
        trainer.train()
    return before, (gc.get_freeze_count(), gc.isenabled()), trainer.iteration


@pytest.mark.parametrize("flags", [[], ["--manual-gc", "--manual-gc-interval", "1"]],
                         ids=["auto-gc", "manual-gc"])
@pytest.mark.parametrize("fail", [False, True], ids=["trained", "failed"])
def test_a_run_leaves_the_collector_as_it_found_it(flags, fail):
    before, after, iteration = run_distributed(_train_and_look, 1, TINY + flags, fail)[0]
    assert before == (0, True)  # what the forked rank found
    assert iteration == (1 if fail else 3)  # the run did take steps
    assert after == before, (before, after)
