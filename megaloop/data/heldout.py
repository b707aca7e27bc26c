"""Held-out token windows for evaluation tools and benchmarks."""

from __future__ import annotations


def validation_windows(prefix: str, num: int, length: int):
    """``num`` windows of ``length`` tokens from the last documents of an indexed dataset (with
    a train/valid split such as 98,2,0 these are the validation documents), as [num, length]."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    need, parts, i = num * length, [], len(ds) - 1
    while need > 0 and i >= 0:
        doc = np.asarray(ds[i], dtype=np.int64)
        parts.insert(0, doc)
        need -= len(doc)
        i -= 1
    tokens = np.concatenate(parts)[-num * length:]
    if len(tokens) < num * length:
        raise ValueError(f"{prefix} has fewer than {num * length} tokens")
    return tokens.reshape(num, length)
