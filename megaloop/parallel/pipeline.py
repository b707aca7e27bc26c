"""Pipeline parallelism for looped models: the loop travels the pipeline ring.

The core's K layers are split over the P pipeline stages (megatron-core splits the core block by
its config's pipeline size, uneven rules included); the embedding, prelude and injection sit on
the first stage, the step norm, coda, exit gate and LM head on the last. One loop step is one
*virtual pipeline chunk*: megatron-core's interleaved 1F1B schedule with V = T chunks per stage
sends each micro-batch round the ring T times. All T chunks of a stage run the same layers:

- chunk 0 is the stage's ``PipelineStage`` itself, the only module that registers (and so owns)
  the stage's parameters; it alone is wrapped in DDP, given to the optimizer and to
  ``finalize_model_grads``. Chunks 1..T-1 are ``LoopStep`` views holding an unregistered
  reference to it. Wrapping every chunk would count the grad norm T times and apply the update
  T times.
- A chunk runs one step of the recurrence (megaloop/model/recurrence.py) on this stage's part of
  the model. What a step needs from the steps before it is the loop's ``Carry``, which travels
  with the activation as one tensor of a fixed shape (``CarryLayout``, megaloop/model/carry.py):
  the state and the slots the model's variants and its exit objective declare for this T.
- Random depth changes T (so V) from one call to the next; truncated backpropagation runs a
  chunk's step without gradient and keeps the schedule's backward path with a zero gradient.
- The schedule calls its loss function on the last chunk only. The objective share of every
  earlier step (computed on the last stage, where gate and head live) is attached to the
  activation leaving that chunk by ``_AttachLoss``, an autograd function that feeds the share
  the loss's backward scale (the trick megatron-core uses for MoE auxiliary losses), and the
  share's statistics are reported next to the schedule's own. The shares of the T steps add up
  to the single-stage objective (``ExitObjective.resume``), so P = 2 trains and logs like P = 1.

T = 1 (dense twins) runs megatron-core's non-interleaved 1F1B schedule with the same module.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import re
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import MegatronModule

from megaloop.model import recurrence
from megaloop.model.carry import CarryLayout
from megaloop.model.looped_gpt import LoopedGPTModel
from megaloop.model.loss import LoopOutput, loss_func


class _AttachLoss(torch.autograd.Function):
    """Identity on the activation whose backward also starts the backward of ``loss``, with the
    gradient the schedule gives its own loss (1, or the fp16 loss scale)."""

    @staticmethod
    def forward(ctx, activation, loss, config):
        ctx.config = config
        ctx.save_for_backward(loss)
        return activation

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        scale = torch.ones_like(loss)
        if ctx.config.grad_scale_func is not None:
            scale = ctx.config.grad_scale_func(scale)
        return grad, scale, None


# --- the modules ----------------------------------------------------------------------------
@dataclass
class StepResult:
    """What a chunk returns: the tensor for the next stage (None after the final step) and, on
    the last stage, the objective share and statistics of the step it read out."""

    payload: Optional[torch.Tensor]
    share: Optional[LoopOutput]


class PipelineStage(LoopedGPTModel):
    """This rank's part of the looped model; as a module it is chunk 0 (loop step 1).

    ``first_stage_readouts`` (--pipeline-first-stage-readouts): the first stage computes the LM
    loss of these steps (recurrence.StepContext.first_stage_readouts) with the tied
    embedding as its head, through a head module of its own that holds no weight."""

    def __init__(self, *args, first_stage_readouts: tuple = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.first_stage_readouts = first_stage_readouts
        if first_stage_readouts and self.pre_process and not self.post_process:
            if not self.share_embeddings_and_output_weights:
                raise ValueError("--pipeline-first-stage-readouts needs the LM head tied to the "
                                 "embedding (drop --untie-embeddings-and-output-weights)")
            head = tensor_parallel.ColumnParallelLinear(
                self.config.hidden_size, self.vocab_size, config=self.config,
                init_method=self.config.init_method, bias=False, skip_bias_add=False,
                gather_output=False, skip_weight_param_allocation=True)
            # Not registered as a sub-module: it owns no weight, and as `output_layer` it would
            # add a second `output_layer._extra_state` to the checkpoint (the last stage's).
            self._first_stage_head = (head,)
            # The embedding and the head now both add to the tied weight's gradient on this
            # stage: megatron-core's rule for two users on one stage (with fused gradient
            # accumulation the head must hand autograd a zero, not an empty, weight gradient).
            self.shared_embedding_or_output_weight().zero_out_wgrad = True

    def head_module(self):
        return self.output_layer if self.post_process else self._first_stage_head[0]

    def forward(self, input_ids, position_ids, attention_mask=None, labels=None,
                num_loops: Optional[int] = None, no_grad_steps: int = 0) -> StepResult:
        return self.step_forward(1, self.input_tensor, input_ids, position_ids, attention_mask,
                                 labels, num_loops, no_grad_steps)

    def carry_layout(self, batch: int, seq: int, num_loops: int) -> CarryLayout:
        """The p2p layout of the carry for ``num_loops`` loops (the same on every stage).
        ``seq``: this rank's tokens of a sequence (--seq-length / CP under context parallelism:
        its two chunks; the exit objective is per token, so its accumulators are too)."""
        sp = self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1
        return CarryLayout(
            self.carry_slots(num_loops), seq_local=seq // sp, seq_full=seq,
            hidden_size=self.config.hidden_size, dtype=self.config.pipeline_dtype, sp_size=sp)

    def step_forward(self, t: int, input_tensor, input_ids, position_ids, attention_mask,
                     labels, num_loops: Optional[int], no_grad_steps: int = 0) -> StepResult:
        """Loop step t (1-based) of one micro-batch on this stage: unpack the carry, run the
        recurrence's step, pack the carry for the next stage."""
        if labels is None:
            raise ValueError("a pipeline-parallel forward needs labels (training/evaluation)")
        ctx = recurrence.context(self, input_ids, attention_mask, labels, num_loops)
        T = ctx.num_loops
        ctx.first_stage_readouts = self.first_stage_readouts_at(T)
        ctx.no_grad_steps = no_grad_steps
        layout = self.carry_layout(input_ids.size(0), input_ids.size(1), T)
        grad = torch.is_grad_enabled() and t > no_grad_steps
        if self.pre_process and t == 1:
            # Embedding and prelude keep their gradient under truncation: the injection source
            # reaches later steps (as in the single-stage fold, where they run outside the steps).
            carry = recurrence.begin(self, input_ids, position_ids, ctx)
        else:
            carry = layout.unpack(input_tensor)
        with torch.set_grad_enabled(grad):
            carry, out = recurrence.step(self, carry, t, ctx)
        final = self.post_process and t == T
        payload = None if final else layout.pack(carry)
        if payload is not None and torch.is_grad_enabled() and not payload.requires_grad:
            # A step run without gradient (truncation), or a stage with nothing to train
            # (adaptive-gate training freezes the LM).
            payload = _keep_backward_path(payload, input_tensor)
        if out.share is None and out.earlier is None:
            return StepResult(payload, None)
        # Statistics of what this chunk read out only (its step, or on the first stage the step
        # before), laid out like the single-stage LoopOutput (zeros for the other steps, so the
        # reports of all chunks sum to it; NaN where `last` reads nothing).
        step_losses = torch.zeros((T,) + tuple(labels.shape), dtype=torch.float32,
                                  device=labels.device)
        if ctx.mode == "last":
            step_losses[:t - 1] = float("nan")
        probs, shares = None, []
        if out.share is not None:
            shares.append(out.share)
            if out.loss is not None:  # (None: its LM loss is read out on the first stage)
                step_losses[t - 1] = out.loss
            if out.exit_prob is not None:
                probs = torch.zeros_like(step_losses)
                probs[t - 1] = out.exit_prob
        if out.earlier is not None:
            shares.append(out.earlier.share)
            step_losses[t - 2] = out.earlier.loss
            if probs is None:  # (a model that defers has a gate; the last stage reports it)
                probs = torch.zeros_like(step_losses)
        share = shares[0] if len(shares) == 1 else shares[0] + shares[1]
        return StepResult(payload, LoopOutput(share, step_losses, probs))


