"""Which checkpoint to load (``LoadConfig``: the flags every entry point that loads one
shares), and the run configuration a checkpoint records (``run_config`` in its common part: one
dict per config dataclass, ``{"model": {...}, "loop": {...}, "tokenizer": {...}, ...}``), read
without a process group, with the config dataclasses rebuilt from it. Standard library only at
import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megaloop.checkpoint.tracker import TRACKER, resolve


@dataclass
class LoadConfig:
    """Loading a checkpoint (Megatron-LM's flags)."""

    load: Optional[str] = None
    """Directory to resume from (its latest checkpoint). A training run refuses one that holds
    no checkpoint, unless it is also --save (a resubmittable job's first launch starts from
    scratch there)."""

    ckpt_step: Optional[int] = None
    """Load this iteration instead of the one named in latest_checkpointed_iteration.txt."""

    def validate(self) -> None:
        if self.ckpt_step is not None and not self.load:
            raise ValueError("--ckpt-step needs --load DIR")


def config_from_dict(cls, values: dict):
    """Build a config from a saved dict, ignoring keys this version does not know."""
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in known})


def read_run_config(load_dir: str, iteration: Optional[int] = None) -> dict:
    """The run configuration (a dict of sections) that ``load_dir``'s latest checkpoint, or
    that of ``iteration``, was saved with; no process group needed."""
    from megaloop.checkpoint.format import read_common  # megatron-core: only when reading

    path = resolve(load_dir, iteration)
    if path is None:
        raise FileNotFoundError(f"no checkpoint in {load_dir} (no {TRACKER})")
    return read_common(path)["run_config"]
