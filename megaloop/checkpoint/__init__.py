"""Checkpoints, below training, conversion, inference and evaluation (they all read and write
them; this package imports none of them).

- ``errors``: ``CheckpointError`` (exit 1) and ``CheckpointMismatch`` (exit 2);
- ``tracker``: the folder layout (``iter_XXXXXXX/``, ``latest_checkpointed_iteration.txt``),
  ``read_tracker``, ``checkpoint_dir``, ``available_iterations``, ``remove_stale_saves``, and
  the folder checks made before anything starts (``check_training_load``: a training --load
  holds a checkpoint; ``check_new_save``: a converted checkpoint goes into a folder without a
  run's) (standard library only);
- ``manifest``: the per-file SHA-256 manifest, written at save and verified at load;
- ``config``: ``read_run_config`` (the run configuration a checkpoint records),
  ``config_from_dict`` (standard library only at import);
- ``format``: the common part (``common_state``, ``read_common``) and the rank agreement every
  read and write goes through;
- ``save``: ``write_shards`` + ``publish`` (crash-safe, finite weights only), ``save_weights``;
- ``load``: ``load_weights``, ``load_model`` (the model a checkpoint describes, at any TP).

The trainer's save and resume (optimizer, scheduler, RNG, the divergence rule, asynchronous
saves, the --save lock) live in megaloop/training/checkpointing.py on top of these. This
``__init__`` imports nothing, so the standard-library modules stay importable without torch.
"""
