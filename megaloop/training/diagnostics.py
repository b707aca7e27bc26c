"""Loop diagnostics ("Closing the Loop" (arXiv 2610.00673) App. A/B, "What Makes Recurrence
Effective in Looped Language Models?" (arXiv 2609.36636) App. C.4): what the LM loss does not show.

- ``StepGradNorms``: the gradient norm of every core layer *per loop step* (Closing the Loop Fig.
  6). A shared layer's gradient is the sum of T contributions, one per application; the contribution
  of step t is the gradient with respect to the weights *as used at step t*. While active, every
  core pass runs on fresh views ``w.view_as(w)`` of its parameters (one set per step, through
  ``torch.func.functional_call``, as a loop variant); autograd passes the gradient of each view on to the shared
  parameter unchanged (megatron DDP's accumulation is untouched), and a hook on the view adds it
  to that step's buffer. Costs T x core-parameter fp32 buffers, so the trainer only turns it on
  for the iterations it logs.
- ``LoopGeometry``: on validation batches, per step t, between the core's input and output
  states: angular distance ``arccos(cos(in, out)) / pi``, relative update norm
  ``||out - in|| / ||in||``, and the state variance (over hidden dims) of ``out``, normalised
  by that of the last step (the training horizon). Per-token values averaged over all tokens.
- ``LossSpikeCounter`` and ``GateCollapseMonitor``: the stability counters of Closing the Loop
  (spike = loss more than 0.5 above the rolling median of the previous 15 iterations; collapse = p0
  above 0.95
  for many iterations in a row). A spike's warning names the iteration and the data of its batch
  (``describe_samples``: sample range, dataset of a blend, documents), so a spike that hits every
  run at the same iteration is recognisable as data. The collapse alarm watches only runs with an
  exit gate (a dense run's p0 is 1 by definition).
- ``NonFiniteGuard``: --check-for-nan-in-loss-and-grad, the step-level guard: a step whose loss
  or gradients are not finite on any rank is skipped on every rank, and too many in a row stop the
  run.

The per-step views need the forward not to be re-run in the backward pass (no full activation
recomputation); the geometry compares a whole core pass's input and output, which one stage sees
only at pipeline size 1 (the trainer measures it there).
"""

from __future__ import annotations

import math
import os
import statistics
from collections import Counter, deque
from typing import Callable, Optional

import torch
from megatron.core import parallel_state

from megaloop.device import current_device
from megaloop.model.recurrence import LoopVariant


GEOMETRY_KEYS = ("angular_distance", "relative_update_norm", "state_variance")


