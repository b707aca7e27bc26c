"""The suite's one shortcut into megatron-core: its GPT shuffle index, memoised on disk.

megatron-core's mock dataset is 100,000 documents of up to 4,096 tokens (fixed in
``MockGPTLowLevelDataset``), so every ``--mock-data`` trainer shuffles an index of millions of
samples per split (~6M at sequence length 32: ~0.5 s each on this machine), and nothing caches
it (megatron-core caches indices of real data only). Hundreds of tests build such a trainer in
forked ranks, with a few distinct (seed, split, sequence length) among them.

``gpt_dataset._build_shuffle_index(num_samples, total_size, numpy_random_state)`` is a pure
function of its sizes and the generator's state: the memo keys a file on exactly those and
stores the index together with the generator's state after the shuffle, which it restores, so
callers see the same array and the same generator as from the real call. Only large indices are
kept (the ones that cost time): tests of real data, which count the bytes a rank reads
(tests/test_scale_startup.py), build small ones and run the real call unobserved. Processes the
tests launch (torchrun, subprocesses) do not import this and shuffle for themselves; their results
are compared with forked ranks' bit for bit, which checks the memo on every such test.
"""

import atexit
import hashlib
import os
import shutil
import tempfile

import numpy

MIN_SIZE = 1_000_000  # samples; below this the shuffle takes milliseconds


def memoize_shuffle_index() -> None:
    from megatron.core.datasets import gpt_dataset

    build = gpt_dataset._build_shuffle_index
    directory = tempfile.mkdtemp(prefix="megaloop-tests-shuffle-")
    owner = os.getpid()  # forked ranks inherit the directory; the pytest process removes it
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(directory, True))

    def memoised(num_samples, total_size, numpy_random_state):
        if total_size < MIN_SIZE:
            return build(num_samples, total_size, numpy_random_state)
        kind, keys, pos, has_gauss, gauss = numpy_random_state.get_state()
        digest = hashlib.sha1(keys.tobytes())
        digest.update(repr((num_samples, total_size, kind, pos, has_gauss, gauss)).encode())
        path = os.path.join(directory, digest.hexdigest() + ".npz")
        if os.path.exists(path):
            with numpy.load(path) as saved:
                numpy_random_state.set_state(
                    (kind, saved["keys"], int(saved["pos"]), int(saved["has_gauss"]),
                     float(saved["gauss"])))
                return saved["index"]
        index = build(num_samples, total_size, numpy_random_state)
        _, keys, pos, has_gauss, gauss = numpy_random_state.get_state()
        partial = f"{path}.{os.getpid()}.partial"  # two ranks may shuffle the same index at once
        with open(partial, "wb") as f:
            numpy.savez(f, index=index, keys=keys, pos=pos, has_gauss=has_gauss, gauss=gauss)
        os.replace(partial, path)
        return index

    memoised.__wrapped__ = build
    gpt_dataset._build_shuffle_index = memoised
