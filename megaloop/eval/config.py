"""What ``tools/evaluate.py`` scores, and how (flags derived by megaloop.arguments).

Data fields left unset take the checkpoint's own values (its saved run config), as do the
tokenizer flags (the trainer's, megaloop.inference.flags.add_tokenizer_flags), so
``--load CKPT --num-loops 1,2,4,8 --output-dir DIR`` scores the trainer's validation samples. The
flags carry the training flags' names. Nothing here imports torch or megatron-core: the flags are
checked before a process group starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class EvalConfig:
    """Depth sweep of a trained looped model on held-out data."""

    load: Optional[str] = None
    """A megaloop checkpoint directory, or a folder written by
    ``tools/convert_checkpoint.py export-hf``."""

    output_dir: Optional[str] = None
    """Where the report goes: ``depth_sweep.json``, ``depth_sweep.md`` and the PNG plots."""

    num_loops: Optional[str] = None
    """Comma-separated inference depths, e.g. ``1,2,4,8`` (default: every depth 1..2T, T the
    trained loop count)."""

    exit_rules: Optional[str] = None
    """Comma-separated early-exit rules scored at every depth (``q:<q>``, ``kl:<eps>``; see
    tools/generate.py); ``none`` for none (default: q:0.5,q:0.9 when the model has an exit gate,
    and kl:0.01)."""

    data_path: Optional[list[str]] = None
    """Preprocessed dataset prefix(es) (Megatron blend syntax); default: the checkpoint's, whose
    validation split is then scored in the trainer's sample order (the samples its evaluation of
    the loaded weights scored: for a finished run's last checkpoint, those of its final
    validation). Given here, the first samples of the split's own order are scored, the same
    whatever run trained the model."""

    valid_window: Optional[int] = None
    """Score the K-th window of --eval-iters x --global-batch-size validation samples (1-based;
    the trainer's K-th evaluation read window K) instead of the default: the window of the
    trainer's evaluation of the loaded weights (window 1 with --data-path or --mock-data)."""

    split: Optional[str] = None
    """Train/valid/test split of --data-path (default: the checkpoint's)."""

    data_cache_path: Optional[str] = None
    """Folder for the validation split's sample-index cache (the trainer's flag, Megatron-LM's
    name; default: ``cache`` in --output-dir, where everything else goes: the trainer's
    default, a ``cache`` folder next to the data, is the checkout's ``demo/cache`` for the
    demo)."""

    mock_data: bool = False
    """Score megatron-core's mock dataset (synthetic tokens) instead of --data-path."""

    input_file: Optional[str] = None
    """A JSONL file (one document per line, text under --json-key) or a plain text file (documents
    separated by blank lines), tokenized on the fly and cut into --seq-length windows."""

    json_key: str = "text"
    """The key holding a document's text in --input-file's JSONL lines."""

    seq_length: Optional[int] = None
    """Tokens per scored sequence (default: the checkpoint's)."""

    micro_batch_size: Optional[int] = None
    """Sequences per forward (default: the checkpoint's)."""

    global_batch_size: Optional[int] = None
    """Sequences per evaluation iteration (default: the checkpoint's); with --eval-iters it sets
    how many sequences are scored, as in training."""

    eval_iters: Optional[int] = None
    """Evaluation iterations of --global-batch-size sequences (default: the checkpoint's); with
    --input-file: every window of the file when unset."""

    task_file: Optional[str] = None
    """Held-out problems with answers (``tools/make_demo_corpus.py --tasks-output``): their
    accuracy by task family and k is scored at every depth."""

    max_tasks: int = 0
    """Score only the first this many problems of --task-file (0: all)."""

    plots: bool = True
    """Draw the PNG plots (needs matplotlib: ``pip install -e '.[eval]'``)."""

    seed: int = 1234
    """Seed of megatron-core's model-parallel RNG (evaluation draws nothing at random)."""

    ckpt_step: Optional[int] = field(default=None, metadata={"cli": False})
    """(from --ckpt-step, the trainer's flag: megaloop.inference.flags.add_ckpt_step_flag) the
    checkpoint iteration to load instead of the latest."""

    depths: list[int] = field(default_factory=list, metadata={"cli": False})
    """(derived) the parsed --num-loops; empty: 1..2T once T is known."""

    def validate(self) -> None:
        """Raise ValueError naming the flag, every independent refusal at once
        (megaloop.arguments.FlagCheck); touches the file system only."""
        from megaloop.arguments import FlagCheck

        flags = FlagCheck()
        with flags.check():
            if not self.load:
                raise ValueError("--load is required: a checkpoint directory or an exported "
                                 "folder")
            from megaloop.inference.loading import check_load

            check_load(self.load, self.ckpt_step)
        with flags.check():
            if not self.output_dir:
                raise ValueError("--output-dir is required: where the table and plots go")
        with flags.check():
            self.depths = parse_depths(self.num_loops)
        with flags.check():
            parse_rules(self.exit_rules)
        sources = [name for name, on in (("--data-path", self.data_path),
                                         ("--mock-data", self.mock_data),
                                         ("--input-file", self.input_file)) if on]
        with flags.check():
            if len(sources) > 1:
                raise ValueError(f"{' and '.join(sources)}: choose one data source")
        with flags.check():
            if self.task_file and not os.path.isfile(self.task_file):
                raise ValueError(f"--task-file {self.task_file}: no such file")
        with flags.check():
            if self.input_file and not os.path.isfile(self.input_file):
                raise ValueError(f"--input-file {self.input_file}: no such file")
        with flags.check():
            if self.valid_window is not None and self.input_file:
                raise ValueError("--valid-window picks validation samples; --input-file is "
                                 "scored whole: choose one")
        for flag, value in (("--valid-window", self.valid_window),
                            ("--seq-length", self.seq_length),
                            ("--micro-batch-size", self.micro_batch_size),
                            ("--global-batch-size", self.global_batch_size),
                            ("--eval-iters", self.eval_iters)):
            with flags.check():
                if value is not None and value < 1:
                    raise ValueError(f"{flag} {value}: must be at least 1")
        if flags.ok and self.micro_batch_size and self.global_batch_size and \
                self.global_batch_size % self.micro_batch_size:
            flags.messages.append(f"--global-batch-size {self.global_batch_size} is not a "
                                  f"multiple of --micro-batch-size {self.micro_batch_size}")
        flags.raise_any()

def parse_depths(text: Optional[str]) -> list[int]:
    """``1,2,4,8`` -> [1, 2, 4, 8]; None -> [] (the default, 1..2T)."""
    if not text:
        return []
    try:
        depths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        depths = []
    if not depths or min(depths) < 1:
        raise ValueError(f"--num-loops {text!r}: write comma-separated depths >= 1, e.g. 1,2,4,8")
    return sorted(set(depths))


def parse_rules(text: Optional[str]) -> Optional[list[str]]:
    """The rule texts (each checked), [] for ``none``, None for the default."""
    if text is None:
        return None
    if text.strip() == "none":
        return []
    from megaloop.inference.early_exit import parse_exit

    rules = [r.strip() for r in text.split(",") if r.strip()]
    for rule in rules:
        try:
            parsed = parse_exit(rule)
        except ValueError as exc:
            raise ValueError(f"--exit-rules: {exc}") from None
        if parsed.kind == "fixed":
            raise ValueError(f"--exit-rules {rule}: a fixed depth is a --num-loops entry, "
                             f"not an exit rule")
    return rules
