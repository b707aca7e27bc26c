"""Whether a checkpoint fits this run: the refusals of a --load, each naming the flag to change.

A checkpoint that does not fit the flags is refused before it is read (``CheckpointMismatch``,
exit code 2, like a bad flag): another architecture, another optimizer layout, another LR
schedule without a flag saying whose to follow. What a checkpoint's optimizer state brings back
that the flags may change, the LR bounds of every parameter group, is settled here too. (Shards
of another model are refused by the weights' read, megaloop.checkpoint.load.)
"""

from __future__ import annotations

from megaloop.checkpoint.errors import CheckpointError, CheckpointMismatch  # noqa: F401


# The flags a checkpoint's weights are tied to. A difference is refused by name on --load (also
# with --finetune): some change no tensor shape (4 -> 2 attention heads over the same hidden
# size, the norm scheme) and would load without an error into a different model.
ARCHITECTURE = {
    "model": ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "kv_channels", "position_embedding_type", "rotary_percent",
              "normalization", "apply_layernorm_1p", "swiglu", "disable_bias_linear",
              "qk_layernorm",
              "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by",
              "norm_scheme", "qk_bias", "rotary_interleaved", "embedding_scale", "squared_relu",
              "value_embeddings", "qk_layernorm_scale_free"),
    "loop": ("num_prelude_layers", "num_coda_layers", "step_norm_placement", "step_norm",
             "input_injection", "injection_source", "history_injection", "history_window",
             "timestep_conditioning", "loop_topology", "mesh_slots", "lora_rank",
             "resolution_down", "resolution_up", "state_init", "share_final_norm",
             "timestep_frequency_dim", "injection_source_norm", "readout_projection"),
}


def _gated(loop: dict) -> bool:
    return loop.get("num_loops", 1) > 1 and loop.get("exit_loss") != "last"


def compare_architecture(saved: dict, current: dict, path: str) -> list:
    """Refuse (CheckpointError) a checkpoint whose architecture flags differ from this run's;
    returns notes for the user (a changed loop count, which is allowed: Ouro lowers T between
    stages). Sections a checkpoint does not record are not compared."""
    diffs, notes = [], []

    def differ(flag, was, now):
        diffs.append(f"{flag} {was} in the checkpoint, {now} in this run")

    for section, names in ARCHITECTURE.items():
        was, now = saved.get(section), current.get(section)
        if not isinstance(was, dict):
            continue
        for name in names:
            if name in was and was[name] != now[name]:
                differ("--" + name.replace("_", "-"), was[name], now[name])
    m_was, m_now = saved.get("model") or {}, current["model"]
    if m_now["position_embedding_type"] == "learned_absolute" and \
            m_was.get("max_position_embeddings", m_now["max_position_embeddings"]) != \
            m_now["max_position_embeddings"]:
        differ("--max-position-embeddings", m_was["max_position_embeddings"],
               m_now["max_position_embeddings"])
    l_was, l_now = saved.get("loop"), current["loop"]
    if isinstance(l_was, dict) and "num_loops" in l_was:
        if _gated(l_was) != _gated(l_now):
            diffs.append(f"the checkpoint {'has' if _gated(l_was) else 'has no'} exit gate, this "
                         f"run {'needs one' if _gated(l_now) else 'has none'} (--num-loops "
                         f"{l_was['num_loops']} -> {l_now['num_loops']}, --exit-loss "
                         f"{l_was.get('exit_loss')} -> {l_now['exit_loss']})")
        elif l_was["num_loops"] != l_now["num_loops"]:
            per_step = [flag for flag, on in (
                ("--lora-rank", l_now["lora_rank"] > 0),
                ("--loop-topology mesh", l_now["loop_topology"] == "mesh"),
                ("--loop-resolutions", bool(l_now["loop_resolutions"]))) if on]
            if per_step:
                differ("--num-loops", l_was["num_loops"], f"{l_now['num_loops']} (with "
                       f"{', '.join(per_step)}, which keep parameters per loop step)")
            else:
                notes.append(f"> loop count changed on --load: the checkpoint {path} trained "
                             f"--num-loops {l_was['num_loops']}, this run uses "
                             f"{l_now['num_loops']}")
    if diffs:
        raise CheckpointMismatch(
            f"{path} was saved with another architecture: {'; '.join(diffs)}. Pass the "
            f"checkpoint's values (architecture flags must match on --load, with --finetune too)")
    return notes


