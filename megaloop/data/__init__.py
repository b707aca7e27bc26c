"""Data side of megaloop: tokenizers, JSONL preprocessing, indexed datasets, loaders.

- ``config``: TokenizerConfig, DataConfig (flags; validated before any process group starts)
- ``tokenizers``: build_tokenizer (sentencepiece, Hugging Face tokenizer.json, null)
- ``jsonl`` / ``preprocess``: JSONL -> Megatron ``.bin/.idx`` (tools/preprocess_data.py)
- ``sft``: instruction examples -> tokens + loss mask; the SFT dataset
- ``datasets``: build_train_valid_test_datasets, build_data_iterator (used by the trainer)

Only ``config`` is imported here: the other modules import megatron.core, which is slow.
"""

from megaloop.data.config import DataConfig, TokenizerConfig

__all__ = ["DataConfig", "TokenizerConfig"]
