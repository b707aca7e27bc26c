"""Merge Megatron indexed datasets (``.bin/.idx`` shards) into one, as Megatron-LM's
tools/merge_datasets.py does: every dataset in ``--input`` (a folder), in the order of their
names, appended with megatron-core's ``IndexedDatasetBuilder.add_index``. The result is
byte-identical to preprocessing the concatenated input in that order (tests/test_merge_datasets.py),
with the same SHA-1 in the ``.idx.digest`` beside it (megaloop.data.indexed_format).

    python tools/merge_datasets.py --input data/shards --output-prefix data/corpus_text_document

Shards written in parallel from parts of a corpus (``part_00``, ``part_01``, ...) merge in name
order, so name them in the order their documents should follow each other.
"""

from __future__ import annotations

import os
import sys

from megaloop.arguments import ArgumentParser


def find_prefixes(folder: str) -> list[str]:
    """The dataset prefixes in ``folder`` (each with its .bin and .idx), sorted by name; a file
    whose twin is missing is an error naming it."""
    if not os.path.isdir(folder):
        raise ValueError(f"--input {folder}: no such folder")
    names = [n for n in os.listdir(folder) if n.endswith((".bin", ".idx"))
             and os.path.isfile(os.path.join(folder, n))]
    prefixes = sorted({n[:-4] for n in names})
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if prefix + ext not in names:
                raise ValueError(f"--input {folder}: {prefix + ext} is missing (the twin of "
                                 f"{prefix}{'.idx' if ext == '.bin' else '.bin'})")
    if not prefixes:
        raise ValueError(f"--input {folder}: no .bin/.idx datasets in it")
    return [os.path.join(folder, p) for p in prefixes]


def token_dtype(prefix: str):
    """The token dtype an .idx declares (its header's dtype code)."""
    import struct

    from megaloop.data.indexed_format import CODE_DTYPES, INDEX_HEADER

    with open(prefix + ".idx", "rb") as f:
        head = f.read(len(INDEX_HEADER) + 9)
    return CODE_DTYPES[struct.unpack_from("<B", head, len(INDEX_HEADER) + 8)[0]]


def merge(prefixes: list[str], output_prefix: str) -> int:
    """Append the datasets ``prefixes`` into ``output_prefix``.bin/.idx; returns the number of
    documents written. All must hold the same token dtype (one tokenizer)."""
    from megaloop.data.indexed_format import check_indexed_dataset

    documents = sum(check_indexed_dataset(p) for p in prefixes)  # a cut .bin names its file here
    dtypes = {p: token_dtype(p) for p in prefixes}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{os.path.basename(p)}: {d.__name__}" for p, d in dtypes.items())
        raise ValueError(f"the datasets hold different token types ({listed}): they were "
                         f"written with different tokenizers and cannot be merged")
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    if os.path.abspath(output_prefix) in {os.path.abspath(p) for p in prefixes}:
        raise ValueError(f"--output-prefix {output_prefix} is one of the inputs; choose another")
    from megaloop import runtime

    runtime.quiet_megatron()  # after the checks: a bad input is reported without the import
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(output_prefix + ".bin", dtype=dtypes[prefixes[0]])
    for prefix in prefixes:
        builder.add_index(prefix)
    builder.finalize(output_prefix + ".idx")
    from megaloop.data.indexed_format import hash_file, write_digest

    # The merged .idx is hashed as written, not combined from the inputs' digests: its bytes
    # (pointers, boundaries) are not a function of theirs, and one read here, once, spares every
    # training rank a full read (megaloop.data.datasets keys its cache on the digest).
    write_digest(output_prefix, hash_file(output_prefix + ".idx"))
    return documents


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True,
                   help="folder holding the .bin/.idx datasets to merge (merged in name order)")
    p.add_argument("--output-prefix", "--output", dest="output_prefix", required=True,
                   help="writes <prefix>.bin and <prefix>.idx (e.g. data/corpus_text_document); "
                        "Megatron-LM's name, as tools/preprocess_data.py's; --output is accepted "
                        "too")
    p.add_argument("--multimodal", action="store_true",
                   help="Megatron-LM's multimodal datasets: not supported (megaloop's datasets "
                        "are text)")
    args = p.parse_args(argv)
    if args.multimodal:
        p.error("--multimodal is not supported: megaloop's datasets are text only")
    try:
        prefixes = find_prefixes(args.input)
        documents = merge(prefixes, args.output_prefix)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"merged {len(prefixes)} datasets ({documents} documents) into "
          f"{args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
