"""Train a sentencepiece BPE tokenizer on JSONL text (for --tokenizer-type SentencePieceTokenizer).

    python tools/train_tokenizer.py --input demo.jsonl --output-prefix tok/demo --vocab-size 1024

Writes ``<prefix>.model`` and ``<prefix>.vocab``. Special ids are fixed (unk 0, bos 1, eos 2 =
EOD, pad 3) so pad never equals EOD; ``byte_fallback`` makes any text encodable. Documents are
read with the same JSONL reader as tools/preprocess_data.py; every non-empty line of a document
is one training sentence.
"""

from __future__ import annotations

import os
from typing import Iterator


from megaloop.arguments import ArgumentParser
from megaloop.data.jsonl import BadInputError, iter_json
from megaloop.data.tokenizers import train_sentencepiece


def sentences(paths: list[str], json_keys: list[str]) -> Iterator[str]:
    for path in paths:
        for lineno, doc in iter_json(path):
            if not isinstance(doc, dict):
                raise BadInputError(f"{path}:{lineno}: expected a JSON object")
            for key in json_keys:
                for line in str(doc.get(key) or "").split("\n"):
                    if line.strip():
                        yield line


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="JSONL files (.jsonl or .jsonl.gz)")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--output-prefix", "--output", dest="output_prefix", required=True,
                   help="writes <prefix>.model/.vocab")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--character-coverage", type=float, default=1.0)
    p.add_argument("--input-sentence-size", type=int, default=0,
                   help="train on a random sample of this many sentences (0: all)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    try:
        model = train_sentencepiece(sentences(args.input, args.json_keys), args.output_prefix,
                                    args.vocab_size, model_type=args.model_type,
                                    character_coverage=args.character_coverage,
                                    input_sentence_size=args.input_sentence_size,
                                    num_threads=args.threads)
    except BadInputError as err:
        raise SystemExit(f"error: {err}")
    print(f"wrote {model}")


if __name__ == "__main__":
    main()