def compare_optimizer_groups(saved: dict, current: dict, path: str) -> None:
    """Refuse an optimizer state whose parameter groups this run does not have: megatron-core
    puts the embedding and output layer in groups of their own only with --decoupled-lr, and
    loads a checkpoint's groups by matching them to this run's."""
    was = (saved.get("optim") or {}).get("decoupled_lr")
    now = current["optim"]["decoupled_lr"]
    if "optim" in saved and (was is None) != (now is None):
        raise CheckpointMismatch(
            f"{path}: --decoupled-lr {was} in the checkpoint, {now} in this run (the optimizer "
            f"state {'has' if was is not None else 'has no'} separate parameter groups for the "
            f"embedding and output layer): pass --decoupled-lr "
            f"{'as saved' if was is not None else 'only without the optimizer state'}, or "
            f"--no-load-optim to start the optimizer afresh")


# OptimizerParamScheduler's state that its load_state_dict checks against the flags, and the
# flags that set each value (steps count iterations, or samples under --train-samples).
SCHEDULE_FLAGS = (
    ("max_lr", "--lr"), ("min_lr", "--min-lr"),
    ("lr_warmup_steps", "warmup steps (--lr-warmup-iters / -samples / -fraction)"),
    ("lr_decay_steps", "decay steps (--lr-decay-iters / -samples, default: the run's length, "
                       "--train-iters / --train-samples)"),
    ("lr_decay_style", "--lr-decay-style"), ("start_wd", "--weight-decay"),
    ("end_wd", "--weight-decay"),
    ("wd_incr_steps", "weight-decay steps (the run's length, --train-iters / --train-samples)"),
    ("wd_incr_style", "weight-decay style"))


def compare_schedule(saved: dict, scheduler, path: str) -> None:
    """Without --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler, refuse a
    checkpoint whose LR / weight-decay schedule differs from the one the flags build (what
    megatron-core's ``OptimizerParamScheduler.load_state_dict`` would assert), naming each value:
    resuming with a longer --train-iters is the usual case."""
    if scheduler.override_opt_param_scheduler or scheduler.use_checkpoint_opt_param_scheduler:
        return
    now = scheduler.state_dict()
    diffs = []
    for key, what in SCHEDULE_FLAGS:
        text = f"{what} {now[key]} in this run, {saved.get(key)} in the checkpoint"
        if key in saved and saved[key] != now[key] and text not in diffs:
            diffs.append(text)
    if diffs:
        raise CheckpointMismatch(
            f"{path}: the checkpoint's LR / weight-decay schedule differs from this run's flags: "
            f"{'; '.join(diffs)}. Pass --override-opt_param-scheduler to follow the flags or "
            f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's")


def schedule_bounds(optimizer) -> list:
    """(max_lr, min_lr) of every parameter group: what megatron-core's OptimizerParamScheduler
    reads for each group's LR (``get_lr``), before the class values it was built with."""
    return [(g["max_lr"], g["min_lr"]) for g in optimizer.param_groups]


def settle_schedule_bounds(optimizer, from_flags: list, scheduler, path: str) -> list:
    """After the optimizer state was loaded, which brings back the checkpoint's parameter groups
    and with them the checkpoint's LR bounds (megatron-core's own resume leaves them, so
    --override-opt_param-scheduler alone changes no LR: Megatron-LM issue 1138). ``from_flags``:
    ``schedule_bounds`` of the freshly built optimizer, i.e. what this run's --lr / --min-lr and
    --decoupled-lr / --decoupled-min-lr give each group.

    With --override-opt_param-scheduler every group takes its bounds from the flags (a decoupled
    group from the decoupled flags); with --use-checkpoint-opt_param-scheduler it keeps the
    checkpoint's; with neither a difference is refused, naming the flags. Returns notes."""
    loaded = schedule_bounds(optimizer)
    if loaded == from_flags:
        return []
    diffs = []
    for group, (was_max, was_min), (now_max, now_min) in zip(optimizer.param_groups, loaded,
                                                             from_flags):
        names = (("--decoupled-lr", "--decoupled-min-lr") if group.get("is_decoupled_lr")
                 else ("--lr", "--min-lr"))
        for flag, was, now in ((names[0], was_max, now_max), (names[1], was_min, now_min)):
            text = f"{flag} {now} (checkpoint: {was})"
            if was != now and text not in diffs:
                diffs.append(text)
    if scheduler.override_opt_param_scheduler:
        for group, (max_lr, min_lr) in zip(optimizer.param_groups, from_flags):
            group["max_lr"], group["min_lr"] = max_lr, min_lr
        return [f"> --override-opt_param-scheduler: LR bounds from the flags, "
                f"{', '.join(diffs)}"]
    if scheduler.use_checkpoint_opt_param_scheduler:
        return [f"> --use-checkpoint-opt_param-scheduler: LR bounds from the checkpoint, not "
                f"{', '.join(diffs)}"]
    raise CheckpointMismatch(
        f"{path}: the checkpoint's LR bounds differ from this run's flags: {'; '.join(diffs)}. "
        f"Pass --override-opt_param-scheduler to follow the flags or "
        f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's")

