"""Loop diagnostics ("Closing the Loop" (arXiv 2610.00673) App. A/B, "What Makes Recurrence
Effective in Looped Language Models?" (arXiv 2609.36636) App. C.4): what the LM loss does not show.

- ``StepGradNorms``: the gradient norm of every core layer *per loop step* (Closing the Loop Fig.
  6), on the iterations the trainer logs; ``LoopGeometry``: the recurrence's geometry per step
  on validation batches. Both are measurement-only loop variants in megaloop/model/instruments.py
  (evaluation measures the geometry too).
- ``LossSpikeCounter`` and ``GateCollapseMonitor``: the stability counters of Closing the Loop
  (spike = loss more than 0.5 above the rolling median of the previous 15 iterations, and more
  than 6 x the run's own loss noise, so a small run's batch-to-batch scatter is not a spike;
  collapse = p0 above 0.95 for many iterations in a row). A spike's warning names the iteration
  and the data of its batch (``describe_samples``: sample range, dataset of a blend, documents),
  so a spike that hits every run at the same iteration is recognisable as data. The collapse
  alarm watches only runs with an exit gate (a dense run's p0 is 1 by definition).
- ``NonFiniteGuard``: --check-for-nan-in-loss-and-grad, the step-level guard: a step whose loss
  or gradients are not finite on any rank is skipped on every rank, and too many in a row stop the
  run.

The geometry compares a whole core pass's input and output, which one stage sees only at
pipeline size 1 (the trainer measures it there).
"""

from __future__ import annotations

import math
import os
import statistics
from collections import Counter, deque
from typing import Callable, Optional

import torch

from megaloop.compat import tokens_and_documents
from megaloop.device import current_device
from megaloop.model.instruments import (GEOMETRY_KEYS, LoopGeometry,  # noqa: F401
                                        StepGradNorms)


class LossSpikeCounter:
    """Counts loss spikes (Closing the Loop App. A, Table 6): an iteration whose loss exceeds the
    median of the previous ``window`` iterations by more than ``threshold`` *and* by more than
    ``NOISE_SIGMAS`` times this run's own iteration-to-iteration noise. A run of such iterations
    counts once (a spike is one excursion, however many iterations it lasts); a non-finite loss
    is always one.

    Why the noise term: the paper's fixed 0.5 assumes large batches, whose loss scatters far
    less than that. A small run's does not: the demo model on the demo corpus (prose mixed with
    problems) scatters by about 0.17 from one iteration to the next at 16 x 128 tokens per
    iteration and 0.35 at 1 x 128, where 0.5 is under 1.5 standard deviations and a normal
    100-iteration run warned three times (its losses are in tests/test_diagnostics.py). The
    noise is measured robustly: 1.4826 x the median absolute deviation (the
    standard deviation of Gaussian data) of the last ``NOISE_HISTORY`` excesses over the rolling
    median, spikes left out. Where that noise is small (the paper's setting) the rule is the
    paper's. Warm-up: no spike is declared before the window is full and ``NOISE_MIN`` excesses
    have measured the noise."""

    NOISE_SIGMAS = 6.0
    """A Gaussian excess goes beyond 6 sigma once in 1e9 iterations; mixed-text batches have
    heavier tails than that, and the MAD of 20 values has a standard error of ~25% (4.5 sigma
    when it is one standard error low). A spike of 1.5 x the loss at 0.1 noise is over 10 sigma;
    at the ~0.4 noise of one 128-token sequence per iteration (loss ~4.5) it takes 1.6 x."""
    NOISE_HISTORY = 100
    NOISE_MIN = 20

    def __init__(self, threshold: float = 0.5, window: int = 15):
        self.threshold = threshold
        self.history = deque(maxlen=window)
        self.excesses = deque(maxlen=self.NOISE_HISTORY)
        self.count = 0
        self.in_spike = False
        self.median = self.limit = None  # of the latest iteration, for the warning

    def noise(self) -> Optional[float]:
        """The run's loss noise around its rolling median (robust sigma); None in the warm-up."""
        if len(self.excesses) < self.NOISE_MIN:
            return None
        centre = statistics.median(self.excesses)
        return 1.4826 * statistics.median(abs(e - centre) for e in self.excesses)

    def update(self, loss: float) -> bool:
        """Feed one iteration's loss; True if a new spike starts here."""
        spiking, noise = False, None
        if not math.isfinite(loss):
            spiking = True
        elif len(self.history) == self.history.maxlen:
            self.median = statistics.median(self.history)
            excess = loss - self.median
            noise = self.noise()
            if noise is not None:
                self.limit = max(self.threshold, self.NOISE_SIGMAS * noise)
                spiking = excess > self.limit
            if not spiking:  # a spike is not noise: it stays out of the noise estimate
                self.excesses.append(excess)
        new = spiking and not self.in_spike
        self.count += new
        self.in_spike = spiking
        if math.isfinite(loss):
            self.history.append(loss)
        return new


