"""Tokenize JSONL into Megatron-LM indexed datasets (``<prefix>_<key>_document.bin/.idx``).

Flags follow Megatron-LM's tools/preprocess_data.py; the output is byte-identical to its output.
Start-up takes a fraction of a second: nothing here imports torch or megatron-core. Pretraining:

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model \\
        --append-eod --workers 8

Instruction data (``prompt``/``response`` or ``messages``; writes ``<prefix>_text_document``
and its aligned ``<prefix>_lossmask_document``; EOD always ends each response):

    python tools/preprocess_data.py --input sft.jsonl --output-prefix data/sft \\
        --data-format sft --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model

One run per --output-prefix: while a run writes a prefix it holds ``<prefix>.preprocess.lock``,
and a second run into the same prefix is refused (exit code 2) naming the first.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

INTERRUPTED = 130  # the shell's code for a process ended by SIGINT (128 + 2)
TERMINATED = 143  # ... and by SIGTERM (128 + 15), what SLURM and `timeout` send


def _exit_at_once(signum, frame):
    os._exit(128 + signum)


import argparse


from megaloop.arguments import (ArgumentParser, FlagCheck, add_dataclass_args,
                                dataclass_from_args)
from megaloop.data.config import TokenizerConfig
from megaloop.data.jsonl import DEFAULT_BATCH_BYTES, BadInputError


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_argument_group("input/output")
    g.add_argument("--input", required=True, help="JSONL file, optionally .jsonl.gz")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to tokenize, one dataset per key (pretrain format)")
    g.add_argument("--output-prefix", "--output", dest="output_prefix", required=True,
                   help="writes <prefix>_<key>_document.bin/.idx")
    g.add_argument("--data-format", choices=["pretrain", "sft"], default="pretrain",
                   help="sft: prompt/response or messages -> tokens + aligned loss mask")
    g.add_argument("--append-eod", action="store_true",
                   help="append the EOD token to every document (pretrain format)")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="count and skip non-JSON lines and lines missing a key instead of "
                        "stopping at the first one")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1,
                   help="tokenizer processes, each reading its own byte range of the input "
                        "(a .gz input: one process encoding on this many threads); 0: tokenize "
                        "in the main process (debugging)")
    g.add_argument("--batch-bytes", type=int, default=DEFAULT_BATCH_BYTES,
                   help="input bytes a worker parses and encodes per batch (memory per worker is "
                        "about this plus the longest line); the output does not depend on it or "
                        "on --workers")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="documents between throughput updates of the progress bar")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--partitions", type=int, default=1,
                   help="Megatron-LM's input partitions: line i goes to partition i mod N (with "
                        "--keep-sequential-samples: N consecutive runs of lines), each partition "
                        "is preprocessed and the results are merged in partition order "
                        "(tools/merge_datasets.py), so N > 1 without --keep-sequential-samples "
                        "reorders the documents exactly as Megatron-LM does")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="with --partitions: keep the documents in input order")
    g = p.add_argument_group("sentence splitting (Megatron-LM's flags)")
    g.add_argument("--split-sentences", action="store_true",
                   help="refused: Megatron-LM splits with nltk's punkt model, which this machine "
                        "cannot download; megaloop writes whole documents")
    g.add_argument("--keep-newlines", action="store_true",
                   help="only read with --split-sentences (as in Megatron-LM)")
    g.add_argument("--lang", default="english",
                   help="only read with --split-sentences (as in Megatron-LM)")
    add_dataclass_args(p, TokenizerConfig)
    args = p.parse_args(argv)
    # Every refusal at once, each on its own line (megaloop.arguments.FlagCheck)
    flags = FlagCheck()
    with flags.check():
        if args.split_sentences:
            raise ValueError("--split-sentences is not supported: Megatron-LM splits documents "
                             "into sentences with nltk's punkt model, which needs a download "
                             "(nltk.download('punkt')) that megaloop does not make; drop it to "
                             "write whole documents")
    for flag, value, low in (("--partitions", args.partitions, 1), ("--workers", args.workers, 0),
                             ("--batch-bytes", args.batch_bytes, 1),
                             ("--log-interval", args.log_interval, 1)):
        with flags.check():
            if value < low:
                raise ValueError(f"{flag} {value} must be >= {low}")
    with flags.check():
        if args.data_format == "sft" and (args.json_keys != ["text"] or args.append_eod):
            raise ValueError("--data-format sft reads prompt/response or messages and always "
                             "ends responses with EOD: drop --json-keys/--append-eod")
    with flags.check():
        if not os.path.isfile(args.input):
            raise ValueError(f"--input {args.input}: no such file")
    with flags.check():
        dataclass_from_args(TokenizerConfig, args).validate()
    if not flags.ok:
        p.exit(2, "".join(f"{p.prog}: error: {m}\n" for m in flags.messages))
    return args


def preprocess_partitions(args, run):
    """--partitions N: split the input's lines into N files as Megatron-LM does (round robin, or
    N consecutive runs with --keep-sequential-samples), preprocess each with ``run(input,
    prefix)``, and merge every output dataset in partition order (megatron-core's
    IndexedDatasetBuilder, via megaloop/cli/merge_datasets.py). Temporary files live in a folder
    next to the output and are removed whatever happens. Returns the partitions' summed stats."""
    import gzip
    import math
    import shutil
    import tempfile

    from megaloop.cli import merge_datasets
    from megaloop.data.preprocess import temporary_suffix


    opener = gzip.open if args.input.endswith(".gz") else open
    with opener(args.input, "rt", encoding="utf-8") as f:
        lines = f.readlines()
    n = args.partitions
    if len(lines) < n:
        raise ValueError(f"--partitions {n} exceeds the {len(lines)} lines of --input "
                         f"{args.input}; use fewer partitions")
    size = math.ceil(len(lines) / n)
    parts = [lines[i * size:(i + 1) * size] for i in range(n)] if args.keep_sequential_samples \
        else [lines[i::n] for i in range(n)]
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    # Named by pid and host: a SIGKILL leaves the folder (a copy of the input) for the next run
    # to remove (remove_stale_partition_folders).
    tmp = tempfile.mkdtemp(prefix=f".partitions{temporary_suffix()}-", dir=out_dir)
    try:
        total = None
        for i, part in enumerate(parts):
            path = os.path.join(tmp, f"part_{i:05d}.jsonl")
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(part)
            stats = run(path, os.path.join(tmp, f"part_{i:05d}"))
            if total is None:
                total = stats
            else:
                total.documents_read += stats.documents_read
                total.bad_lines += stats.bad_lines
                total.seconds += stats.seconds
                for table in ("documents", "empty", "tokens"):
                    for key, value in getattr(stats, table).items():
                        getattr(total, table)[key] += value
        outputs = []
        for prefix in total.outputs:  # <tmp>/part_00000_<key>_document
            suffix = os.path.basename(prefix)[len("part_00000"):]
            merged = args.output_prefix + suffix
            merge_datasets.merge([os.path.join(tmp, f"part_{i:05d}{suffix}") for i in range(n)],
                                 merged)
            outputs.append(merged)
        total.outputs = outputs
        return total
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_partition_folders(out_dir: str) -> list[str]:
    """Remove the partition folders (``.partitions.tmp<pid>_<host>-*``) that runs on this host
    left in ``out_dir`` when they were killed (their pid has ended); a live run's, or another
    host's, are kept. Returns the folders removed."""
    import re
    import shutil
    import socket

    from megaloop.lockfile import pid_alive

    if not os.path.isdir(out_dir):
        return []
    pattern = re.compile(r"\.partitions\.tmp(\d+)_" + re.escape(socket.gethostname()) + r"-\w+")
    removed = []
    for name in sorted(os.listdir(out_dir)):
        match = pattern.fullmatch(name)
        if match and not pid_alive(int(match.group(1))):
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
            removed.append(name)
    return removed


