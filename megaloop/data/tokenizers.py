"""Tokenizers shared by preprocessing (tools/preprocess_data.py) and training.

Every tokenizer exposes the same small surface: ``vocab_size``, ``eod``, ``pad``, ``bos``,
``tokenize(text)``, ``tokenize_batch(texts)``, ``detokenize(ids)`` and ``unique_identifiers``
(megatron-core's datasets put it in their cache description and read ``eod``/``pad``).

Why not megatron-core's ``MegatronTokenizer`` wrappers for sentencepiece and Hugging Face: they
encode one text at a time through Python-side special-token handling; preprocessing wants the
libraries' native batch encoders (C++ / Rust loops), which is where its throughput comes from.
Nothing here imports megatron-core or torch: preprocessing builds these tokenizers and must
start fast.

``pad`` is never equal to ``eod``: a tokenizer without a pad piece reports -1, megatron-core's
"no pad" id, which never occurs in data.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Iterable, Optional, Sequence

from megaloop.data.config import TokenizerConfig

NO_PAD = -1  # megatron.core.datasets.megatron_dataset._PAD_TOKEN_ID: an id that is never data


class Tokenizer:
    """Common surface; subclasses set the ids and implement the encoders."""

    vocab_size: int
    eod: int
    pad: int = NO_PAD
    bos: Optional[int] = None

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def piece(self, token_id: int) -> str:
        """The text that names one token, special ones included (``</s>`` for EOD where the
        tokenizer has such a piece), as a remote tokenizer reports special tokens."""
        return self.detokenize([token_id])

    @property
    def eos(self) -> int:
        # megatron-core's pad-collision check looks for eos or eod; they are the same token here.
        return self.eod

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(cls=type(self).__name__, vocab_size=self.vocab_size, eod=self.eod,
                           pad=self.pad)


class NullTokenizer(Tokenizer):
    """Text is space-separated integer ids; ``eod = vocab_size - 1``.

    megatron-core's NullTokenizer semantics (``--vocab-size N`` means N ordinary ids followed by
    EOD = N, so the reported vocab_size is N + 1; text split on single spaces), written out here
    because preprocessing must not import megatron-core (tests/test_data_indexed_format.py
    compares the two).
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size) + 1
        self.eod = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split(" ")] if text.strip() else []

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class SentencePieceTokenizer(Tokenizer):
    """A local sentencepiece ``.model``; EOD is its eos piece, as in Megatron-LM."""

    def __init__(self, model_file: str):
        import sentencepiece

        self.model_file = os.path.abspath(model_file)
        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise ValueError(f"--tokenizer-model {model_file} has no eos piece, so there is no "
                             "EOD: retrain it with tools/train_tokenizer.py")
        self.pad = self._sp.pad_id()  # -1 when the model has none, which is NO_PAD
        self.bos = self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        # One thread: preprocessing parallelises with processes, one tokenizer per core.
        return self._sp.encode(list(texts), num_threads=num_threads)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(int(token_id))

    @property
    def unique_identifiers(self) -> OrderedDict:
        ids = super().unique_identifiers
        ids["model_file"] = self.model_file
        return ids


def _special_token(config: dict, key: str) -> Optional[str]:
    value = config.get(key)
    return value.get("content") if isinstance(value, dict) else value


class _TokenizersLibrary(Tokenizer):
    """Encoding and decoding through a ``tokenizers.Tokenizer`` in ``self._tok`` (no special
    tokens added: EOD is appended by preprocessing, as for the other tokenizers)."""

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def piece(self, token_id: int) -> str:
        return self._tok.id_to_token(int(token_id))


