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
  T times (DESIGN.md).
- What a step needs from the steps before it travels with the activation as one tensor (the
  ``Ring`` layout): the recurrent state, the injection source when injection is on, and the
  per-token running log-survival of the exit distribution; with SpiralFormer also Anchor's h_0
  or MeSH's entering state and slots (a coarse step's latents travel zero-padded to length L).
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
import math
import re
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import MegatronModule

from megaloop.model import spiral
from megaloop.model.looped_gpt import LoopedGPTModel, LoopOutput
from megaloop.model.objective import ExitObjective


# --- what travels between stages ------------------------------------------------------------
class _PackRing(torch.autograd.Function):
    """[state; source; side bits] along the sequence axis, in the pipeline dtype.

    The side tensor is fp32 (log-survival near 0 must not be rounded to bf16) and travels as its
    raw bits reinterpreted in the pipeline dtype, so it arrives exact whatever that dtype is. Its
    gradient takes the same way back; one function owns both directions, so those bits are only
    ever copied, never added to (a sum of bit patterns would be garbage)."""

    @staticmethod
    def forward(ctx, side, rows, *hiddens):
        b, n = side.shape
        ctx.n, ctx.hidden_rows = n, [h.shape[0] for h in hiddens]
        bits = side.contiguous().view(hiddens[0].dtype)  # [b, n * 4 / itemsize]
        width = rows * hiddens[0].shape[-1]
        block = torch.nn.functional.pad(bits, (0, width - bits.shape[1]))
        block = block.view(b, rows, -1).transpose(0, 1)
        return torch.cat([*hiddens, block], 0)

    @staticmethod
    def backward(ctx, grad):
        pieces = grad.split(ctx.hidden_rows + [grad.shape[0] - sum(ctx.hidden_rows)], 0)
        block = pieces[-1]
        b = block.shape[1]
        ratio = 4 // grad.element_size()
        bits = block.transpose(0, 1).reshape(b, -1)[:, :ctx.n * ratio].contiguous()
        return (bits.view(torch.float32), None, *pieces[:-1])


class _UnpackRing(torch.autograd.Function):
    """The inverse of ``_PackRing`` on the receiving stage (and of its gradient)."""

    @staticmethod
    def forward(ctx, payload, hidden_rows, n):
        ctx.hidden_rows, ctx.n, ctx.shape, ctx.dtype = hidden_rows, n, payload.shape, payload.dtype
        ctx.device = payload.device
        pieces = payload.split(hidden_rows + [payload.shape[0] - sum(hidden_rows)], 0)
        block = pieces[-1]
        b = block.shape[1]
        ratio = 4 // payload.element_size()
        side = block.transpose(0, 1).reshape(b, -1)[:, :n * ratio].contiguous()
        return (side.view(torch.float32), *[p.clone() for p in pieces[:-1]])

    @staticmethod
    def backward(ctx, grad_side, *grad_hiddens):
        rows_total, b, width = ctx.shape
        dtype = ctx.dtype
        grad_hiddens = [torch.zeros(r, b, width, dtype=dtype, device=ctx.device) if g is None
                        else g
                        for g, r in zip(grad_hiddens, ctx.hidden_rows)]
        if grad_side is None:
            grad_side = torch.zeros(b, ctx.n, dtype=torch.float32, device=ctx.device)
        bits = grad_side.contiguous().view(dtype)
        rows = rows_total - sum(ctx.hidden_rows)
        block = torch.nn.functional.pad(bits, (0, rows * width - bits.shape[1]))
        block = block.view(b, rows, width).transpose(0, 1)
        return torch.cat([*grad_hiddens, block], 0), None, None


