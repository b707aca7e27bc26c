"""Tokenizer and data configuration (flags derived by megaloop.arguments).

Both dataclasses validate themselves from the file system alone, so a wrong path or a split that
cannot work is reported before any process group starts (``validate()``). Nothing here imports
megatron.core: the trainer parses and validates arguments first, then pays for the import.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Literal, Optional

TokenizerType = Literal["NullTokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer",
                        "GPT2BPETokenizer"]

SFT_TEXT_SUFFIX = "_text_document"
SFT_LOSSMASK_SUFFIX = "_lossmask_document"


@dataclass
class TokenizerConfig:
    """Tokenizer used by preprocessing and training (the same code builds it in both)."""

    tokenizer_type: TokenizerType = field(
        default="NullTokenizer",
        metadata={"value_aliases": {"GPTSentencePieceTokenizer": "SentencePieceTokenizer"}})
    """Tokenizer kind: NullTokenizer (whitespace-separated ids, for benchmarks and mock data),
    SentencePieceTokenizer (a local .model file; Megatron-LM calls it GPTSentencePieceTokenizer,
    whose ids are the same), HuggingFaceTokenizer (a local tokenizer.json, or a folder holding
    one; never downloaded) or GPT2BPETokenizer (GPT-2's byte-level BPE from --vocab-file and
    --merge-file, EOD <|endoftext|>)."""

    tokenizer_model: Optional[str] = None
    """Path of the sentencepiece .model, or of the Hugging Face tokenizer.json (or its folder)."""

    vocab_size: Optional[int] = None
    """NullTokenizer only: number of ids before EOD; EOD is this value and the tokenizer's
    vocab_size is one more (megatron-core's NullTokenizer semantics)."""

    # (After vocab_size: callers build TokenizerConfig(type, model, vocab_size) positionally.)
    vocab_file: Optional[str] = None
    """GPT2BPETokenizer: the vocabulary (GPT-2's vocab.json: token -> id)."""

    merge_file: Optional[str] = None
    """GPT2BPETokenizer: the BPE merges (GPT-2's merges.txt)."""

    tiktoken_pattern: Optional[str] = None
    """Accepted for Megatron-LM command lines: the regex of Megatron-LM's TikTokenizer, which
    megaloop does not have; no other tokenizer reads it (as in Megatron-LM)."""

    def validate(self) -> None:
        """Raise ValueError naming the flag to change; touches the file system only."""
        gpt2 = self.tokenizer_type == "GPT2BPETokenizer"
        if not gpt2 and (self.vocab_file or self.merge_file):
            raise ValueError("--vocab-file / --merge-file are read by --tokenizer-type "
                             "GPT2BPETokenizer (Megatron-LM's GPT-2 BPE): add it, or drop them")
        if gpt2:
            for flag, path in (("--vocab-file", self.vocab_file),
                               ("--merge-file", self.merge_file)):
                if not path:
                    raise ValueError(f"--tokenizer-type GPT2BPETokenizer needs {flag} PATH")
                if not os.path.isfile(path):
                    raise ValueError(f"{flag} {path}: no such file")
            if self.tokenizer_model is not None or self.vocab_size is not None:
                raise ValueError("GPT2BPETokenizer reads --vocab-file and --merge-file only: "
                                 "drop --tokenizer-model / --vocab-size")
            return
        if self.tokenizer_type == "NullTokenizer":
            if self.vocab_size is None or self.vocab_size < 1:
                raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size N "
                                 "(N >= 1; EOD becomes id N)")
            if self.tokenizer_model is not None:
                raise ValueError("--tokenizer-model is not used by NullTokenizer; drop it or pass "
                                 "--tokenizer-type SentencePieceTokenizer/HuggingFaceTokenizer")
            return
        if not self.tokenizer_model:
            raise ValueError(f"--tokenizer-type {self.tokenizer_type} needs --tokenizer-model PATH")
        if not os.path.exists(self.tokenizer_model):
            raise ValueError(f"--tokenizer-model {self.tokenizer_model}: no such file or folder")
        if self.vocab_size is not None:
            raise ValueError(f"--vocab-size is read from the model for {self.tokenizer_type}; "
                             "drop --vocab-size (the trainer pads the embedding itself)")