class GateCollapseMonitor:
    """Exit-gate collapse (Closing the Loop Sec. 3.3, App. B): p0, the probability of exiting after
    the first loop, above ``threshold`` for ``patience`` iterations in a row. The LM loss does not
    show it, so the trainer warns once per episode."""

    def __init__(self, threshold: float = 0.95, patience: int = 100):
        self.threshold, self.patience = threshold, patience
        self.run = 0  # consecutive iterations above the threshold

    def update(self, p0: Optional[float]) -> bool:
        """Feed one iteration's p0; True exactly when a collapse episode reaches ``patience``."""
        if p0 is None or p0 <= self.threshold:
            self.run = 0
            return False
        self.run += 1
        return self.run == self.patience


def _dataset_name(dataset) -> str:
    path = getattr(dataset, "dataset_path", None)
    return path if path else type(dataset).__name__


def describe_samples(dataset, first: int, count: int, limit: int = 4) -> str:
    """Which data the global samples ``[first, first + count)`` of ``dataset`` are (the batch of
    one training iteration: the sample order is a pure function of the seed): samples per dataset
    of a blend, and the documents of the first ``limit`` samples. Reads those samples' document
    indices only (no tokens beyond them)."""
    per_dataset, documents = Counter(), []
    for i in range(first, min(first + count, len(dataset))):
        ds, j = dataset, i
        if hasattr(ds, "dataset_index") and hasattr(ds, "datasets"):  # megatron-core's blend
            ds, j = ds.datasets[int(ds.dataset_index[i])], int(ds.dataset_sample_index[i])
        name = _dataset_name(ds)
        per_dataset[name] += 1
        if len(documents) < limit and hasattr(ds, "_query_document_sample_shuffle_indices"):
            _, ids = tokens_and_documents(ds, j)
            documents.append(f"{os.path.basename(name)}[{j}]: {[int(d) for d in ids]}")
    text = (f"samples {first}..{first + count - 1} of the training stream, from "
            + ", ".join(f"{name} ({n})" for name, n in per_dataset.items()))
    if documents:
        more = " ..." if count > limit else ""
        text += "; documents per sample: " + "; ".join(documents) + more
    return text


def _grad_tensors(model) -> list:
    """The gradients the optimizer will apply: megatron DDP's contiguous buffers (one tensor
    each), else every parameter's ``main_grad`` / ``grad``."""
    # megatron DDP: a list attribute (on a plain nn.Module, `buffers` is a method)
    buffers = getattr(model, "buffers", None)
    if isinstance(buffers, list):
        return [b.grad_data for b in buffers + list(getattr(model, "expert_parallel_buffers", []))]
    grads = (getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None
             else p.grad for p in model.parameters())
    return [g for g in grads if g is not None]


class NonFiniteGuard:
    """--check-for-nan-in-loss-and-grad: skip a step whose loss or gradients hold NaN or
    infinity on any rank, and stop after --max-skipped-steps-in-a-row skipped steps in a row.

    The decision is one all-reduce (MAX) over the world, so every rank skips the same steps: a
    NaN on one data-parallel rank's micro-batch, or in one tensor-parallel shard, skips the
    step everywhere and no rank waits in an optimizer collective the others left out."""

    def __init__(self, enabled: bool, max_in_a_row: int):
        self.enabled, self.max_in_a_row = enabled, max_in_a_row
        self.in_a_row, self.first = 0, None

    def step_is_finite(self, model, loss: float) -> bool:
        """Collective (when enabled): whether the step's loss and every gradient are finite."""
        if not self.enabled:
            return True
        # A tensor holds NaN or infinity exactly when its sum is not finite (NaN and +-inf
        # propagate), save a sum of finite values beyond fp32's range (~3e38), which counts
        # as non-finite too. One reduction per buffer instead of isfinite's three passes.
        bad = not math.isfinite(loss) or any(
            not torch.isfinite(torch.sum(g, dtype=torch.float32)) for g in _grad_tensors(model))
        if torch.distributed.get_world_size() == 1:
            return not bad
        flag = torch.tensor([float(bad)], device=current_device())  # NCCL: device tensors
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return flag.item() == 0

    def record(self, applied: bool, iteration: int) -> Optional[str]:
        """After each iteration: once ``max_in_a_row`` steps in a row were skipped, what happened
        (the trainer adds what is kept and how to resume, and stops the run); else None. The
        same on every rank: the skip decision was collective."""
        if applied:
            self.in_a_row, self.first = 0, None
            return None
        self.in_a_row += 1
        self.first = self.first or iteration
        if self.in_a_row < self.max_in_a_row:
            return None
        return (f"iterations {self.first}..{iteration}: {self.in_a_row} steps in a row were "
                f"skipped (non-finite loss or gradients; --max-skipped-steps-in-a-row "
                f"{self.max_in_a_row}): the run has diverged")


