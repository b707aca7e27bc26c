"""``megaloop <command> [flags]``: the tools under one name (the console script setup.py installs;
``python -m megaloop`` is the same). ``megaloop --help`` lists the commands and imports nothing
heavy; ``megaloop <command> --help`` is that command's own help. Training keeps Megatron-LM's
launch, ``torchrun --nproc_per_node N pretrain_looplm.py [flags]``."""

from __future__ import annotations

import difflib
import importlib
import sys
from typing import NamedTuple


class Command(NamedTuple):
    module: str  # imported only when the command runs: `megaloop --help` stays instant
    entry: str  # the module's function that runs the command with sys.argv[1:] as its flags
    summary: str


def _tool(name: str, summary: str, entry: str = "main") -> Command:
    return Command(f"megaloop.cli.{name}", entry, summary)


# In the order a newcomer meets them: data, then a trained checkpoint's uses, then conversion.
COMMANDS = {
    "demo-corpus": _tool("make_demo_corpus", "write the synthetic demo corpus (JSONL)"),
    "train-tokenizer": _tool("train_tokenizer", "train a SentencePiece tokenizer on JSONL text"),
    "preprocess": _tool("preprocess_data", "tokenize JSONL into indexed datasets (Megatron-LM's "
                        "flags)", entry="program"),
    "merge": _tool("merge_datasets", "merge indexed datasets into one"),
    "generate": _tool("generate", "generate text from a checkpoint or an exported folder"),
    "serve": _tool("serve", "serve a model over an OpenAI-compatible HTTP API"),
    "evaluate": _tool("evaluate", "score a model at several depths: per-step loss, exits, plots"),
    "lm-eval": _tool("run_lm_eval", "lm-evaluation-harness with the megaloop model (its flags)"),
    "convert": _tool("convert_checkpoint", "import-hf / export-hf: Hugging Face folders in and "
                     "out"),
    "plot": _tool("plot_run", "draw a run's --log-jsonl file into one PNG"),
    "probes": _tool("attention_probes", "attention probes per loop step of a saved model"),
    "gpu-check": Command("megaloop.gpu_check.main", "main", "every GPU-only path in one run "
                         "(a CPU rehearsal without a GPU)"),
}

USAGE = "usage: megaloop <command> [flags]   (megaloop <command> --help for its flags)"


def help_text() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [USAGE, "", "Train, convert, evaluate and serve looped language models on "
             "megatron-core.", "", "commands:"]
    lines += [f"  {name:<{width}}  {cmd.summary}" for name, cmd in COMMANDS.items()]
    lines += ["", "training (Megatron-LM's command line):",
              "  torchrun --nproc_per_node N pretrain_looplm.py [flags]   "
              "(python pretrain_looplm.py --help)",
              "  torchrun --nproc_per_node N train_rl.py [flags]          (GRPO / RLTT)",
              "", "From a checkout that is not installed: python -m megaloop <command>, or the "
              "script", "tools/<module>.py (megaloop generate is python tools/generate.py)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) > 1 and argv[0] == "help":  # `megaloop help generate`: that command's help
        argv = [argv[1], "--help", *argv[2:]]
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(help_text())
        return 0 if argv else 2
    name, flags = argv[0], argv[1:]
    cmd = COMMANDS.get(name)
    if cmd is None:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"; did you mean `megaloop {close[0]}`?" if close else ""
        if name.startswith("-"):
            hint = ": the command comes first, its flags after it"
        print(f"{USAGE}\nerror: unknown command {name!r}{hint} (megaloop --help lists them: "
              f"{', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    # The command reads sys.argv as its own script would; "megaloop generate" names it in its
    # usage and error lines (argparse's prog is the basename of sys.argv[0]).
    sys.argv = [f"megaloop {name}", *flags]
    code = getattr(importlib.import_module(cmd.module), cmd.entry)()
    return 0 if code is None else code