def parse_blend(values: list[str], flag: str) -> tuple[list[str], Optional[list[float]]]:
    """Megatron blend syntax: ``p1 p2 ...`` (weights from sizes) or ``w1 p1 w2 p2 ...``."""
    if len(values) % 2 == 1 and len(values) > 1 and _is_number(values[0]):
        # Read as prefixes this would fail later with "0.5.bin not found".
        raise ValueError(f"{flag} {' '.join(values)}: a weighted blend takes weight/prefix "
                         f"pairs, but {len(values)} values were given; pass e.g. {flag} "
                         f"{values[0]} {values[1]} <weight> <prefix>, or prefixes only")
    if len(values) % 2 == 0:
        try:
            weights = [float(v) for v in values[0::2]]
        except ValueError:
            weights = None
        if weights is not None:
            if any(w <= 0 for w in weights):
                raise ValueError(f"{flag}: blend weights must be > 0, got {weights}")
            return list(values[1::2]), weights
    return list(values), None


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return not os.path.isfile(value + ".idx")  # a dataset may be called "1"


def parse_split(split: str) -> list[float]:
    """``'969,30,1'`` -> three non-negative weights (missing trailing ones are 0)."""
    parts = [p for p in re.split(r"[,/]", split.strip()) if p.strip()]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {split!r}: expected up to three non-negative weights "
                         "train,valid,test with a positive sum, e.g. --split 969,30,1")
    return weights + [0.0] * (3 - len(weights))