class _KeepBackwardPath(torch.autograd.Function):
    """Identity on a payload without gradient that keeps the schedule's backward well formed: the
    schedule runs a backward through every chunk and sends its input gradient upstream, so the
    payload must require grad and the chunk's input must receive a gradient (zero)."""

    @staticmethod
    def forward(ctx, payload, input_tensor):
        ctx.input_shape = None if input_tensor is None else input_tensor.shape
        return payload.clone()

    @staticmethod
    def backward(ctx, grad):
        zero = None if ctx.input_shape is None else grad.new_zeros(ctx.input_shape)
        return None, zero


def _keep_backward_path(payload, input_tensor):
    if input_tensor is None:  # the first stage at step 1: a leaf the backward can end at
        return payload.detach().requires_grad_()
    return _KeepBackwardPath.apply(payload, input_tensor)


class LoopStep(MegatronModule):
    """Chunk t (loop step t >= 2) of a stage: runs the stage's layers, owns no parameters."""

    def __init__(self, stage: PipelineStage, step: int):
        super().__init__(config=stage.config)
        # A tuple keeps the stage out of this module's children: no parameter is registered
        # twice, so nothing that walks the chunks (DDP, optimizer, grad norm) sees it again.
        self._stage = (stage,)
        self.step = step
        self.model_type = stage.model_type
        self.pre_process, self.post_process = stage.pre_process, stage.post_process
        self.share_embeddings_and_output_weights = stage.share_embeddings_and_output_weights
        self.input_tensor = None

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def forward(self, input_ids, position_ids, attention_mask=None, labels=None,
                num_loops: Optional[int] = None, no_grad_steps: int = 0) -> StepResult:
        return self._stage[0].step_forward(self.step, self.input_tensor, input_ids, position_ids,
                                           attention_mask, labels, num_loops, no_grad_steps)


