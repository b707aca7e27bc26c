"""The suite's memo of megatron-core's shuffle index (tests/shuffle_memo.py) returns what
megatron-core's function returns and leaves the generator where that function leaves it, on a
miss and on a hit, and tells apart generators in different states."""

import numpy
from megatron.core.datasets import gpt_dataset

import shuffle_memo


def _generator(draws_before):
    state = numpy.random.RandomState(11)
    state.randint(0, 10, draws_before)
    return state


def test_memo_returns_the_real_index_and_generator_state():
    memoised = gpt_dataset._build_shuffle_index
    real = memoised.__wrapped__  # megatron-core's own function; conftest installed the memo
    size = shuffle_memo.MIN_SIZE + 5
    # a miss, its hit, another first range, another generator state and its hit
    for num_samples, draws_before in ((size, 0), (size, 0), (size - 7, 0), (size, 3), (size, 3)):
        got_state, want_state = _generator(draws_before), _generator(draws_before)
        got = memoised(num_samples, size, got_state)
        want = real(num_samples, size, want_state)
        assert got.dtype == want.dtype and numpy.array_equal(got, want)
        assert got_state.randint(0, 2**31) == want_state.randint(0, 2**31)  # the same stream on
