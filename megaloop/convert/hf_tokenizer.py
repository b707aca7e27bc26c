"""The tokenizer files of an export-hf folder: plain `transformers` tokenizes as megaloop did.

megaloop tokenizes documents with its own tokenizers (megaloop/data/tokenizers.py) and adds no
special tokens: a document carries no BOS and ends in EOD, which preprocessing appends. The
exported folder holds files that ``AutoTokenizer.from_pretrained(folder)`` reads into a tokenizer
that gives the same ids for the same text, with EOD as its eos token and nothing added:

- sentencepiece: the ``.model`` (as tokenizer.model) and tokenizer.json, converted from it by
  transformers' own sentencepiece converter, loaded as ``PreTrainedTokenizerFast``. Not
  ``LlamaTokenizer``: transformers rebuilds that one's pipeline without the model's normalizer
  (sentencepiece's default nmt_nfkc with extra-whitespace removal), so "a  b", "ﬁ" or a trailing
  space get ids sentencepiece never gives; the converted tokenizer.json keeps the normalizer.
  Loading the folder needs neither sentencepiece nor protobuf (converting needs both).
- a Hugging Face tokenizer.json: copied, with the tokenizer_config.json beside it (keys it lacks
  are added); GPT-2 BPE (vocab.json + merges.txt): written as the tokenizer.json megaloop runs.
- NullTokenizer: the ids are the text; no tokenizer files (config.json still names EOD).

As everywhere in Hugging Face tokenizers, text that spells a special token ("</s>") becomes that
token, where megaloop's own sentencepiece encoding reads it as ordinary characters.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from megaloop.data.config import TokenizerConfig
from megaloop.data.tokenizers import (NO_PAD, GPT2BPETokenizer, HuggingFaceTokenizer,
                                      SentencePieceTokenizer, Tokenizer)


def special_token_ids(tokenizer: Tokenizer) -> dict:
    """The token ids of config.json and generation_config.json: eos = EOD (generate() stops there),
    bos (None when the tokenizer has none), pad = the tokenizer's pad, else EOD (what
    transformers' generate() pads finished rows with when no pad is set, said here so it does not
    warn; a padded position is masked, so the id is never read)."""
    return {"bos_token_id": tokenizer.bos, "eos_token_id": tokenizer.eod,
            "pad_token_id": tokenizer.pad if tokenizer.pad != NO_PAD else tokenizer.eod}


def write_tokenizer_files(cfg: TokenizerConfig, tokenizer: Tokenizer, out_dir: str,
                          context: int) -> list[str]:
    """Write the tokenizer files of ``tokenizer`` (built from ``cfg``) into ``out_dir``; returns
    their names. ``context``: the model's context in tokens (tokenizer_config's
    model_max_length)."""
    if cfg.tokenizer_type == "NullTokenizer":
        return []
    settings = _tokenizer_settings(tokenizer, context)
    if isinstance(tokenizer, SentencePieceTokenizer):
        shutil.copy(tokenizer.model_file, os.path.join(out_dir, "tokenizer.model"))
        _sentencepiece_json(tokenizer.model_file, os.path.join(out_dir, "tokenizer.json"))
    elif isinstance(tokenizer, HuggingFaceTokenizer):
        shutil.copy(tokenizer.model_file, os.path.join(out_dir, "tokenizer.json"))
        beside = os.path.join(os.path.dirname(tokenizer.model_file), "tokenizer_config.json")
        if os.path.isfile(beside):  # the run's own settings win; ours fill what it lacks
            with open(beside) as f:
                settings = {**settings, **json.load(f)}
    elif isinstance(tokenizer, GPT2BPETokenizer):
        tokenizer._tok.save(os.path.join(out_dir, "tokenizer.json"))
    else:
        raise ValueError(f"export-hf cannot write the tokenizer files of --tokenizer-type "
                         f"{cfg.tokenizer_type}")
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(settings, f, indent=2)
    specials = {k: settings[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                if settings.get(k) is not None}
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(specials, f, indent=2)
    names = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    return names + (["tokenizer.model"] if isinstance(tokenizer, SentencePieceTokenizer) else [])


def _tokenizer_settings(tokenizer: Tokenizer, context: int) -> dict:
    """tokenizer_config.json: a class every transformers version has that loads tokenizer.json
    as it is, the special tokens by their pieces, no BOS/EOS added (megaloop adds none)."""
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
                "add_eos_token": False, "clean_up_tokenization_spaces": False,
                "model_max_length": context, "eos_token": tokenizer.piece(tokenizer.eod)}
    if tokenizer.bos is not None:
        settings["bos_token"] = tokenizer.piece(tokenizer.bos)
    if tokenizer.pad != NO_PAD:
        settings["pad_token"] = tokenizer.piece(tokenizer.pad)
    if isinstance(tokenizer, SentencePieceTokenizer):
        unk = tokenizer._sp.unk_id()
        if unk >= 0:
            settings["unk_token"] = tokenizer.piece(unk)
    return settings


def _sentencepiece_json(model_file: str, path: str) -> None:
    """tokenizer.json of a sentencepiece model, by transformers' converter (the one
    ``TokenizersBackend`` runs on a folder holding only a tokenizer.model)."""
    try:
        import google.protobuf  # noqa: F401  (the converter reads the model's protobuf)
        from transformers import TokenizersBackend
    except ImportError as exc:
        raise ValueError(f"export-hf converts the sentencepiece model to tokenizer.json with "
                         f"transformers, which needs {exc.name}: pip install transformers "
                         f"protobuf (or megaloop's hf extra)") from None
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(model_file, os.path.join(tmp, "tokenizer.model"))
        converted = TokenizersBackend.from_pretrained(tmp, add_bos_token=False,
                                                      add_eos_token=False)
    converted.backend_tokenizer.save(path)
