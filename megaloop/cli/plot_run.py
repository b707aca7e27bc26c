"""Draw a training run from its --log-jsonl file into one PNG.

    python tools/plot_run.py demo/train.jsonl --output demo/train.png

Panels: per-step training and validation loss, the exit distribution over time, p0 with the
collapse threshold, the gradient norm (and skipped steps), per-step gradient norms (runs with
--log-grad-norm-per-step), the learning rate, the validation loop geometry, throughput and peak
memory, and the loss-spike count. Needs matplotlib (``pip install -e '.[eval]'``).
"""

from __future__ import annotations

import argparse
import os
import sys


from megaloop.arguments import ArgumentParser, add_dataclass_args
from megaloop.eval.run_plot import NotARunLog, plot_run, read_run, unknown_keys
from megaloop.training.config import LoggingConfig


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("jsonl", help="the run's --log-jsonl file")
    p.add_argument("--output", default=None, help="PNG path (default: the JSONL's name, .png)")
    # The trainer's flag (drawn on the p0 panel): pass the run's value.
    add_dataclass_args(p, LoggingConfig, only=("p0_collapse_threshold",),
                       title="the run's --p0-collapse-threshold, drawn on the p0 panel")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    output = args.output or os.path.splitext(args.jsonl)[0] + ".png"
    try:
        records = read_run(args.jsonl)
    except (OSError, NotARunLog) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: plotting needs matplotlib: pip install -e '.[eval]'", file=sys.stderr)
        return 2
    from megaloop.rl.plot import is_rl_run, plot_rl_run

    if is_rl_run(records):  # train_rl.py's telemetry (megaloop/rl/plot.py)
        panels = plot_rl_run(records, output, title=os.path.basename(args.jsonl))
        print(f"wrote {output} ({len(records)} RL records; panels: {', '.join(panels)})")
        return 0
    unknown = unknown_keys(records)
    if unknown:
        print(f"warning: keys this tool does not draw: {', '.join(unknown)}", file=sys.stderr)
    panels = plot_run(records, output, args.p0_collapse_threshold,
                      title=os.path.basename(args.jsonl))
    print(f"wrote {output} ({len(records)} records; panels: {', '.join(panels)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
