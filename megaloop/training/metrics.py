"""Throughput accounting on effective depth, and the one logging path (stdout, JSONL, TB, W&B).

FLOPs are counted per *application* of a layer (megaloop.model.flops, re-exported here for the
trainer, the GPU check and the benchmarks): a looped model runs its core T times, and the coda,
head and gate once per read-out step.
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

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


def format_train_line(r: dict) -> str:
    steps = " ".join("-" if v is None or not math.isfinite(v) else f"{v:.4f}"
                     for v in r["step_losses"])
    probs = " ".join(f"{v:.3f}" for v in r["exit_probs"]) if r["exit_probs"] else "-"
    return (f" iteration {r['iteration']:6d}/{r['train_iters']:6d} | consumed samples "
            f"{r['consumed_samples']:9d} | {r['ms_per_iter']:8.1f} ms/iter | "
            f"{r['tokens_per_sec']:9.0f} tok/s | {r['tflops_per_gpu']:7.3f} TFLOP/s/GPU | "
            f"lr {r['lr']:.3e} | loss {r['loss']:.5f} | step losses [{steps}] | "
            f"exit p [{probs}] | p0 {'-' if r['p0'] is None else format(r['p0'], '.3f')} | "
            f"grad norm {r['grad_norm']:.4f} | "
            + (f"params norm {r['params_norm']:.3f} | " if "params_norm" in r else "")
            + f"skipped {r['skipped_iters']} | mem {r['mem_gib']:.2f} GiB" + _format_diagnostics(r))


def _format_diagnostics(r: dict) -> str:
    text = ""
    if "loss_spikes" in r:
        text += f" | loss spikes {r['loss_spikes']}"
        if r.get("p0_collapse_iters") is not None:  # None: no exit gate, nothing to watch
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