def main(argv=None) -> int:
    args = parse_args(argv)
    tok_cfg = dataclass_from_args(TokenizerConfig, args)  # (validated by parse_args)
    from megaloop.data.preprocess import (OutputInUse, Terminated, output_lock,  # numpy
                                          preprocess, raise_terminated)

    # Every run, whatever its --partitions: a killed partitioned run's folder is garbage here.
    # (Before the handlers below: an interrupted removal needs no clean-up, the next run goes on.)
    for name in remove_stale_partition_folders(os.path.dirname(os.path.abspath(
            args.output_prefix))):
        print(f"removed {name}, the partitions of a run on this host that ended without "
              "cleaning up (killed?)", file=sys.stderr)
    if signal.getsignal(signal.SIGINT) is _exit_at_once:  # run as a script (below)
        # Now there is clean-up to do (also between the partitions of --partitions N).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, raise_terminated)

    def run(input_path, output_prefix):
        return preprocess(input_path, output_prefix, tok_cfg, json_keys=args.json_keys,
                          data_format=args.data_format, workers=args.workers,
                          append_eod=args.append_eod, skip_bad_lines=args.skip_bad_lines,
                          batch_bytes=args.batch_bytes, log_interval=args.log_interval,
                          progress=not args.no_progress)

    try:
        if args.partitions > 1:
            # The partitions are preprocessed under names of their own; the lock guards the
            # merge into --output-prefix.
            with output_lock(args.output_prefix):
                stats = preprocess_partitions(args, run)
        else:
            stats = run(args.input, args.output_prefix)
    except OutputInUse as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (BadInputError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except (ImportError, KeyboardInterrupt) as err:
        # A signal that lands while a C extension initialises (sentencepiece, imported when the
        # tokenizer is built) comes out as ImportError("initialization failed") with the
        # KeyboardInterrupt (or Terminated, its SIGTERM subclass) as its context.
        interruption = err.__context__ if isinstance(err, ImportError) else err
        if not isinstance(interruption, KeyboardInterrupt):
            raise
        terminated = isinstance(interruption, Terminated)
        print(f"{'terminated (SIGTERM)' if terminated else 'interrupted'}: temporary files "
              f"removed", file=sys.stderr)
        return TERMINATED if terminated else INTERRUPTED
    print(stats.summary())
    for prefix in stats.outputs:
        print(f"wrote {prefix}.bin/.idx")
    return 0


def program(argv=None) -> NoReturn:
    """The command as a process (``megaloop preprocess``, tools/preprocess_data.py): main(), then
    an exit without the interpreter's teardown.

    A Ctrl-C must end the run within moments; unwinding an interrupted import or tearing down
    the interpreter (garbage-collecting numpy, the tokenizer) took up to 2 s on a loaded machine.
    Until preprocessing starts nothing is written, so SIGINT and SIGTERM exit at once (main()
    installs its own handlers when it starts writing); whatever the outcome, every file is closed,
    the outputs are published or removed and the workers have ended when main() returns."""
    signal.signal(signal.SIGINT, _exit_at_once)
    signal.signal(signal.SIGTERM, _exit_at_once)
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    program()
