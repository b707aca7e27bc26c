"""Train/valid/test datasets and the per-rank sample stream the trainer consumes.

Datasets come from megatron-core's ``BlendedMegatronDatasetBuilder`` (GPTDataset, MockGPTDataset,
or megaloop's SFTDataset), with three guards megatron-core lacks:

- the index cache folder is keyed on the data files' content (``content_key``: their digest, or
  their stat and sampled bytes; never a whole-file read), so re-preprocessing in place never
  reuses sample indices built for the old files (megatron-core keys them on paths and config);
- a split that would get 0 documents is a ValueError up front (GPTDataset loops forever on it);
- a split asked for 0 samples is not built at all (returned as None).

Every rank that reads data builds every dataset: the sample order is a pure function of the seed,
so ranks agree without communication. megatron-core's builder builds (document, sample and
shuffle indices; a blend's indices) on global rank 0 while the others wait at a barrier, then
the others ``numpy.load(mmap_mode="r")`` the cache: only rank 0 walks the document lengths
(tests/test_scale_startup.py counts bytes read per rank). Which ranks read is
megaloop.data.broadcast's business (the first tensor-parallel rank of the first and last
pipeline stages).

The stream follows Megatron-LM's pretraining sampler: global sample ``consumed_samples`` comes
next; each chunk of ``micro_batch_size * data_parallel_size`` consecutive samples is cut so
that DP rank r takes samples ``[r * mbs, (r + 1) * mbs)`` of it. Resuming therefore needs only
``consumed_samples``. Context-parallel ranks of one data-parallel rank read the same samples and
each keeps its part of every sequence (``on_this_context_parallel_rank``).
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterator, Optional

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix, parse_and_normalize_split)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megaloop.compat import cp_split
from megaloop.data.config import DataConfig
from megaloop.data.indexed_format import read_digest, sampled_fields
from megaloop.data.sft import SFTDataset, lossmask_prefix
from megaloop.device import to_device

SPLIT_NAMES = ("train", "valid", "test")
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


def content_key(prefixes: list[str]) -> str:
    """Key of the datasets' content, from a few hundred bytes per dataset whatever its size.

    The cached indices depend on the document lengths only, i.e. on the ``.idx``. A dataset
    written by preprocessing or tools/merge_datasets.py carries a digest of its ``.idx``
    (megaloop.data.indexed_format.read_digest; ignored once the ``.idx`` changed); any other is
    keyed on its files' sizes and mtimes, its header and its last document's entries
    (``sampled_fields``). Every rank computes the same key from the same files without
    communication, and none reads a whole ``.idx`` (at 1e12 tokens the ``.idx`` files hold
    ~12 GB, read by every rank before the first step otherwise).
    """
    h = hashlib.sha1()
    for prefix in prefixes:
        h.update(os.path.abspath(prefix).encode() + b"\0")
        digest = read_digest(prefix)
        if digest is not None:
            h.update(f"digest:{digest}:{os.path.getsize(prefix + '.bin')}\0".encode())
        else:
            h.update(b"sampled:" + sampled_fields(prefix) + b"\0")
    return h.hexdigest()[:16]


def _document_counts(data_cfg: DataConfig, num_samples: tuple[int, int, int]) -> list[dict]:
    """Per split, documents each prefix contributes (only for splits asked for samples)."""
    counts: list[dict] = [{} for _ in SPLIT_NAMES]
    if data_cfg.data_path:
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(data_cfg.split))
        (prefixes, _), = data_cfg.blends()
        for prefix in prefixes:
            n = len(IndexedDataset(prefix))
            for i, bookends in enumerate(matrix):
                if num_samples[i] > 0:
                    # The very rounding BlendedMegatronDatasetBuilder applies to the bookends.
                    beg, end = (int(round(b * float(n))) for b in bookends) if bookends else (0, 0)
                    counts[i][prefix] = end - beg
    else:
        for i, blend in enumerate(data_cfg.blends()):
            if blend and num_samples[i] > 0:
                counts[i] = {prefix: len(IndexedDataset(prefix)) for prefix in blend[0]}
    return counts


def _check_documents_per_split(data_cfg: DataConfig, num_samples: tuple[int, int, int]) -> None:
    for name, n_samples, per_prefix in zip(SPLIT_NAMES, num_samples,
                                           _document_counts(data_cfg, num_samples)):
        for prefix, n_docs in per_prefix.items():
            if n_docs == 0:
                fix = (f"raise the {name} share of --split {data_cfg.split!r} or add documents"
                       if data_cfg.data_path else "add documents")
                if name == "valid":
                    fix += ", or pass --eval-iters 0 (no validation)"
                raise ValueError(f"the {name} split of {prefix} has 0 documents but "
                                 f"{n_samples} {name} samples were requested: {fix}")


def _builds_blended_dataset(data_cfg: DataConfig) -> bool:
    """Whether megatron-core will build a BlendedDataset (it does for a weighted --data-path
    even with one prefix, and for any blend of several prefixes)."""
    blends = [b for b in data_cfg.blends() if b]
    return any(len(p) > 1 for p, _ in blends) or bool(data_cfg.data_path and blends[0][1])


def build_train_valid_test_datasets(data_cfg: DataConfig, tokenizer, seq_length: int, seed: int,
                                    num_samples: tuple[int, int, int],
                                    built_on_this_rank: bool = True):
    """(train, valid, test) datasets of ``seq_length``-token samples.

    A split comes back as None when it is asked for 0 samples or has no data path (per-split
    mode), and all three are None where ``built_on_this_rank`` is false (a rank that does not
    read data; every rank must still call this: megatron-core builds on rank 0 first, behind a
    barrier). ``tokenizer`` is a megaloop.data.tokenizers tokenizer (eod, pad, vocab_size).
    """
    data_cfg.validate()
    num_samples = tuple(int(n) for n in num_samples)
    path_to_cache: Optional[str] = None
    if not data_cfg.mock_data:
        _check_documents_per_split(data_cfg, num_samples)
        prefixes = data_cfg.prefixes()
        if data_cfg.data_format == "sft":
            prefixes = prefixes + [lossmask_prefix(p) for p in prefixes]
        base = data_cfg.data_cache_path or os.path.join(
            os.path.dirname(os.path.abspath(prefixes[0])), "cache")
        path_to_cache = os.path.join(base, f"megaloop-{content_key(prefixes)}")
        if _builds_blended_dataset(data_cfg) and not torch.distributed.is_initialized():
            raise RuntimeError("a blend of several datasets needs torch.distributed initialised "
                               "(megatron-core's BlendedDataset calls get_rank; a size-1 gloo "
                               "group is enough)")

    blends = None if data_cfg.mock_data else data_cfg.blends()
    blend_per_split = None
    if blends is not None and not data_cfg.data_path:
        # A split nobody samples from is not built (building it may need data that is absent).
        blend_per_split = [b if n > 0 else None for b, n in zip(blends, num_samples)]
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length,
        blend=blends[0] if data_cfg.data_path else None, blend_per_split=blend_per_split,
        split=data_cfg.split if data_cfg.data_path else None, path_to_cache=path_to_cache,
        tokenizer=tokenizer, reset_position_ids=data_cfg.reset_position_ids,
        reset_attention_mask=data_cfg.reset_attention_mask,
        eod_mask_loss=data_cfg.eod_mask_loss,
        # A plain causal mask is implied by the model; only a reset mask carries information.
        create_attention_mask=data_cfg.reset_attention_mask,
        mmap_bin_files=not data_cfg.no_mmap_bin_files)
    if config.split_matrix is not None:
        for i, n in enumerate(num_samples):
            if n == 0:
                config.split_matrix[i] = None  # not built: GPTDataset would still make an epoch
    cls = (MockGPTDataset if data_cfg.mock_data
           else SFTDataset if data_cfg.data_format == "sft" else GPTDataset)
    builder = BlendedMegatronDatasetBuilder(cls, list(num_samples), lambda: built_on_this_rank,
                                            config)
    train, valid, test = builder.build()
    return train, valid, test


class PretrainingBatchSampler:
    """Index lists of one DP rank, in Megatron-LM's pretraining order (see module docstring)."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, cyclic: bool = False):
        if total_samples <= 0:
            raise ValueError("the dataset has no samples")
        if not 0 <= data_parallel_rank < data_parallel_size or micro_batch_size < 1:
            raise ValueError(f"bad data-parallel layout: rank {data_parallel_rank} of "
                             f"{data_parallel_size}, micro batch {micro_batch_size}")
        self.total = total_samples
        self.consumed = consumed_samples
        self.mbs = micro_batch_size
        self.rank = data_parallel_rank
        self.global_chunk = micro_batch_size * data_parallel_size
        self.cyclic = cyclic

    def __iter__(self) -> Iterator[list[int]]:
        start = self.consumed
        # Non-cyclic: a last incomplete chunk is dropped, as Megatron-LM's sampler does.
        while self.cyclic or start + self.global_chunk <= self.total:
            first = start + self.rank * self.mbs
            yield [(first + j) % self.total for j in range(self.mbs)]
            start += self.global_chunk


