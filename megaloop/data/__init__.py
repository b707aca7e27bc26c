"""Data side of megaloop: tokenizers, JSONL preprocessing, indexed datasets, loaders.

- ``config``: TokenizerConfig, DataConfig (flags; validated before any process group starts)
- ``tokenizers``: build_tokenizer (sentencepiece, Hugging Face tokenizer.json, null)
- ``jsonl`` / ``batch_encoder`` / ``preprocess``: JSONL -> Megatron ``.bin/.idx``
  (tools/preprocess_data.py), written by ``indexed_format`` (which also checks .bin against .idx)
- ``sft_examples`` / ``sft``: instruction examples -> tokens + loss mask; the SFT dataset
- ``datasets``: build_train_valid_test_datasets, build_data_iterator
- ``broadcast``: the trainer's batch streams (read on one rank per tensor-parallel group)

Only ``config`` is imported here. ``datasets``, ``sft`` and ``broadcast`` import megatron.core,
which is slow; the preprocessing modules import neither it nor torch.
"""

from megaloop.data.config import DataConfig, TokenizerConfig

__all__ = ["DataConfig", "TokenizerConfig"]
