"""lm-evaluation-harness with the ``megaloop`` model registered: takes exactly lm-eval's flags.

    python tools/run_lm_eval.py --model megaloop --model_args load=demo/checkpoint,num_loops=4 \
        --include_path examples/lm_eval_tasks --tasks megaloop_demo_mc --limit 20
    python tools/run_lm_eval.py --model megaloop --model_args load=CKPT,exit=q:0.5 \
        --tasks hellaswag,arc_easy --batch_size 8          # datasets already in the HF cache

lm-eval registers models by import and offers no plugin hook for them, so this wrapper imports
megaloop's adapter (megaloop/eval/lm_eval_adapter.py) and then runs lm-eval's own command line.
Needs the ``eval`` extra (``pip install -e '.[eval]'``). One flag of its own: ``--no-progress``
turns off the megaloop model's progress bars over its requests (stderr), as
tools/preprocess_data.py's and tools/evaluate.py's flag does; lm-eval's bars of its own set-up
stay.
"""

from __future__ import annotations

import sys



def take_no_progress(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--no-progress`` (lm-eval's parser does not know it), and whether it was
    there."""
    rest = [a for a in argv if a != "--no-progress"]
    return rest, len(rest) < len(argv)


def main() -> None:
    sys.argv[1:], no_progress = take_no_progress(sys.argv[1:])
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        sys.exit("error: lm-evaluation-harness is not installed: pip install -e '.[eval]'")
    from megaloop import runtime

    runtime.quiet_megatron()
    from megaloop.eval.lm_eval_adapter import MegaloopLM, ModelArgsError  # registers megaloop

    MegaloopLM.progress = not no_progress

    try:
        cli_evaluate()
    except ModelArgsError as exc:
        sys.stderr.write(f"error: --model_args {exc}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
