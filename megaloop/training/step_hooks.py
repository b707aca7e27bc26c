"""What runs around a training step besides the step itself (Megatron-LM's flags of the same
names): manual garbage collection, releasing cached GPU memory, a torch profiler window, and
the parameter norm for the log line. The training loop calls ``before_step`` / ``after_step`` /
``around_eval``, and ``close`` when the run ends; each hook is off unless its flag is given.

No ``gc.freeze()`` after the first step: it was measured against the plain loop
(benchmarks/gc_freeze.py, CPU) and its difference in steps/s stayed within the spread of the
runs; the one full collection it saves in a run costs about 2% of 300 small steps."""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager

import torch
from megatron.core import parallel_state


class StepHooks:
    def __init__(self, training, logging, rank: int, save_dir=None):
        self.training, self.logging, self.save_dir = training, logging, save_dir
        self.profiler = None
        self.profiling = logging.profile and rank in logging.profile_ranks
        self.gc_was_enabled = gc.isenabled()
        if training.manual_gc:
            # A collection that starts on one rank mid-step stalls every other rank at the next
            # collective; collecting at fixed iterations keeps the ranks in step.
            gc.disable()

    def close(self) -> None:
        """The run has ended (trained, stopped or failed): automatic collection back on after
        --manual-gc, for a process that goes on after ``train()`` (a notebook, a sweep)."""
        if self.training.manual_gc and self.gc_was_enabled:
            gc.enable()

    def before_step(self, iteration: int) -> None:
        """``iteration``: steps completed so far (the step about to run is iteration + 1)."""
        if self.profiling and iteration == self.logging.profile_step_start:
            self.profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]
                + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []),
                record_shapes=True, with_stack=False)
            self.profiler.start()

    def after_step(self, iteration: int) -> None:
        """``iteration``: steps completed, this one included."""
        if self.profiler is not None and iteration == self.logging.profile_step_end:
            self.profiler.stop()
            self.profiler.export_chrome_trace(self.trace_path())
            self.profiler = None
        tr = self.training
        if tr.manual_gc and tr.manual_gc_interval and iteration % tr.manual_gc_interval == 0:
            gc.collect()
        if tr.empty_unused_memory_level >= 1 and torch.cuda.is_available():
            torch.cuda.empty_cache()

    @contextmanager
    def around_eval(self):
        if self.training.manual_gc:
            gc.collect()
        yield
        if self.training.manual_gc:
            gc.collect()
        if self.training.empty_unused_memory_level >= 2 and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def trace_path(self) -> str:
        """Chrome trace (open in chrome://tracing or Perfetto) of the profiled iterations."""
        folder = self.logging.tensorboard_dir or os.path.join(self.save_dir or ".", "profile")
        os.makedirs(folder, exist_ok=True)
        lg = self.logging
        return os.path.join(folder, f"trace_rank{torch.distributed.get_rank()}_iters"
                                    f"{lg.profile_step_start + 1}-{lg.profile_step_end}.json")


def params_norm(model) -> float:
    """L2 norm of every parameter, each counted once over the model-parallel ranks: a
    tensor-parallel shard on every TP rank, a replicated parameter (norms, the gate) on TP rank 0
    only, a pipeline stage's parameters on that stage, the last stage's copy of a tied
    embedding not at all. Collective over the model-parallel group."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    total = torch.zeros(1, dtype=torch.float64, device=next(model.parameters()).device)
    for p in model.parameters():
        if getattr(p, "shared", False):  # megatron-core marks only the last stage's copy
            continue
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            total += p.detach().double().pow(2).sum()
    torch.distributed.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return float(total.sqrt())