# --- building -------------------------------------------------------------------------------
def build_pipeline_stage(cfg, vocab_size: int) -> PipelineStage:
    """This rank's stage, with the weights a single-stage model built from the same seed has."""
    from megaloop.model.config import padded_vocab_size, transformer_config, use_transformer_engine
    from megaloop.model.looped_gpt import build_model

    m, loop, par = cfg.model, cfg.loop, cfg.parallel
    recompute = cfg.recompute.transformer_kwargs()
    tp, bf16 = par.tensor_model_parallel_size, cfg.training.bf16
    base = transformer_config(m, m.num_layers, tp_size=tp, sequence_parallel=par.sequence_parallel,
                              bf16=bf16, recompute=recompute)
    config = dataclasses.replace(
        base, num_layers=loop.num_core_layers(m.num_layers),
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=par.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=par.decoder_last_pipeline_num_layers,
        # megatron-core's default group (depth-first interleaving); `replace` would otherwise keep
        # the single-stage value derived from pipeline size 1.
        microbatch_group_size_per_vp_stage=par.pipeline_model_parallel_size)
    padded = padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, tp)

    def stage():
        return PipelineStage(config, m, loop, padded, use_te=use_transformer_engine(m),
                             pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
                             post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
                             first_stage_readouts=par.first_stage_readout_steps() or ())

    if not config.use_cpu_initialization:
        return stage()  # on GPU each rank draws its own weights, as Megatron-LM does
    # CPU initialisation draws every full weight from one generator seeded alike on all ranks, so
    # what a layer gets depends on everything built before it. Building the single-stage model
    # and keeping this stage's part makes the initial weights independent of the pipeline size,
    # as they already are of the TP size (and a P = 2 run starts where the P = 1 run starts).
    full = build_model(m, loop, vocab_size, tp_size=tp, sequence_parallel=par.sequence_parallel,
                       bf16=bf16, recompute=recompute)
    with torch.random.fork_rng(devices=[]):
        part = stage()
    part.load_state_dict(_stage_state(part, full.state_dict()), strict=True)
    return part


def _stage_state(part: PipelineStage, full: dict) -> dict:
    """The single-stage model's tensors under this stage's names (core layers by global index)."""
    out = {}
    for name in part.state_dict():
        key = name
        m = re.match(r"core\.layers\.(\d+)\.(.*)", name)
        if m:
            global_index = part.core.layers[int(m.group(1))].layer_number - 1
            key = f"core.layers.{global_index}.{m.group(2)}"
        elif name == "output_layer.weight" and part.share_embeddings_and_output_weights:
            key = "embedding.word_embeddings.weight"  # the last stage's copy of the tied weight
        out[name] = full[key]
    return out


