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
"""

from __future__ import annotations

import os
import signal
import sys

INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


def _exit_at_once(signum, frame):
    os._exit(INTERRUPTED)


if __name__ == "__main__":
    # A Ctrl-C must end the run within moments; unwinding an interrupted import or tearing down
    # the interpreter (garbage-collecting numpy, the tokenizer) took up to 2 s on a loaded
    # machine. Until preprocessing starts nothing is written, so SIGINT exits at once.
    signal.signal(signal.SIGINT, _exit_at_once)

import argparse  # noqa: E402

# Scripts run from a checkout without installation too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megaloop.arguments import add_dataclass_args, dataclass_from_args  # noqa: E402
from megaloop.data.config import TokenizerConfig  # noqa: E402
from megaloop.data.jsonl import DEFAULT_BATCH_BYTES, BadInputError  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_argument_group("input/output")
    g.add_argument("--input", required=True, help="JSONL file, optionally .jsonl.gz")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to tokenize, one dataset per key (pretrain format)")
    g.add_argument("--output-prefix", required=True,
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
    add_dataclass_args(p, TokenizerConfig)
    args = p.parse_args(argv)
    if args.workers < 0 or args.batch_bytes < 1 or args.log_interval < 1:
        p.error("--workers must be >= 0, --batch-bytes and --log-interval >= 1")
    if args.data_format == "sft" and (args.json_keys != ["text"] or args.append_eod):
        p.error("--data-format sft reads prompt/response or messages and always ends responses "
                "with EOD: drop --json-keys/--append-eod")
    if not os.path.isfile(args.input):
        p.error(f"--input {args.input}: no such file")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    tok_cfg = dataclass_from_args(TokenizerConfig, args)
    try:
        tok_cfg.validate()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from megaloop.data.preprocess import preprocess  # numpy: not needed for --help

    if signal.getsignal(signal.SIGINT) is _exit_at_once:  # run as a script (below)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # now there is clean-up to do
    try:
        stats = preprocess(args.input, args.output_prefix, tok_cfg, json_keys=args.json_keys,
                           data_format=args.data_format, workers=args.workers,
                           append_eod=args.append_eod, skip_bad_lines=args.skip_bad_lines,
                           batch_bytes=args.batch_bytes, log_interval=args.log_interval,
                           progress=not args.no_progress)
    except BadInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: temporary files removed", file=sys.stderr)
        return INTERRUPTED
    print(stats.summary())
    for prefix in stats.outputs:
        print(f"wrote {prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    code = main()
    # Whatever the outcome, every file is closed, the outputs are published or removed and the
    # workers have ended: exit without the interpreter's teardown (see the top of this file).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
