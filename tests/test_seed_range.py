"""The trainer's --seed is refused in one line (exit 2, before any process group) where numpy
cannot take it, which is exactly where numpy's own seeding raises: the run seeds numpy's global
generator and megatron-core's datasets with it. (tools/generate.py's and the server's sampling
seed, any 64-bit integer: tests/test_tools_reliability.py, tests/test_serve.py.)"""

import numpy as np
import pytest
import torch

from test_training import BASE


def _numpy_takes(seed: int) -> bool:
    try:
        np.random.RandomState(seed)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("seed", [-1, 2 ** 32, 2 ** 64])
def test_a_seed_numpy_refuses_is_one_line_before_any_process_group(seed, capsys):
    from megaloop.training import run

    assert not _numpy_takes(seed)
    assert run(BASE + ["--seed", str(seed)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --seed {seed}: must be an integer "
                                                   f"from 0 to {2 ** 32 - 1}"), err
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("seed", [0, 2 ** 32 - 1])
def test_the_range_ends_numpy_takes_are_accepted(seed):
    from megaloop.training.run import configure

    assert _numpy_takes(seed)
    assert configure(BASE + ["--seed", str(seed)]).training.seed == seed