@dataclass
class Ring:
    """Layout of the one tensor a loop step hands to the next stage: ``num_hidden`` blocks of
    [s_local, b, h] (the recurrent state, then the injection source) followed by ``side_rows``
    rows that hold the [b, s] fp32 log-survival bit for bit. The schedule allocates receive
    buffers of [seq_length, b, h] (divided by TP under sequence parallelism), so ``seq_length``
    is what the schedule is told."""

    num_hidden: int
    seq_local: int
    seq_full: int
    hidden_size: int
    dtype: torch.dtype
    carries_survival: bool
    sp_size: int = 1

    @property
    def side_rows(self) -> int:
        if not self.carries_survival:
            return 0
        per_value = 32 // torch.finfo(self.dtype).bits  # pipeline-dtype elements per fp32
        return math.ceil(self.seq_full * per_value / self.hidden_size)

    @property
    def seq_length(self) -> int:
        return (self.num_hidden * self.seq_local + self.side_rows) * self.sp_size

    def pack(self, hiddens: list, log_survival: Optional[torch.Tensor]) -> torch.Tensor:
        hiddens = [h.to(self.dtype) for h in hiddens]
        if not self.carries_survival:
            return torch.cat(hiddens, 0) if len(hiddens) > 1 else hiddens[0]
        return _PackRing.apply(log_survival.float(), self.side_rows, *hiddens)

    def unpack(self, payload: torch.Tensor):
        """(list of hidden blocks, log-survival or None)."""
        rows = [self.seq_local] * self.num_hidden
        if not self.carries_survival:
            return list(payload.split(rows, 0)), None
        side, *hiddens = _UnpackRing.apply(payload, rows, self.seq_full)
        return hiddens, side


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
    """This rank's part of the looped model; as a module it is chunk 0 (loop step 1)."""

    def forward(self, input_ids, position_ids, attention_mask=None, labels=None,
                num_loops: Optional[int] = None) -> StepResult:
        return self.step_forward(1, self.input_tensor, input_ids, position_ids, attention_mask,
                                 labels, num_loops)

    def ring(self, batch: int, seq: int, num_loops: int) -> Ring:
        sp = self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1
        injection = self.loop.input_injection != "none"
        # Anchor's h_0 / MeSH's entering state and slots are needed by the last stage of every
        # step, so they travel even at T = 1.
        carried = self.spiral.num_carried() if self.spiral is not None else 0
        return Ring(num_hidden=(2 if injection and num_loops > 1 else 1) + carried,
                    seq_local=seq // sp,
                    seq_full=seq, hidden_size=self.config.hidden_size,
                    dtype=self.config.pipeline_dtype, sp_size=sp,
                    carries_survival=_mode(self.loop, num_loops) != "last" and num_loops > 1)

    def step_forward(self, t: int, input_tensor, input_ids, position_ids, attention_mask,
                     labels, num_loops: Optional[int]) -> StepResult:
        """Loop step t (1-based) of one micro-batch on this stage."""
        T = num_loops or self.loop.num_loops
        mode = _mode(self.loop, T)
        if mode != "last" and T > 1 and not self.loop.gated:
            raise ValueError(f"running {T} loops needs an exit gate, but this model was built "
                             f"with --num-loops {self.loop.num_loops} and --exit-loss "
                             f"{self.loop.exit_loss} (no gate); use --exit-loss last")
        if labels is None:
            raise ValueError("a pipeline-parallel forward needs labels (training/evaluation)")
        ring = self.ring(input_ids.size(0), input_ids.size(1), T)
        rope = None
        if self.position_embedding_type == "rope":
            rope = self.rotary_pos_emb(input_ids.size(1))
        state = None  # SpiralFormer: Anchor's h_0 or MeSH's slots (spiral.LoopState)
        num_state = self.spiral.num_carried() if self.spiral is not None else 0
        has_source = ring.num_hidden - num_state > 1
        if self.pre_process and t == 1:
            h, source = self._embed(input_ids, position_ids, attention_mask, rope)
            if self.spiral is not None:
                h, state = self.spiral.begin(h)
            log_survival = torch.zeros(input_ids.shape, dtype=torch.float32,
                                       device=h.device) if ring.carries_survival else None
        else:
            hiddens, log_survival = ring.unpack(input_tensor)
            h, source = hiddens[0], (hiddens[1] if has_source else None)
            if self.spiral is not None:
                state = spiral.LoopState.from_carried(self.spiral.topology,
                                                      hiddens[ring.num_hidden - num_state:])
        length = input_ids.size(1)
        latents = None if self.spiral is None else self.spiral.latent_length(length, t)
        if latents is not None and not self.pre_process:
            # Inside a split core a coarse step's activation is L_t latents, sent zero-padded at
            # the end to the one p2p length L; the pad is cut off before any layer sees it.
            h = h[:latents]
        h, y = self._core_step(h, attention_mask, rope, t, source, num_loops=T, state=state,
                               length=length)
        if latents is not None and not self.post_process:
            h = torch.nn.functional.pad(h, (0, 0, 0, 0, 0, length - h.size(0)))
        carried = [h] + ([source] if has_source else [])
        if state is not None:
            carried += state.carried()
        if not self.post_process or (mode == "last" and t < T):
            return StepResult(ring.pack(carried, log_survival), None)

        gate = ring.carries_survival and t < T
        logits, gate_logit = self._readout(y, attention_mask, rope, gate)
        loss = self.compute_language_model_loss(labels, logits)
        objective = ExitObjective.resume(T, mode, self.loop.exit_kl_beta,
                                         self.loop.exit_loss_smoothing, steps_done=t - 1,
                                         log_survival=log_survival)
        objective.add_step(loss, gate_logit)
        # Statistics of this step only, laid out like the single-stage LoopOutput (zeros for the
        # other steps, so the reports of all steps sum to it; NaN where `last` reads nothing).
        step_losses = torch.zeros((T,) + tuple(labels.shape), dtype=torch.float32,
                                  device=loss.device)
        if mode == "last":
            step_losses[:t - 1] = float("nan")
        step_losses[t - 1] = loss.detach()
        probs = None
        if objective.exit_probs:
            probs = torch.zeros_like(step_losses)
            probs[t - 1] = objective.exit_probs[-1]
        share = LoopOutput(objective.share(), step_losses, probs)
        if t == T:
            return StepResult(None, share)
        return StepResult(ring.pack(carried, objective.log_survival), share)


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
                num_loops: Optional[int] = None) -> StepResult:
        return self._stage[0].step_forward(self.step, self.input_tensor, input_ids, position_ids,
                                           attention_mask, labels, num_loops)