def schedule_config(model_config):
    """The config the schedule reads: a copy of the stage's (set per run in ``LoopPipeline``)."""
    return copy.copy(model_config)


# --- running a global batch -----------------------------------------------------------------
class LoopPipeline:
    """Runs micro-batches through the pipeline schedule with one chunk per loop step."""

    def __init__(self, model, config, loop):
        self.model, self.config, self.loop = model, config, loop
        self.stage = model
        while not isinstance(self.stage, PipelineStage):
            self.stage = self.stage.module
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        # Only the owner's gradients are finalized (DP reduction, tied-embedding all-reduce,
        # division by the token count); the schedule passes its list of chunks, which would
        # also hand it the parameter-less views.
        config.finalize_model_grads_func = partial(_finalize_owner, model)
        self._views = {}

    def chunks(self, num_loops: int) -> list:
        if num_loops not in self._views:
            self._views[num_loops] = [LoopStep(self.stage, t) for t in range(2, num_loops + 1)]
        return [self.model] + self._views[num_loops]

    def run(self, data_iterator, num_microbatches: int, seq_length: int, micro_batch_size: int,
            forward_only: bool, num_loops: Optional[int] = None, no_grad_steps: int = 0) -> list:
        """The per-micro-batch reports (schedule's and auxiliary) of this rank."""
        T = num_loops or self.loop.num_loops
        interleaved = T > 1
        config = self.config
        # The interleaved schedule reads V from the config; changing T between calls is fine.
        config.virtual_pipeline_model_parallel_size = T if interleaved else None
        # p2p: gloo pairs messages between two ranks by posting order. With P = 2 a stage's
        # previous and next rank are the same rank, and the batched path (one batch of
        # isend/irecv in both directions) hands a forward activation to the gradient's irecv:
        # the loss is silently wrong, with no error. The unbatched path sends the two directions
        # over different communicators. NCCL keeps Megatron-LM's defaults: batched for the
        # non-interleaved schedule, unbatched for the interleaved one.
        backend = torch.distributed.get_backend(parallel_state.get_pipeline_model_parallel_group())
        config.batch_p2p_comm = backend == "nccl" and not interleaved
        config.overlap_p2p_comm = False
        # Under context parallelism a rank holds seq / CP tokens of each sequence (its two
        # chunks) and the carry, per-token accumulators included, is that rank's part; the
        # schedule divides the length it is told by CP, so it is told CP times the carry's.
        cp = parallel_state.get_context_parallel_world_size()
        layout = self.stage.carry_layout(micro_batch_size, seq_length // cp, T)
        reports = []
        iterators = list(itertools.tee(data_iterator, T)) if interleaved else data_iterator
        schedule = get_forward_backward_func(pp_size=self.pp_size, vp_size=T if interleaved else None)
        out = schedule(forward_step_func=partial(forward_step, num_loops=T, reports=reports,
                                                 config=config, no_grad_steps=no_grad_steps),
                       data_iterator=iterators, model=self.chunks(T),
                       num_microbatches=num_microbatches, seq_length=layout.seq_length * cp,
                       micro_batch_size=micro_batch_size, forward_only=forward_only)
        return list(out) + reports


def _finalize_owner(owner, _chunks, num_tokens=None, **kwargs):
    finalize_model_grads([owner], num_tokens, **kwargs)


def forward_step(data_iterator, model, num_loops: int, reports: list, config,
                 no_grad_steps: int = 0):
    """One chunk of one micro-batch (every stage reads the batch; each uses what it needs)."""
    batch = next(data_iterator)
    result = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                   labels=batch["labels"], num_loops=num_loops, no_grad_steps=no_grad_steps)
    final_loss = partial(loss_func, batch["loss_mask"], num_loops)
    if result.payload is None:  # the final step on the last stage: the schedule's loss
        return result.share, final_loss
    payload = result.payload
    if result.share is not None:  # an earlier step read out on the last stage
        # The final step's report counts the micro-batch's tokens.
        total, _, report = loss_func(batch["loss_mask"], num_loops, result.share,
                                     count_tokens=False)
        reports.append(report)
        payload = _AttachLoss.apply(payload, total, config)
    return payload, final_loss