class TokenIdError(ValueError):
    """A batch holds a token id outside the tokenizer's vocabulary; names the dataset."""


def dataset_names(dataset) -> list[str]:
    """Names of the datasets a batch's ``dataset_id`` indexes (the prefixes of a blend, in
    BlendedDataset order; one name otherwise)."""
    parts = dataset.datasets if hasattr(dataset, "dataset_index") else [dataset]
    return [getattr(d, "dataset_path", None) or f"{type(d).__name__} (synthetic data)"
            for d in parts]


def check_token_ids(batch: dict, vocab_size: int, names: list[str]) -> None:
    """Raise TokenIdError when ``batch`` (on the host, with BlendedDataset's ``dataset_id``)
    holds an id outside ``[0, vocab_size)``: a max and a min per sample, no device sync."""
    ids = torch.cat([batch["tokens"], batch["labels"][:, -1:]], dim=1)
    bad = (ids.amax(dim=1) >= vocab_size) | (ids.amin(dim=1) < 0)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        value = int(ids[row].max()) if int(ids[row].max()) >= vocab_size else int(ids[row].min())
        which = int(batch["dataset_id"][row]) if "dataset_id" in batch else 0
        raise TokenIdError(
            f"{names[which]}: token id {value} is outside the vocabulary of {vocab_size} ids of "
            "the tokenizer (--tokenizer-type/--tokenizer-model/--vocab-size): the dataset was "
            "tokenized with another tokenizer; re-run tools/preprocess_data.py with this one, "
            "or train with the tokenizer that wrote it")