def _mode(loop, num_loops: int) -> str:
    return loop.exit_loss if num_loops > 1 else "expected"


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
                             post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True))

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
            forward_only: bool, num_loops: Optional[int] = None) -> list:
        """The per-micro-batch reports (schedule's and auxiliary) of this rank."""
        T = num_loops or self.loop.num_loops
        interleaved = T > 1
        config = self.config
        # The interleaved schedule reads V from the config; changing T between calls is fine.
        config.virtual_pipeline_model_parallel_size = T if interleaved else None
        # p2p: gloo pairs messages between two ranks by posting order. With P = 2 a stage's
        # previous and next rank are the same rank, and the batched path (one batch of
        # isend/irecv in both directions) hands a forward activation to the gradient's irecv:
        # the loss is silently wrong (DESIGN.md). The unbatched path sends the two directions
        # over different communicators. NCCL keeps Megatron-LM's defaults: batched for the
        # non-interleaved schedule, unbatched for the interleaved one.
        backend = torch.distributed.get_backend(parallel_state.get_pipeline_model_parallel_group())
        config.batch_p2p_comm = backend == "nccl" and not interleaved
        config.overlap_p2p_comm = False
        ring = self.stage.ring(micro_batch_size, seq_length, T)
        reports = []
        iterators = list(itertools.tee(data_iterator, T)) if interleaved else data_iterator
        schedule = get_forward_backward_func(pp_size=self.pp_size, vp_size=T if interleaved else None)
        out = schedule(forward_step_func=partial(forward_step, num_loops=T, reports=reports,
                                                 config=config),
                       data_iterator=iterators, model=self.chunks(T),
                       num_microbatches=num_microbatches, seq_length=ring.seq_length,
                       micro_batch_size=micro_batch_size, forward_only=forward_only)
        return list(out) + reports


def _finalize_owner(owner, _chunks, num_tokens=None, **kwargs):
    finalize_model_grads([owner], num_tokens, **kwargs)


def forward_step(data_iterator, model, num_loops: int, reports: list, config):
    """One chunk of one micro-batch (every stage reads the batch; each uses what it needs)."""
    from megaloop.training.trainer import loss_func

    batch = next(data_iterator)
    result = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                   labels=batch["labels"], num_loops=num_loops)
    final_loss = partial(loss_func, batch["loss_mask"], num_loops)
    if result.payload is None:  # the final step on the last stage: the schedule's loss
        return result.share, final_loss
    payload = result.payload
    if result.share is not None:  # an earlier step read out on the last stage
        total, _, report = loss_func(batch["loss_mask"], num_loops, result.share)
        report["stats"][1] = 0  # the final step counts the tokens
        reports.append(report)
        payload = _AttachLoss.apply(payload, total, config)
    return payload, final_loss
