"""Reading a checkpoint's weights into a model, and building the model a checkpoint describes.

Every failure to read is one ``CheckpointError`` on every rank, naming the file and the previous
checkpoint to fall back to (``--ckpt-step``); shards of another model are a
``CheckpointMismatch`` naming the tensor and both shapes. The trainer's resume
(megaloop.training.checkpointing) adds the optimizer, scheduler and RNG streams to the same
read.
"""

from __future__ import annotations

import os
from typing import Optional

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.validation import StrictHandling

from megaloop.checkpoint.config import config_from_dict, read_run_config
from megaloop.checkpoint.errors import CheckpointError, CheckpointMismatch
from megaloop.checkpoint.format import READ_WRITE_ERRORS, agree, read_common, unwrap
from megaloop.checkpoint.manifest import MANIFEST, verify_manifest
from megaloop.checkpoint.tracker import checkpoint_dir, read_tracker, resolve, unreadable


def verify_files(path: str) -> list:
    """Collective: checkpoint folder ``path``'s files against its manifest; a CheckpointError
    naming what differs. Returns a note when there is no manifest to verify against."""
    notes = []
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        notes.append(f"> {path} has no checksum manifest (saved without --ckpt-checksums or "
                     "by an older megaloop): its files are not verified")
    problems = verify_manifest(path)
    if problems:
        raise CheckpointError(unreadable(path, problems))
    return notes


def compare_tensor_shapes(expected: dict, saved: dict, path: str) -> None:
    """Refuse shards of another model: ``expected`` maps this model's tensor keys to their
    global shapes, ``saved`` the checkpoint's (its .metadata). A checkpoint without a manifest
    whose shards were copied from another run passes the architecture check (its common.pt is
    this model's) and would fail deep in torch's reader naming only ranks."""
    diffs = [f"{key} {tuple(saved[key])} in the checkpoint, {tuple(shape)} in this model"
             for key, shape in expected.items()
             if key in saved and tuple(saved[key]) != tuple(shape)]
    if diffs:
        more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
        raise CheckpointMismatch(
            f"{path} holds tensors of another model: {'; '.join(diffs[:3])}{more}. Its shards do "
            f"not match the architecture its common.pt records (copied from another run?): load "
            f"a checkpoint this model saved, or pass the flags of the model that wrote them")


def _compare_shapes(model_state: dict, path: str) -> None:
    """The checkpoint's tensor shapes (its .metadata, read by every rank alike) against this
    model's, before torch's reader meets them."""
    # (allow_shape_mismatch: megatron-core's vocabulary-padded embedding and output layer,
    # whose padding follows the TP size and which it loads across paddings.)
    expected = {t.key: t.global_shape for t in nested_values(model_state)
                if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch}
    try:
        saved = {k: v.global_shape for k, v in
                 dist_checkpointing.load_tensors_metadata(path).items()}
    except READ_WRITE_ERRORS:
        return  # unreadable metadata: the load names the file
    compare_tensor_shapes(expected, saved, path)


def read_shards(state: dict, path: str) -> dict:
    """Collective: megatron-core's sharded ``state`` (its ``model`` entry compared by shape
    first) read from checkpoint folder ``path``."""
    _compare_shapes(state["model"], path)
    # Transformer Engine modules' extra state (FP8 scaling): a checkpoint saved with the local
    # layers holds none, and TE takes an absent state as "nothing recorded yet". Only a model
    # that asks for such state reads with megatron-core's key check; every other key stays strict.
    extra = {k: v.key for k, v in state["model"].items()
             if isinstance(v, ShardedObject) and k.endswith(EXTRA_STATE)}
    error = loaded = None
    absent = set()
    try:
        if extra:
            loaded, _, absent = dist_checkpointing.load(state, path,
                                                        strict=StrictHandling.RETURN_UNEXPECTED)
        else:
            loaded = dist_checkpointing.load(state, path)
    except READ_WRITE_ERRORS as exc:  # a shard cut short or missing: megatron-core's chain
        error = exc
    failures = agree(error)
    if failures:
        raise CheckpointError(unreadable(path, failures))
    absent = {getattr(k, "key", k) for k in absent}
    others = sorted(absent - set(extra.values()))
    if others:
        raise CheckpointMismatch(f"{path} lacks {', '.join(others[:3])}"
                                 f"{' and more' if len(others) > 3 else ''}: load a checkpoint "
                                 f"this model saved, or pass the flags of the model that wrote it")
    for k, key in extra.items():
        if key in absent:
            loaded["model"][k] = None
    return loaded


def load_weights(load_dir: str, model, *, iteration: Optional[int] = None,
                 verify: bool = True) -> Optional[dict]:
    """Collective: ``model``'s weights from ``load_dir``'s latest checkpoint (or that of
    ``iteration``). None when there is none, else ``{"path", "common", "notes"}``.
    ``verify``: check the files against the manifest first."""
    path = resolve(load_dir, iteration) if os.path.isdir(load_dir) else None
    if path is None:
        return None
    common = read_common(path)
    notes = verify_files(path) if verify else []
    module = unwrap(model)
    loaded = read_shards({"model": module.sharded_state_dict()}, path)
    load_module_state(module, loaded["model"])
    return {"path": path, "common": common, "notes": notes}


EXTRA_STATE = "._extra_state"


def load_module_state(module, state: dict) -> None:
    """``module.load_state_dict(state)``, strict except for missing ``*._extra_state`` keys.

    megatron-core 0.16.1 never puts Transformer Engine attention's ``core_attention._extra_state``
    into a sharded state dict, so a checkpoint never holds it and a strict load would fail on it.
    TE 2.11 hides that with a load hook that drops the missing key, a hook its docstring says
    will be phased out. Megatron-LM loads such checkpoints with strict=False; here only missing
    extra state (module state TE rebuilds itself, e.g. FP8 scaling history) is forgiven: a
    missing weight or an unexpected key still fails as a strict load does."""
    result = module.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith(EXTRA_STATE)]
    if missing or result.unexpected_keys:
        parts = []
        if result.unexpected_keys:
            parts.append("Unexpected key(s) in state_dict: "
                         + ", ".join(f'"{k}"' for k in result.unexpected_keys))
        if missing:
            parts.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing))
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}:\n\t"
                           + "\n\t".join(parts))


def load_model(load_dir: str, tp_size: int = 1, iteration: Optional[int] = None):
    """(model at TP = ``tp_size``, its ModelConfig, LoopConfig, saved run config) from
    ``load_dir``'s latest checkpoint (or that of ``iteration``: --ckpt-step), whatever layout
    saved it (dist_checkpointing reshards).
    Collective: needs torch.distributed and megatron-core's parallel state at that TP size."""
    from megaloop.model.config import LoopConfig, ModelConfig
    from megaloop.model.looped_gpt import build_model

    run = read_run_config(load_dir, iteration)
    model_cfg = config_from_dict(ModelConfig, run["model"])
    loop = config_from_dict(LoopConfig, run["loop"])
    # The padded table size is in the checkpoint itself; building with it reproduces the shape
    # whatever tokenizer files this machine has.
    path = checkpoint_dir(load_dir, read_tracker(load_dir) if iteration is None else iteration)
    meta = dist_checkpointing.load_tensors_metadata(path)
    rows = meta["embedding.word_embeddings.weight"].global_shape[0]
    model = build_model(model_cfg, loop, rows, tp_size=tp_size)
    load_weights(load_dir, model, iteration=iteration)
    return model, model_cfg, loop, run