@dataclass
class DataConfig:
    """Training data: Megatron indexed datasets (or mock data), blends, splits, loader."""

    mock_data: bool = False
    """Train on megatron-core's synthetic MockGPTDataset instead of files."""

    data_path: Optional[list[str]] = None
    """Dataset prefixes (``out_text_document``, without .bin/.idx) in Megatron blend syntax:
    ``prefix`` or ``w1 prefix1 w2 prefix2 ...``; split into train/valid/test by --split."""

    split: str = "969,30,1"
    """Relative train,valid,test proportions of the documents of every --data-path dataset."""

    train_data_path: Optional[list[str]] = None
    """Blend used for training only (instead of --data-path and --split)."""

    valid_data_path: Optional[list[str]] = None
    """Blend used for validation only (instead of --data-path and --split)."""

    test_data_path: Optional[list[str]] = None
    """Blend used for testing only (instead of --data-path and --split)."""

    data_args_path: Optional[str] = None
    """A text file holding the --data-path value (prefixes, optionally with weights, separated
    by whitespace or newlines): for blends too long for a command line (Megatron-LM's flag)."""

    per_split_data_args_path: Optional[str] = None
    """A JSON file {"train": ..., "valid": ..., "test": ...} holding the --train/valid/test-
    data-path values (each a list or a whitespace-separated string; a split may be left out)."""

    data_cache_path: Optional[str] = None
    """Folder for the sample-index cache; default: a ``cache`` folder next to the first dataset.
    Entries are keyed on the data files' content, so re-preprocessing in place is safe."""

    data_format: Literal["pretrain", "sft"] = field(default="pretrain",
                                                   metadata={"set_flags": {"--sft": "sft"}})
    """pretrain: loss on every token. sft: loss only where the ``_lossmask_document`` twin of each
    ``_text_document`` dataset (written by preprocess_data.py --data-format sft) is 1."""

    num_workers: int = 2
    """DataLoader worker processes per rank (0 = load in the training process)."""

    no_mmap_bin_files: bool = False
    """Read the .bin files with plain reads instead of memory-mapping them (megatron-core's
    mmap_bin_files off; Megatron-LM's flag, for file systems where mmap is slow)."""

    no_create_attention_mask_in_dataloader: bool = False
    """Accepted for Megatron-LM command lines: megaloop's loader makes an attention mask only
    for --reset-attention-mask (a causal mask is implied), so this is what it does anyway;
    with --reset-attention-mask it is refused (the mask carries the document boundaries)."""

    reset_position_ids: bool = False
    """Restart position ids after every EOD token (packed documents each start at position 0)."""

    reset_attention_mask: bool = False
    """Return an attention mask that stops tokens attending across EOD tokens (packed documents
    do not see each other); costs a [seq, seq] mask per sample."""

    eod_mask_loss: bool = False
    """No loss at positions whose input token is EOD (do not predict across a document end)."""

    def blends(self) -> list[Optional[tuple[list[str], Optional[list[float]]]]]:
        """``[blend]`` for --data-path, or one blend (or None) per train/valid/test split."""
        if self.data_path:
            return [parse_blend(self.data_path, "--data-path")]
        return [parse_blend(v, f"--{name}-data-path") if v else None
                for name, v in (("train", self.train_data_path), ("valid", self.valid_data_path),
                                ("test", self.test_data_path))]

    def prefixes(self) -> list[str]:
        """Every dataset prefix the config reads (token datasets only)."""
        return [p for blend in self.blends() if blend for p in blend[0]]

    def read_args_files(self) -> None:
        """Fill --data-path / --train/valid/test-data-path from --data-args-path /
        --per-split-data-args-path (as Megatron-LM reads them)."""
        import json

        if self.data_args_path:
            if self.data_path or self.per_split_data_args_path:
                raise ValueError("--data-args-path replaces --data-path (and the per-split "
                                 "blends): pass one of them")
            try:
                with open(self.data_args_path) as f:
                    self.data_path = f.read().split()
            except OSError as exc:
                raise ValueError(f"--data-args-path {self.data_args_path}: {exc.strerror}") \
                    from None
            self.data_args_path = None  # read once: the blend is now in --data-path
        if self.per_split_data_args_path:
            path = self.per_split_data_args_path
            if any((self.train_data_path, self.valid_data_path, self.test_data_path)):
                raise ValueError("--per-split-data-args-path replaces --train/valid/test-data-"
                                 "path: pass one or the other")
            try:
                with open(path) as f:
                    splits = json.load(f)
            except (OSError, ValueError) as exc:
                raise ValueError(f"--per-split-data-args-path {path}: not a readable JSON file "
                                 f"({exc})") from None
            if not isinstance(splits, dict) or set(splits) - {"train", "valid", "test"}:
                raise ValueError(f"--per-split-data-args-path {path}: expected a JSON object "
                                 f"with keys train, valid, test")
            for name in ("train", "valid", "test"):
                value = splits.get(name)
                if value:
                    setattr(self, f"{name}_data_path",
                            value.split() if isinstance(value, str) else list(value))
            self.per_split_data_args_path = None

    def validate(self, eval_iters: int = 0) -> None:
        """Raise ValueError naming the flag to change; touches the file system only.
        ``eval_iters``: validation iterations per evaluation (--eval-iters)."""
        self.read_args_files()
        per_split = any((self.train_data_path, self.valid_data_path, self.test_data_path))
        if self.mock_data:
            if self.data_path or per_split:
                raise ValueError("--mock-data ignores files: drop --data-path/--*-data-path or "
                                 "drop --mock-data")
            if self.data_format == "sft":
                raise ValueError("--mock-data has no loss mask: use --data-format pretrain or "
                                 "real data written by preprocess_data.py --data-format sft")
        elif self.data_path and per_split:
            raise ValueError("--data-path (with --split) and --train/valid/test-data-path are "
                             "exclusive: pass one or the other")
        elif not self.data_path and not per_split:
            raise ValueError("no training data: pass --data-path PREFIX (as written by "
                             "tools/preprocess_data.py, e.g. out_text_document), "
                             "--train-data-path ..., or --mock-data")
        elif per_split and not self.train_data_path:
            raise ValueError("--valid/test-data-path given without --train-data-path")
        split = parse_split(self.split)
        if self.data_path and eval_iters > 0 and split[1] == 0:
            raise ValueError(f"--split {self.split} leaves no documents for validation, but "
                             f"--eval-iters {eval_iters} evaluates on them: pass --eval-iters 0 "
                             "(no evaluation) or give validation a share, e.g. --split 98,2,0")
        if self.no_create_attention_mask_in_dataloader and self.reset_attention_mask:
            raise ValueError("--no-create-attention-mask-in-dataloader with "
                             "--reset-attention-mask: the per-document mask is what the reset "
                             "needs; drop one of the two")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers {self.num_workers}: must be >= 0")
        for prefix in self.prefixes():
            self._check_prefix(prefix)

    def _check_prefix(self, prefix: str) -> None:
        flag = "--data-path" if self.data_path else "--train/valid/test-data-path"
        if prefix.endswith((".bin", ".idx")):
            raise ValueError(f"{flag} {prefix}: give the prefix without .bin/.idx "
                             f"(e.g. {prefix[:-4]})")
        twins = [prefix]
        if self.data_format == "sft":
            if not prefix.endswith(SFT_TEXT_SUFFIX):
                raise ValueError(f"{flag} {prefix}: --data-format sft reads <prefix>"
                                 f"{SFT_TEXT_SUFFIX} with its {SFT_LOSSMASK_SUFFIX} twin; pass the "
                                 f"{SFT_TEXT_SUFFIX} prefix written by preprocess_data.py "
                                 "--data-format sft")
            twins.append(prefix[: -len(SFT_TEXT_SUFFIX)] + SFT_LOSSMASK_SUFFIX)
        for p in twins:
            for ext in (".bin", ".idx"):
                if not os.path.isfile(p + ext):
                    raise ValueError(f"{flag}: {p + ext} not found (run tools/preprocess_data.py "
                                     "or fix the prefix)")
            # A cut .bin or a mismatched .idx fails here, naming the file, instead of iterations
            # later (or never: a smaller .idx silently trains on part of the data).
            from megaloop.data.indexed_format import check_indexed_dataset  # numpy: not at --help

            check_indexed_dataset(p)
