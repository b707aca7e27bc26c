"""The flags every generation entry point shares (tools/generate.py, tools/serve.py). Standard
library only: ``--help`` of those tools imports no torch or megatron-core."""

from __future__ import annotations

import argparse


def add_generation_flags(p: argparse.ArgumentParser) -> None:
    """--num-loops, --kv-policy, --exit (checked by loading.check_generation_flags)."""
    p.add_argument("--num-loops", type=int, default=None,
                   help="loop steps per token (default: the trained --num-loops)")
    p.add_argument("--kv-policy", default="full",
                   help="full | last-step | first-step | shared-mod-<k> | none (default: full)")
    p.add_argument("--exit", default=None,
                   help="early exit: q:<q> | kl:<eps> | fixed:<n> (default: all steps)")
