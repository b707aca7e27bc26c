"""Throughput accounting on effective depth, and the one logging path (stdout, JSONL, TB, W&B).

FLOPs are counted per *application* of a layer (megaloop.model.flops, re-exported here for the
trainer, the GPU check and the benchmarks): a looped model runs its core T times, and the coda,
head and gate once per read-out step.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Callable, Optional

import torch

from megaloop.model.flops import (core_flops_per_token, core_step_flops_per_token,  # noqa: F401
                                  flops_per_iteration, layer_flops_per_token,
                                  readouts_per_forward)
from megaloop.training.config import LoggingConfig


def peak_memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _clean(value):
    """JSON-safe: NaN (a step that was not read out) becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


class MetricsLogger:
    """Writes each record to stdout (rank 0), JSONL, TensorBoard and W&B as configured."""

    def __init__(self, cfg: LoggingConfig, run_config: dict, is_writer: bool):
        self.cfg, self.is_writer = cfg, is_writer
        self.jsonl = self.tb = self.wandb = None
        if not is_writer:
            return
        if cfg.log_jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.log_jsonl)), exist_ok=True)
            self.jsonl = open(cfg.log_jsonl, "a", buffering=1)
        if cfg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(cfg.tensorboard_dir)
        if cfg.wandb_project:
            import wandb

            self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_exp_name,
                                    dir=cfg.wandb_save_dir, config=run_config)

    def print(self, text: str) -> None:
        if self.is_writer:
            print(text, flush=True)

    def log(self, record: dict, line: Optional[str] = None) -> None:
        if not self.is_writer:
            return
        record = {k: _clean(v) for k, v in record.items()}
        if line:
            print(line, flush=True)
        if self.jsonl:
            self.jsonl.write(json.dumps(record) + "\n")
        step = record["iteration"]
        prefix = record.get("split", "train") + "/"
        scalars = {}
        for key, value in record.items():
            if isinstance(value, (int, float)) and key != "iteration":
                scalars[prefix + key] = value
            elif isinstance(value, list):
                for t, v in enumerate(value, 1):
                    if isinstance(v, (int, float)):
                        scalars[f"{prefix}{key}/step{t}"] = v
                    elif isinstance(v, list):  # [layer][step] (grad_norm_per_step)
                        for s, x in enumerate(v, 1):
                            if isinstance(x, (int, float)):
                                scalars[f"{prefix}{key}/layer{t - 1}/step{s}"] = x
        if self.tb:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


class RunClock:
    """Wall time of this process's training and an estimate of the time left to --train-iters.

    The estimate is the mean wall time per iteration of the iterations this process ran *after
    its first* times the iterations left: the first step carries one-time costs (compilation,
    CUDA graph capture, allocator and data-loader warm-up) that would otherwise dominate a short
    run's mean. Between two iteration ends lies whatever the loop does there (validation, saves),
    so those recurring costs are in the mean too. ``clock`` is injectable for tests."""

    def __init__(self, train_iters: int, clock: Callable[[], float] = time.monotonic):
        self.train_iters, self.clock = train_iters, clock
        self.start = clock()
        self.first = None  # (iteration, time) at the end of this process's first iteration
        self.last = None   # (iteration, time) at the end of the latest one

    def step_done(self, iteration: int) -> None:
        """After iteration ``iteration`` (1-based, counted over the whole run) has run."""
        now = self.clock()
        self.last = (iteration, now)
        if self.first is None:
            self.first = self.last

    def elapsed_s(self) -> float:
        return self.clock() - self.start

    def eta_s(self) -> Optional[float]:
        """Seconds left to --train-iters; None until a second iteration has run."""
        if self.last is None or self.last[0] == self.first[0]:
            return None
        per_iteration = (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])
        return per_iteration * max(self.train_iters - self.last[0], 0)


def format_duration(seconds: Optional[float]) -> str:
    """h:mm:ss (hours unbounded), '-' when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def format_step_losses(values) -> str:
    """Per-step losses; a step that was not scored (NaN: e.g. SpiralFormer's --exit-loss last
    reads out only the final step) shows as '-', so it does not read as divergence. The JSONL
    keeps such a value as null (``_clean``). A diverged step shows as '-' too, but then the
    objective (`loss`) beside it is not finite and prints as nan."""
    return " ".join("-" if v is None or not math.isfinite(v) else f"{v:.4f}" for v in values)


def format_train_line(r: dict) -> str:
    steps = format_step_losses(r["step_losses"])
    probs = " ".join(f"{v:.3f}" for v in r["exit_probs"]) if r["exit_probs"] else "-"
    timing = (f"elapsed {format_duration(r['elapsed_s'])} | eta {format_duration(r['eta_s'])} | "
              if "elapsed_s" in r else "")
    return (f" iteration {r['iteration']:6d}/{r['train_iters']:6d} | {timing}consumed samples "
            f"{r['consumed_samples']:9d} | {r['ms_per_iter']:8.1f} ms/iter | "
            f"{r['tokens_per_sec']:9.0f} tok/s | {r['tflops_per_gpu']:7.3f} TFLOP/s/GPU | "
            f"lr {r['lr']:.3e} | loss {r['loss']:.5f} | step losses [{steps}] | "
            f"exit p [{probs}] | p0 {'-' if r['p0'] is None else format(r['p0'], '.3f')} | "
            f"grad norm {r['grad_norm']:.4f} | "
            + (f"params norm {r['params_norm']:.3f} | " if "params_norm" in r else "")
            + f"skipped {r['skipped_iters']} | mem {r['mem_gib']:.2f} GiB" + _format_diagnostics(r))


def format_valid_line(r: dict) -> str:
    """The validation line: loss, per-step losses ('-' for a step not scored), geometry."""
    return (f" validation at iteration {r['iteration']} | loss {r['loss']:.5f} "
            f"| step losses [{format_step_losses(r['step_losses'])}]{format_geometry(r)}")


def _format_diagnostics(r: dict) -> str:
    text = ""
    if "loss_spikes" in r:
        text += f" | loss spikes {r['loss_spikes']}"
        # None: no exit gate, nothing to watch; 0: nothing to report (the warning comes at
        # --p0-collapse-iters in a row, this count shows an episode building up to it)
        if r.get("p0_collapse_iters"):
            text += f" | p0 high for {r['p0_collapse_iters']} it"
    if r.get("grad_norm_per_step"):
        rows = "  ".join(f"L{i} [" + " ".join(f"{x:.2e}" for x in row) + "]"
                         for i, row in enumerate(r["grad_norm_per_step"]))
        text += f"\n   grad norm per core layer, per loop step: {rows}"
    return text


def format_geometry(g: dict) -> str:
    """Validation-line suffix with the loop geometry metrics ("What Makes Recurrence Effective in
    Looped Language Models?" (arXiv 2609.36636) App. C.4), per step."""
    names = {"angular_distance": "angular dist", "relative_update_norm": "rel update",
             "state_variance": "norm. state var"}
    return "".join(f" | {names[k]} [" + " ".join(f"{x:.4f}" for x in g[k]) + "]"
                   for k in names if g.get(k))