def build_data_iterator(dataset, consumed_samples: int, micro_batch_size: int,
                        data_parallel_rank: int, data_parallel_size: int, num_workers: int = 0,
                        cyclic: bool = False, vocab_size: Optional[int] = None
                        ) -> Iterator[dict[str, torch.Tensor]]:
    """Micro-batches of this DP rank: dicts of [micro_batch_size, seq] tensors ``tokens``,
    ``labels`` (int64), ``loss_mask`` (float32), ``position_ids`` (int64), and
    ``attention_mask`` ([mbs, 1, seq, seq] bool, True = masked) only with --reset-attention-mask.

    ``cyclic`` wraps around the dataset forever (validation); otherwise the stream ends after the
    last complete global batch.

    Every batch comes out on the accelerator (``megaloop.device.to_device``) and, under context
    parallelism, cut to this rank's part of the sequence (``on_this_context_parallel_rank``): the
    trainer, the pipeline and evaluation all read batches from here, so this is the one place
    they move and are split. With ``vocab_size`` every batch's token ids are checked first
    (``check_token_ids``). Under tensor or pipeline parallelism the trainer reads through
    megaloop.data.broadcast (one reading rank per tensor-parallel group).
    """
    sampler = PretrainingBatchSampler(len(dataset), consumed_samples, micro_batch_size,
                                      data_parallel_rank, data_parallel_size, cyclic)
    # A private generator: creating a DataLoader iterator draws a base seed from its generator,
    # and drawing it from the global one would shift the dropout stream by the number of
    # iterators built, which differs between a straight run and a resumed one. The samples do
    # not depend on it (the sampler fixes the order).
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         collate_fn=_collate, persistent_workers=num_workers > 0,
                                         pin_memory=torch.cuda.is_available(),
                                         generator=torch.Generator().manual_seed(0))
    names = dataset_names(dataset)

    def host_side(batch: dict) -> dict:
        if vocab_size is not None:
            check_token_ids(batch, vocab_size, names)
        batch.pop("dataset_id", None)  # the model's inputs only from here on
        return batch

    return map(on_this_context_parallel_rank, map(to_device, map(host_side, loader)))


def on_this_context_parallel_rank(batch: dict) -> dict:
    """This context-parallel rank's part of a [mbs, seq] batch: megatron-core's load-balanced
    split (``get_batch_on_this_cp_rank``): the sequence is cut into 2 x CP chunks and CP rank r
    keeps chunks r and 2 x CP - 1 - r (causal attention costs the same on every rank). Every
    key is split, so tokens, labels, loss mask and positions stay aligned (the rotary table is
    cut the same way, megaloop.model.recurrence.context). Unchanged without context parallelism
    (CP = 1, or megatron-core's groups not initialised)."""
    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group(check_initialized=False)
    if group is None or group.size() == 1:
        return batch
    return cp_split(dict(batch), group)


def _collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    # BlendedDataset adds "dataset_id": kept to name the dataset of a bad token id, then dropped.
    batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples])
             for k in BATCH_KEYS + ("dataset_id",) if k in samples[0]}
    for k in ("tokens", "labels", "position_ids"):
        batch[k] = batch[k].long()
    batch["loss_mask"] = batch["loss_mask"].float()
    return batch