class HuggingFaceTokenizer(_TokenizersLibrary):
    """A local ``tokenizer.json`` read with the ``tokenizers`` library (no hub access).

    Special tokens come from ``tokenizer_config.json`` next to it when present, else from the
    usual names. Documents are encoded without added special tokens (no BOS): EOD is appended by
    preprocessing (--append-eod), as for the other tokenizers.
    """

    EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
    PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")
    BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>")

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _HFTokenizer

        json_file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        self.model_file = os.path.abspath(json_file)
        self._tok = _HFTokenizer.from_file(json_file)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config_file = os.path.join(os.path.dirname(json_file), "tokenizer_config.json")
        config = {}
        if os.path.isfile(config_file):
            with open(config_file) as f:
                config = json.load(f)

        def lookup(key: str, names: tuple[str, ...]) -> Optional[int]:
            for name in ([_special_token(config, key)] if _special_token(config, key) else names):
                if (tid := self._tok.token_to_id(name)) is not None:
                    return tid
            return None

        eod = lookup("eos_token", self.EOS_NAMES)
        if eod is None:
            raise ValueError(f"--tokenizer-model {json_file}: no end-of-text token found (set "
                             "eos_token in a tokenizer_config.json next to it)")
        self.eod = eod
        pad = lookup("pad_token", self.PAD_NAMES)
        self.pad = NO_PAD if pad is None or pad == eod else pad
        self.bos = lookup("bos_token", self.BOS_NAMES)

    @property
    def unique_identifiers(self) -> OrderedDict:
        ids = super().unique_identifiers
        ids["model_file"] = self.model_file
        return ids


class GPT2BPETokenizer(_TokenizersLibrary):
    """Megatron-LM's GPT2BPETokenizer from a local vocab.json and merges.txt: GPT-2's byte-level
    BPE (its pre-tokenization regex, bytes mapped to printable characters, no prefix space), with
    EOD ``<|endoftext|>``, run by the ``tokenizers`` library. (megatron-core 0.16.1's own class,
    MegatronHFTokenizer, passes the vocab file as the merges file and asks the hub for "gpt2", so
    it cannot build this tokenizer from local files.)"""

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import Tokenizer as _HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        self.files = (os.path.abspath(vocab_file), os.path.abspath(merge_file))
        self._tok = _HFTokenizer(models.BPE.from_file(vocab_file, merge_file))
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        self.vocab_size = self._tok.get_vocab_size()
        eod = self._tok.token_to_id("<|endoftext|>")
        if eod is None:
            raise ValueError(f"--vocab-file {vocab_file}: no <|endoftext|> token (GPT-2's EOD)")
        self.eod = eod

    @property
    def unique_identifiers(self) -> OrderedDict:
        ids = super().unique_identifiers
        ids["vocab_file"], ids["merge_file"] = self.files
        return ids


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """Build the tokenizer ``cfg`` names (validating it first)."""
    cfg.validate()
    if cfg.tokenizer_type == "NullTokenizer":
        return NullTokenizer(cfg.vocab_size)
    if cfg.tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(cfg.vocab_file, cfg.merge_file)
    if cfg.tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(cfg.tokenizer_model)
    return HuggingFaceTokenizer(cfg.tokenizer_model)


# Special ids of tokenizers trained here: explicit, so that pad never equals EOD (= eos).
SPM_UNK_ID, SPM_BOS_ID, SPM_EOS_ID, SPM_PAD_ID = 0, 1, 2, 3


def train_sentencepiece(texts: Iterable[str], model_prefix: str, vocab_size: int,
                        model_type: str = "bpe", character_coverage: float = 1.0,
                        input_sentence_size: int = 0, num_threads: int = 1) -> str:
    """Train a sentencepiece model on ``texts`` (one sentence per item); returns the .model path.

    ``byte_fallback`` makes every string encodable with a tiny vocabulary (unknown characters
    become byte pieces instead of <unk>), which keeps the round trip exact.
    """
    import sentencepiece

    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=model_prefix, vocab_size=vocab_size,
        model_type=model_type, character_coverage=character_coverage, byte_fallback=True,
        unk_id=SPM_UNK_ID, bos_id=SPM_BOS_ID, eos_id=SPM_EOS_ID, pad_id=SPM_PAD_ID,
        input_sentence_size=input_sentence_size, shuffle_input_sentence=input_sentence_size > 0,
        num_threads=num_threads, split_digits=True, minloglevel=2)
    return model_prefix + ".model"
