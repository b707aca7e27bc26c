"""Megatron-LM's folder layout: ``<dir>/iter_XXXXXXX/`` per checkpoint and
``<dir>/latest_checkpointed_iteration.txt`` naming the newest complete one. Standard library only.

A save writes ``iter_XXXXXXX.tmp`` and renames it when complete; loads never read a ``.tmp``.
The checks of a folder before a run or a conversion uses it are here too (``check_training_load``,
``check_new_save``): they need only the layout.
"""

from __future__ import annotations

import glob
import os
import shutil
from typing import Optional

from megaloop.checkpoint.errors import CheckpointError, CheckpointMismatch

TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def available_iterations(root: str) -> list:
    """Iterations with a complete (renamed) checkpoint folder in ``root``, ascending."""
    if not os.path.isdir(root):
        return []
    its = []
    for name in os.listdir(root):
        if name.startswith("iter_") and name[5:].isdigit() and \
                os.path.isdir(os.path.join(root, name)):
            its.append(int(name[5:]))
    return sorted(its)


def fallback_hint(root: str, below: Optional[int] = None) -> str:
    """How to load another checkpoint instead: the newest one below ``below`` (else the newest)."""
    its = [i for i in available_iterations(root) if below is None or i < below]
    if not its:
        return f"{root} holds no other checkpoint folder to pick with --ckpt-step"
    return (f"load the previous checkpoint instead with --ckpt-step {its[-1]} (available in "
            f"{root}: {', '.join(map(str, available_iterations(root)))})")


def read_tracker(root: str) -> Optional[int]:
    """The iteration named in ``root``'s latest file, or None when there is no checkpoint."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:  # bytes: a damaged file must not end in a UnicodeDecodeError
        raw = f.read()
    text = raw.decode("ascii", errors="replace").strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {raw[:40]!r} instead of an iteration number; "
                              f"{fallback_hint(root)} (or fix or delete the file)")
    return int(text)


def write_tracker(save_dir: str, iteration: int) -> None:
    tracker = os.path.join(save_dir, TRACKER)
    with open(tracker + ".tmp", "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker + ".tmp", tracker)  # atomic: readers see the old or the new name


def resolve(load_dir: str, iteration: Optional[int]) -> Optional[str]:
    """The folder of checkpoint ``iteration`` (None: the one the tracker names) in ``load_dir``;
    None when the tracker names none; a CheckpointError when the folder is missing."""
    if iteration is None:
        iteration = read_tracker(load_dir)
        if iteration is None:
            return None
    path = checkpoint_dir(load_dir, iteration)
    if not os.path.isdir(path):
        raise CheckpointError(
            f"checkpoint {path} does not exist (named by {TRACKER} or --ckpt-step); "
            f"{fallback_hint(load_dir, iteration)}")
    return path


def check_new_save(save_dir: str, writer: str) -> None:
    """Refuse (ValueError) to write a checkpoint of iteration 0 (``writer``: which tool) into a
    folder that already holds a run's (its tracker, checkpoint folders finished or not): the
    new tracker would hide the run's checkpoints, and a resume of that run would load this."""
    names = sorted(n for n in os.listdir(save_dir) if n == TRACKER or n.startswith("iter_")) \
        if os.path.isdir(save_dir) else []
    if names:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise ValueError(f"--save {save_dir} already holds a run's checkpoints ({shown}): "
                         f"{writer} writes iteration 0 and would point {TRACKER} at it; choose "
                         f"a new or empty folder")


def is_hf_folder(path: str) -> bool:
    """A Hugging Face model folder (config.json and safetensors weights), which import-hf
    converts."""
    return os.path.isfile(os.path.join(path, "config.json")) and \
        bool(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))


def check_training_load(load: Optional[str], ckpt_step: Optional[int], *, save: Optional[str],
                        finetune: bool) -> None:
    """Refuse (CheckpointMismatch, exit 2) a training run's --load that holds no megaloop
    checkpoint, which would otherwise train from random weights under the name of a resume or a
    fine-tune. The one exception is Megatron-LM's resubmittable job: --load equal to --save and
    no checkpoint in it yet (missing or without a tracker) starts from scratch, and later
    submissions resume. Standard library only: called while validating the flags."""
    if not load or ckpt_step is not None:  # --ckpt-step names its folder: resolve() checks it
        return
    if os.path.isdir(load) and read_tracker(load) is not None:
        return  # (whether its folder exists: the resume checks name it)
    if os.path.isdir(load) and is_hf_folder(load):
        raise CheckpointMismatch(
            f"--load {load} is a Hugging Face model folder (config.json + *.safetensors), not a "
            f"megaloop checkpoint: convert it first with `python tools/convert_checkpoint.py "
            f"import-hf --hf-dir {load} --save DIR` and pass --load DIR")
    found = available_iterations(load)
    if found:  # complete checkpoint folders but no tracker (deleted, or never written)
        raise CheckpointMismatch(
            f"--load {load}: no {TRACKER} there, but it holds checkpoint folders of iterations "
            f"{', '.join(map(str, found))}: pick one with --ckpt-step {found[-1]} (or restore "
            f"{TRACKER})")
    fresh_resumable = bool(save) and not finetune and \
        os.path.realpath(load) == os.path.realpath(save)
    if fresh_resumable:
        return
    what = "the folder does not exist" if not os.path.exists(load) else f"no {TRACKER}"
    if finetune:
        way_out = "point --load at the checkpoint to start from"
    else:
        way_out = ("point --load at a checkpoint folder, or drop --load to train from scratch "
                   "(a job that resumes itself passes the same folder to --save and --load)")
    raise CheckpointMismatch(f"--load {load}: no checkpoint there ({what}); {way_out}")


def unreadable(path: str, detail: str) -> str:
    """The message for checkpoint folder ``path`` that cannot be read: what failed, and the
    checkpoint to fall back to."""
    root, name = os.path.split(os.path.normpath(path))
    below = int(name[5:]) if name[5:].isdigit() else None
    return f"cannot load checkpoint {path}: {detail}. {fallback_hint(root, below)}"


def remove_stale_saves(save_dir: str) -> list:
    """Rank 0: delete the ``iter_*.tmp`` folders of saves that never finished (a run killed or
    failed while saving; loads never read them). Returns what was removed."""
    removed = []
    if save_dir and os.path.isdir(save_dir):
        for name in sorted(os.listdir(save_dir)):
            path = os.path.join(save_dir, name)
            if name.startswith("iter_") and name.endswith(".tmp") and os.path.isdir(path):
                shutil.rmtree(path)
                removed.append(path)
    return removed
