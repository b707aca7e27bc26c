"""Instruction data: examples -> tokens + loss mask, and the dataset that trains on them.

Preprocessing (``--data-format sft``) turns every JSONL example into one document of tokens and
a per-token loss mask (1 = a response token the model is trained to produce), stored as two
indexed datasets with identical document lengths: ``<prefix>_text_document`` (tokens) and
``<prefix>_lossmask_document`` (uint8 mask). The text dataset alone is an ordinary pretraining
dataset; the mask only narrows the loss.

Accepted examples:

- ``{"prompt": str, "response": str}`` -> ``prompt`` ``response`` EOD; mask 1 on the response
  tokens and on the EOD (the model learns to stop).
- ``{"messages": [{"role": r, "content": c}, ...]}`` -> for every message ``r:`` ``c``, and EOD
  after each ``assistant`` message; mask 1 exactly on assistant contents and their EODs. Role
  headers and the other roles' contents are context only (mask 0).

Prompt and response (each message) are encoded separately, so the mask boundary is exact
whatever the tokenizer would merge across it. An example whose responses are all empty is
skipped and counted as empty.

Packing (``SFTDataset``): megatron-core's GPTDataset concatenates shuffled documents into
sequences of --seq-length + 1 tokens, so one sequence holds several examples, and an example
that does not fit continues at the start of another sequence (without its prompt there; the
loss mask still applies). Attention across examples:

- by default it LEAKS: a token attends (causally) to the earlier examples packed before it, and
  position ids run on across examples;
- ``--reset-position-ids`` restarts positions after every EOD;
- ``--reset-attention-mask`` makes the dataset return an ``attention_mask`` [1, S, S] (True =
  masked) that blocks attention to tokens before the last EOD, i.e. no leakage, provided the
  model applies that mask instead of a plain causal one;
- both act at every EOD token, so a multi-turn ``messages`` example is also cut at each
  assistant turn's EOD: leave them off for multi-turn data if turns must see earlier turns.
"""

from __future__ import annotations

import copy
from typing import Optional

import numpy
import torch
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megaloop.compat import tokens_and_documents
from megaloop.data.config import SFT_LOSSMASK_SUFFIX, SFT_TEXT_SUFFIX


def lossmask_prefix(text_prefix: str) -> str:
    assert text_prefix.endswith(SFT_TEXT_SUFFIX), text_prefix
    return text_prefix[: -len(SFT_TEXT_SUFFIX)] + SFT_LOSSMASK_SUFFIX


class SFTDataset(GPTDataset):
    """GPTDataset whose loss mask is the stored response mask (times GPTDataset's own mask).

    The mask twin is read through the very sample/shuffle indices of the token dataset: a
    shallow copy of this dataset whose low-level dataset is the mask and whose padding value is
    0 runs GPTDataset's own sample assembly, so masks line up with tokens by construction and
    padding never carries loss.
    """

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: Optional[str],
                 indexed_indices: numpy.ndarray, num_samples: Optional[int], index_split,
                 config) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples,
                         index_split, config)
        mask_data = IndexedDataset(lossmask_prefix(indexed_dataset.path_prefix),
                                   mmap=config.mmap_bin_files)
        if not numpy.array_equal(mask_data.sequence_lengths, indexed_dataset.sequence_lengths):
            raise ValueError(f"{lossmask_prefix(indexed_dataset.path_prefix)} does not match "
                             f"{indexed_dataset.path_prefix} document for document: re-run "
                             "tools/preprocess_data.py --data-format sft")
        self._mask_view = copy.copy(self)
        self._mask_view.dataset = mask_data
        self._mask_view._pad_token_id = 0

    def __getitem__(self, idx: Optional[int]) -> dict[str, torch.Tensor]:
        sample = super().__getitem__(idx)
        mask, _ = tokens_and_documents(self._mask_view, 0 if idx is None else idx)
        # The stored mask marks response *tokens*; the loss is on *labels* (tokens shifted by one).
        mask = torch.from_numpy(mask[1:] if self.config.add_extra_token_to_sequence
                                else numpy.roll(mask, -1)).float()
        sample["loss_mask"] = sample["loss_mask"] * mask
        return sample