class LoopDiagnostics:
    """What the trainer calls: the four diagnostics above, switched by the logging config."""

    def __init__(self, cfg, model, logger):
        log, self.logger = cfg.logging, logger
        single_stage = cfg.parallel.pipeline_model_parallel_size == 1
        T = cfg.loop.num_loops
        self.step_grads = StepGradNorms(model, T) if log.log_grad_norm_per_step else None
        self.geometry = LoopGeometry(model, T) if log.log_loop_geometry and single_stage else None
        if log.log_loop_geometry and not single_stage:  # on by default: say it, once
            logger.print("> loop geometry (--log-loop-geometry) compares a whole core pass's "
                         "input and output, which no pipeline stage sees: not measured at "
                         "pipeline size > 1")
        self.spikes = LossSpikeCounter(log.loss_spike_threshold, log.loss_spike_window)
        # Only a run with an exit gate can collapse onto step 1 (without one p0 is 1 by definition).
        self.collapse = (GateCollapseMonitor(log.p0_collapse_threshold, log.p0_collapse_iters)
                         if cfg.loop.gated else None)
        self.capturing = False

    def before_step(self, will_log: bool) -> None:
        self.capturing = self.step_grads is not None and will_log
        if self.capturing:
            self.step_grads.start()

    def after_step(self, stats: dict, iteration: int,
                   describe_batch: Optional[Callable[[], str]] = None) -> dict:
        """Feed one iteration's stats; returns the fields for the log record.
        ``describe_batch``: says which data the iteration's batch was (called on a spike only)."""
        out = {}
        if self.capturing:
            out["grad_norm_per_step"] = self.step_grads.finish(stats["tokens"])
            self.capturing = False
        if self.spikes.update(stats["loss"]) and self.logger.is_writer:
            data = ""
            if describe_batch is not None:
                try:
                    data = f"; its batch: {describe_batch()}"
                except Exception as exc:  # a diagnostic must not end the run: say it instead
                    data = f"; its data could not be identified ({type(exc).__name__}: {exc})"
            self.logger.print(f" WARNING: loss spike at iteration {iteration}: "
                              f"{self._spike_reason(stats['loss'])}{data}")
        probs = stats["exit_probs"]
        if self.collapse is not None and self.collapse.update(probs[0] if probs else None):
            self.logger.print(
                f" WARNING: exit-gate collapse: p0 > {self.collapse.threshold} for "
                f"{self.collapse.patience} iterations (at iteration {iteration}); the model trains "
                f"as a one-step transformer and the LM loss does not show it. Closing the Loop "
                f"Sec. 3.3: LR warmup prevents it, a larger --exit-kl-beta lets the gate recover")
        out["loss_spikes"] = self.spikes.count
        # None without a gate: nothing is watched (the log line then omits it).
        out["p0_collapse_iters"] = self.collapse.run if self.collapse is not None else None
        return out

    def _spike_reason(self, loss: float) -> str:
        c = self.spikes
        if not math.isfinite(loss):
            return f"loss {loss}"
        return (f"loss {loss:.4f} is {loss - c.median:.3f} above the median of the previous "
                f"{c.history.maxlen} iterations ({c.median:.4f}), more than {c.limit:.3f} "
                f"(the larger of --loss-spike-threshold {c.threshold} and "
                f"{c.NOISE_SIGMAS:g} x this run's loss noise {c.noise():.3f})")

    def eval_start(self) -> None:
        if self.geometry is not None:
            self.geometry.start()

    def eval_finish(self) -> dict:
        if self.geometry is None:
            return {}
        return self.geometry.finish() or {}