def unwrap(model):
    """The LoopedGPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _accumulate_into(buffer: torch.Tensor):
    def hook(grad):
        buffer.add_(grad.float())  # returns None: the gradient flows on unchanged
    return hook


class StepGradNorms(LoopVariant):
    """Per core layer, per loop step: the norm of that step's gradient contribution.

    A loop variant (megaloop/model/recurrence.py), added innermost while capturing: its
    ``around_core`` runs the step's core pass through ``torch.func.functional_call`` with fresh
    views of the core's parameters, so it knows the step from the recurrence (under pipeline
    parallelism: from the virtual chunk) and swaps nothing by hand."""

    def __init__(self, model, num_loops: int):
        self.model = unwrap(model)
        self.core = self.model.core
        self.num_loops = num_loops
        self.layer_params = [list(layer.named_parameters()) for layer in self.core.layers]
        # Global core-layer index of each local layer (megatron-core numbers layers across
        # pipeline stages), so the stages' rows land in one table.
        self.global_index = [layer.layer_number - 1 for layer in self.core.layers]
        self.num_layers = self.core.config.num_layers
        self.buffers = None

    # --- capture ----------------------------------------------------------------------------
    def start(self) -> None:
        """Capture the next forward-backward passes (until ``finish``)."""
        self.buffers = [[{n: torch.zeros_like(p, dtype=torch.float32) for n, p in params}
                         for _ in range(self.num_loops)] for params in self.layer_params]
        self.model.variants.append(self)

    def around_core(self, run, z, attention_mask, rotary_pos_emb, t, ctx):
        if t > self.num_loops:
            raise RuntimeError(f"the core ran loop step {t}; --log-grad-norm-per-step captures "
                               f"{self.num_loops}")
        views = {}
        for i, params in enumerate(self.layer_params):
            for name, p in params:
                if p.requires_grad:
                    view = p.view_as(p)  # its gradient flows on to p unchanged
                    view.register_hook(_accumulate_into(self.buffers[i][t - 1][name]))
                    views[f"layers.{i}.{name}"] = view
        return torch.func.functional_call(
            self.core, views, args=(),
            kwargs={"hidden_states": z, "attention_mask": attention_mask,
                    "rotary_pos_emb": rotary_pos_emb})

    # --- result -----------------------------------------------------------------------------
    def finish(self, num_tokens: int) -> list:
        """Stop capturing; returns norms[layer][step] of the gradient each step contributed,
        reduced and scaled exactly like the main gradient (summed over data-parallel ranks,
        divided by the tokens of the global batch), full-matrix norms under tensor parallelism,
        every core layer of every pipeline stage."""
        self.model.variants.remove(self)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        # Context-parallel ranks hold gradients of their parts of the sequences: summed with DP.
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        # On the accelerator: NCCL reduces GPU tensors only (and the sums stay asynchronous).
        squares = torch.zeros(self.num_layers, self.num_loops, dtype=torch.float64,
                              device=current_device())
        for i, params in enumerate(self.layer_params):
            row = self.global_index[i]
            for t in range(self.num_loops):
                for name, p in params:
                    g = self.buffers[i][t][name]
                    torch.distributed.all_reduce(g, group=dp_group)
                    if getattr(p, "sequence_parallel", False):  # a partial sum per TP rank
                        torch.distributed.all_reduce(g, group=tp_group)
                    if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                        squares[row, t] += g.double().pow(2).sum()
        torch.distributed.all_reduce(squares, group=tp_group)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(squares,
                                         group=parallel_state.get_pipeline_model_parallel_group())
        self.buffers = None
        return (squares.sqrt() / max(num_tokens, 1)).tolist()


class LoopGeometry(LoopVariant):
    """Geometry of the recurrence on validation batches (What Makes Recurrence Effective App. C.4),
    per loop step: a loop variant that, while measuring, compares each core pass's input and
    output (the step index comes from the recurrence)."""

    def __init__(self, model, num_loops: int):
        self.model = unwrap(model)
        self.num_loops = num_loops

    def start(self) -> None:
        # sums over tokens, per step: angular distance, relative update norm, state variance
        # On the accelerator: they are all-reduced (NCCL takes GPU tensors only), and adding
        # GPU sums to them needs no host synchronisation per step.
        self.sums = torch.zeros(3, self.num_loops, dtype=torch.float64, device=current_device())
        self.tokens = torch.zeros(self.num_loops, dtype=torch.float64, device=current_device())
        self.model.variants.append(self)

    def around_core(self, run, z, attention_mask, rotary_pos_emb, t, ctx):
        out = run(z, attention_mask, rotary_pos_emb)
        if t > self.num_loops:  # evaluation at another loop count: ignore the extra
            return out
        u, v = z.detach().float(), out.detach().float()
        cos = torch.nn.functional.cosine_similarity(u, v, dim=-1, eps=1e-12)
        angular = torch.arccos(cos.clamp(-1.0, 1.0)) / math.pi
        update = (v - u).norm(dim=-1) / u.norm(dim=-1).clamp_min(1e-12)
        variance = v.var(dim=-1, unbiased=False)
        self.sums[0, t - 1] += angular.double().sum()
        self.sums[1, t - 1] += update.double().sum()
        self.sums[2, t - 1] += variance.double().sum()
        self.tokens[t - 1] += angular.numel()
        return out

    def finish(self) -> Optional[dict]:
        self.model.variants.remove(self)
        packed = torch.cat([self.sums.flatten(), self.tokens])
        if self.model.config.sequence_parallel:  # each TP rank saw a slice of the tokens
            torch.distributed.all_reduce(packed, group=parallel_state.get_tensor_model_parallel_group())
        # Per-token sums: over data- and context-parallel ranks (each CP rank saw its chunks).
        torch.distributed.all_reduce(
            packed, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        sums = packed[:3 * self.num_loops].view(3, self.num_loops)
        tokens = packed[3 * self.num_loops:]
        if tokens.min().item() == 0:
            return None
        means = sums / tokens
        horizon = means[2, -1].item()
        return {"angular_distance": means[0].tolist(),
                "relative_update_norm": means[1].tolist(),
                "state_variance": (means[2] / horizon if horizon > 0 else means[2]).tolist()}


class LossSpikeCounter:
    """Counts loss spikes (Closing the Loop App. A, Table 6): an iteration whose loss exceeds the
    median of the previous ``window`` iterations by more than ``threshold``. A run of such
    iterations counts once (a spike is one excursion, however many iterations it lasts)."""

    def __init__(self, threshold: float = 0.5, window: int = 15):
        self.threshold = threshold
        self.history = deque(maxlen=window)
        self.count = 0
        self.in_spike = False

    def update(self, loss: float) -> bool:
        """Feed one iteration's loss; True if a new spike starts here."""
        new = False
        if not math.isfinite(loss):
            spiking = True
        elif len(self.history) == self.history.maxlen:
            spiking = loss - statistics.median(self.history) > self.threshold
        else:
            spiking = False
        if spiking and not self.in_spike:
            self.count += 1
            new = True
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
            _, ids = ds._query_document_sample_shuffle_indices(j)
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
        bad = not math.isfinite(loss) or any(not torch.isfinite(g).all()
                                              for g in _grad_tensors(model))
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
            self.logger.print(f" WARNING: loss spike at iteration {iteration}: loss "
                              f"{stats['loss']:.4f} is more than {self.spikes.threshold} above "
                              f"the median of the previous {self.spikes.history.maxlen} "
                              f"iterations{data}")
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

    def eval_start(self) -> None:
        if self.geometry is not None:
            self.geometry.start()

    def eval_finish(self) -> dict:
        if self.geometry is None:
            return {}
        return self.geometry.finish() or {}
