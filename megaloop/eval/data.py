"""Held-out batches for the depth sweep: the trainer's validation samples, mock data, or a text
file tokenized on the fly.

``validation_batches`` builds the validation split exactly as the trainer does (the same dataset
builder, seed, sequence length and number of requested samples, so megatron-core's sample index
and shuffle are the same) and reads the ``eval_iters x global_batch_size`` samples the trainer's
evaluation of the loaded weights read (``trainer_window``). ``file_batches`` cuts the token stream of a file into
windows of ``seq_length + 1`` tokens (inputs and shifted labels), as a GPT dataset sample.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import torch

from megaloop.eval.config import EvalConfig


@dataclasses.dataclass
class Shape:
    """The batch shape a sweep scores with (the checkpoint's unless overridden)."""

    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    eval_iters: int


def resolve_shape(cfg: EvalConfig, run: dict) -> Shape:
    """Flags first, then the checkpoint's training config; ValueError naming the flag missing."""
    training = run.get("training", {})

    def pick(flag: str, name: str, default=None):
        value = getattr(cfg, name)
        value = value if value is not None else training.get(name, default)
        if value is None:
            raise ValueError(f"{flag} is required: {cfg.load} holds no training config that "
                             f"says it")
        return int(value)

    mbs = pick("--micro-batch-size", "micro_batch_size")
    gbs = cfg.global_batch_size or training.get("global_batch_size") or mbs
    if gbs % mbs:
        raise ValueError(f"--global-batch-size {gbs} is not a multiple of --micro-batch-size "
                         f"{mbs}")
    iters = cfg.eval_iters if cfg.eval_iters is not None else \
        None if cfg.input_file else training.get("eval_iters")
    if iters is None and not cfg.input_file:
        raise ValueError(f"--eval-iters is required: {cfg.load} holds no training config")
    return Shape(pick("--seq-length", "seq_length"), mbs, int(gbs),
                 int(iters) if iters is not None else 0)


def data_config(cfg: EvalConfig, run: dict):
    """The checkpoint's DataConfig with --data-path / --split / --mock-data applied."""
    from megaloop.checkpoint.config import config_from_dict
    from megaloop.data.config import DataConfig

    data = config_from_dict(DataConfig, run.get("data", {}))
    if cfg.mock_data:
        data = dataclasses.replace(data, mock_data=True, data_path=None, train_data_path=None,
                                   valid_data_path=None, test_data_path=None)
    elif cfg.data_path:
        data = dataclasses.replace(data, mock_data=False, data_path=list(cfg.data_path),
                                   train_data_path=None, valid_data_path=None,
                                   test_data_path=None)
    if cfg.split:
        data = dataclasses.replace(data, split=cfg.split)
    # The index cache goes where this evaluation's outputs go, not where the checkpoint's run
    # kept its own (a path of the training machine) nor next to the data (for the demo, into
    # the checkout): an evaluation writes only where its user pointed it.
    cache = cfg.data_cache_path or os.path.join(cfg.output_dir, "cache")
    data = dataclasses.replace(data, num_workers=0, data_cache_path=cache)
    if not (data.mock_data or data.data_path or data.valid_data_path):
        raise ValueError("no held-out data: pass --data-path PREFIX, --input-file FILE or "
                         "--mock-data (the checkpoint names no validation data)")
    data.validate()
    return data


def trainer_window(training: dict, iteration: Optional[int]) -> int:
    """0-based index of the validation window (``eval_iters x global_batch_size`` samples) the
    trainer scored with the weights of ``iteration``. The trainer evaluates after every multiple
    of --eval-interval below --train-iters and once at the end, each evaluation reading the next
    window of one cyclic stream (megaloop/training/trainer.py, ``valid_consumed``); so the
    evaluation at iteration S is preceded by (S - 1) // interval others. For an S at which it
    did not evaluate, this is the window its next evaluation would have read."""
    interval = int(training.get("eval_interval") or 0)
    if not iteration or interval < 1 or not training.get("eval_iters"):
        return 0  # (a run with --eval-iters 0 never read its validation split)
    return (iteration - 1) // interval


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def validation_batches(cfg: EvalConfig, run: dict, tokenizer, shape: Shape,
                       iteration: Optional[int] = None) -> tuple[list[dict], str]:
    """(the micro-batches of window ``cfg.valid_window`` (1-based), default the window of the
    trainer's evaluation of ``iteration``'s weights, on this rank's device; which samples they
    are, in words)."""
    from megaloop.data.datasets import build_data_iterator, build_train_valid_test_datasets

    data = data_config(cfg, run)
    training = run.get("training", {})
    wanted = shape.eval_iters * shape.global_batch_size
    own_data = not (cfg.data_path or cfg.mock_data)
    if cfg.valid_window is not None:
        window = cfg.valid_window - 1
    else:
        window = trainer_window(training, iteration) if own_data else 0
    # The trainer asks for this many validation samples; asking for the same number keeps
    # megatron-core's sample index (epochs, shuffle) and so the samples themselves identical.
    # (A converted checkpoint's run config has no schedule: its fields are None.)
    train_iters = int(training.get("train_iters") or 0)
    interval = max(int(training.get("eval_interval") or 1), 1)
    trainer_count = (train_iters // interval + 1) * int(training.get("eval_iters") or 0) * int(
        training.get("global_batch_size") or training.get("micro_batch_size") or 1)
    if cfg.data_path or cfg.mock_data:
        # Data chosen here, not the checkpoint's: the same samples whatever trained the model
        # (checkpoints of different runs compare on equal terms).
        trainer_count = 0
    seed = int(training.get("seed") or cfg.seed)
    _, valid, _ = build_train_valid_test_datasets(
        data, tokenizer, shape.seq_length, seed,
        (0, max(trainer_count, (window + 1) * wanted), 0))
    if valid is None or len(valid) == 0:
        raise ValueError("the data has no validation split: pass --split with a non-zero "
                         "valid part (e.g. --split 98,2,0) or --input-file")
    # The trainer's stream is cyclic: a window past the end wraps to the start, as there.
    it = build_data_iterator(valid, window * wanted, shape.micro_batch_size, 0, 1, cyclic=True)
    batches = [next(it) for _ in range(wanted // shape.micro_batch_size)]
    which = f"samples {window * wanted}-{(window + 1) * wanted - 1} (window {window + 1}"
    interval = int(training.get("eval_interval") or 0)
    end = int(training.get("train_iters") or 0)
    if own_data and interval >= 1 and training.get("eval_iters") and end:
        evaluations = (end - 1) // interval + 1  # every multiple below the end, then the end
        if window < evaluations:
            at = min((window + 1) * interval, end)
            which += f": the trainer's {_ordinal(window + 1)} evaluation, at iteration {at}"
        else:
            which += f": past the trainer's {evaluations} evaluations"
    which += "; --valid-window K scores another)"
    return batches, which


def read_documents(path: str, json_key: str) -> list[str]:
    """A JSONL file's documents (the text under ``json_key`` per non-blank line) or a text
    file's (separated by blank lines)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith((".jsonl", ".json")):
        docs = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                docs.append(json.loads(line)[json_key])
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{lineno}: not a JSON object with a {json_key!r} key "
                                 f"(--json-key names the key)") from None
        return docs
    return [d.strip() for d in text.split("\n\n") if d.strip()]


def file_batches(cfg: EvalConfig, tokenizer, shape: Shape) -> list[dict]:
    """Windows of the file's token stream (documents joined by EOD), as micro-batches."""
    from megaloop.device import to_device

    stream: list[int] = []
    for doc in read_documents(cfg.input_file, cfg.json_key):
        stream.extend(tokenizer.tokenize(doc))
        stream.append(tokenizer.eod)
    window = shape.seq_length + 1
    count = len(stream) // window
    if shape.eval_iters:
        count = min(count, shape.eval_iters * shape.global_batch_size)
    count -= count % shape.micro_batch_size
    if count == 0:
        raise ValueError(f"--input-file {cfg.input_file}: {len(stream)} tokens do not fill "
                         f"{shape.micro_batch_size} windows of --seq-length {shape.seq_length} "
                         f"+ 1; lower --seq-length or --micro-batch-size")
    tokens = torch.tensor(stream[:count * window], dtype=torch.long).view(count, window)
    positions = torch.arange(shape.seq_length, dtype=torch.long)
    batches = []
    for start in range(0, count, shape.micro_batch_size):
        rows = tokens[start:start + shape.micro_batch_size]
        batches.append(to_device({
            "tokens": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous(),
            "loss_mask": torch.ones(len(rows), shape.seq_length),
            "position_ids": positions.expand(len(rows), -1).contiguous()}))
    return batches


def held_out_batches(cfg: EvalConfig, run: dict, tokenizer, iteration: Optional[int] = None
                     ) -> tuple[list[dict], Shape, str]:
    """(micro-batches, their shape, a one-line description of the data). ``iteration``: that of
    the loaded checkpoint (None for an exported folder)."""
    shape = resolve_shape(cfg, run)
    which = ""
    if cfg.input_file:
        batches = file_batches(cfg, tokenizer, shape)
        what = f"{cfg.input_file}"
    else:
        batches, which = validation_batches(cfg, run, tokenizer, shape, iteration)
        which = f", {which}"
        data = data_config(cfg, run)
        what = "mock data" if data.mock_data else \
            f"validation split {data.split} of {' '.join(data.data_path or data.valid_data_path)}"
    n = sum(b["tokens"].size(0) for b in batches)
    return batches, shape, f"{what}: {n} sequences of {shape.seq_length} tokens{which}"

