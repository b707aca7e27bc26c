"""LoopedGPTModel: embedding -> prelude -> T x core -> (step norm, coda, gate, head) per step.

Built only from megatron-core parts: a vocab-parallel ``LanguageModelEmbedding``, RoPE, three
``TransformerBlock``s (prelude, core, coda) built from one layer spec, a vocab-parallel
``ColumnParallelLinear`` head and megatron-core's vocab-parallel cross-entropy (per-step logits
are never gathered over the vocabulary). Looping calls the *same* core block T times, so every
tensor-parallel shard and communicator is reused and autograd sums the T gradient contributions.

The recurrence lives in one place, megaloop/model/recurrence.py: ``forward`` is its fold over T
steps, and a pipeline-parallel virtual chunk runs one of its steps. The loop variants (injections,
timestep conditioning, stepwise LoRA, SpiralFormer) are modules listed in ``variants``; each
declares the carry slots it keeps (``carry_slots``). A new variant is one module and one line:
``VARIANTS[name] = build``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock

from megaloop.model.config import LoopConfig, ModelConfig, with_layers
from megaloop.model.conditioning import (NORM_FORMS, SPEC_FORMS, build_timestep_conditioning,
                                         conditioned_spec)
from megaloop.model.loop_step import StepHolder
from megaloop.model.initial_state import build_initial_state
from megaloop.model.injection import build_history_injection, build_injection
from megaloop.model.qk_bias import hold_value_bias_at_zero
from megaloop.model import layer_forward, recurrence, shortcut_objective
from megaloop.model.carry import SIDE, Slot, merge_slots
from megaloop.model.lora import StepwiseLoRA
from megaloop.model.readout import chunked_language_model_loss
from megaloop.model.readout_projection import with_readout_projection
from megaloop.model.sharded_init import shard_only_initialization
from megaloop.model.loss import LoopOutput  # noqa: F401  (the forward's return type)
from megaloop.model.objective import ExitObjective
from megaloop.model.specs import build_norm, layer_spec
from megaloop.model.spiral import build_spiral
from megaloop.model.value_embedding import ValueTokens
from megaloop.model.value_embedding import block_spec as value_block_spec

# Loop variants beyond the built-in ones, by name: ``build(config, loop, first, last)`` returns
# the variant (a megaloop.model.recurrence.LoopVariant, usually a MegatronModule) or None when
# the configuration does not use it; ``first`` / ``last``: whether this pipeline stage starts /
# ends each loop step (where the before_core / after_core hooks run, so where their parameters
# belong). Each is built on every stage, becomes ``model.<name>`` and runs after the built-ins.
VARIANTS: Dict[str, Callable] = {}


class ExitGate(MegatronModule):
    """Per-token halting logit g_t = w . y_t + b, replicated over tensor-parallel ranks."""

    def __init__(self, config):
        super().__init__(config=config)
        self.linear = torch.nn.Linear(config.hidden_size, 1, dtype=config.params_dtype)
        with torch.no_grad():
            # Drawn from the CPU generator, which is seeded identically on every rank, so the
            # replicated gate starts equal on all tensor-parallel ranks.
            weight = torch.empty(1, config.hidden_size, dtype=torch.float32)
            config.init_method(weight)
            self.linear.weight.copy_(weight)
            self.linear.bias.zero_()
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        logit = self.linear(y).squeeze(-1).float()  # [s, b]
        if self.config.sequence_parallel:
            # y holds this rank's slice of tokens; the loss is replicated over TP ranks, so the
            # backward of the gather must split, not sum.
            logit = tensor_parallel.gather_from_sequence_parallel_region(
                logit, tensor_parallel_output_grad=False)
        return logit.transpose(0, 1)  # [b, s], the layout of the per-token losses


class LoopedGPTModel(LanguageModule):
    """A looped decoder-only LM with layout P + K x T + C and a per-token exit gate."""

    # Each rank draws only its shards, the same numbers at any TP degree (sharded_init).
    @shard_only_initialization()
    def __init__(self, config, model_cfg: ModelConfig, loop: LoopConfig, vocab_size: int,
                 use_te: bool = False, pre_process: bool = True, post_process: bool = True):
        super().__init__(config=config)
        self.model_cfg, self.loop = model_cfg, loop
        self.vocab_size = vocab_size
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = not model_cfg.untie_embeddings_and_output_weights
        self.model_type = ModelType.encoder_or_decoder
        self.position_embedding_type = model_cfg.position_embedding_type
        self.input_tensor = None

        num_core = loop.num_core_layers(model_cfg.num_layers)
        # (value embeddings read the normed attention input: TE's fused input norm is unfused)
        unfuse = loop.timestep_conditioning in NORM_FORMS or model_cfg.value_embeddings
        qk_scale_free = model_cfg.qk_layernorm_scale_free
        spec = layer_spec(config, model_cfg.norm_scheme, use_te, unfuse_input_norms=unfuse,
                          qk_scale_free=qk_scale_free)
        # Stepwise LoRA adapters are built with the core's linears (its spec names adapted
        # linear classes); prelude and coda keep the plain spec. A is drawn from a private
        # generator, so the base weights equal those of a model without LoRA built from the
        # same seed.
        self.lora = StepwiseLoRA(
            loop.num_loops, loop.lora_rank, loop.lora_alpha or loop.lora_rank,
            seed=torch.initial_seed() + 1) if loop.lora_rank else None
        core_spec = layer_spec(config, model_cfg.norm_scheme, use_te, unfuse_input_norms=unfuse,
                               lora=self.lora.setup, qk_scale_free=qk_scale_free) \
            if self.lora else spec

        # Branch gating / AdaLN / LoopFormer: gated bias-dropout-adds (and scaled input norms) in
        # the core's spec, reading the step in flight from one clock (megaloop.model.conditioning).
        clock = StepHolder()
        if loop.timestep_conditioning in SPEC_FORMS:
            core_spec = conditioned_spec(core_spec, loop.timestep_conditioning, clock, config)

        # --value-embeddings: the token ids of the forward in flight, for every other layer
        # (megaloop/model/value_embedding.py); layers are numbered prelude, core, coda.
        self.value_tokens = ValueTokens(seed=torch.initial_seed() + 2) \
            if model_cfg.value_embeddings else None
        first_layer = {"prelude": 0, "core": loop.num_prelude_layers,
                       "coda": loop.num_prelude_layers + num_core}
        total_layers = first_layer["coda"] + loop.num_coda_layers

        def block(n: int, final_norm: bool, split: bool = False, spec=spec,
                  part: str = "") -> TransformerBlock:
            # pre_process=True: we always hand the block its input explicitly. Only the core is
            # split over pipeline stages (megatron-core splits a block by its config's pipeline
            # size); prelude and coda live whole on the first and the last stage.
            cfg = with_layers(config, n) if split else dataclasses.replace(
                config, num_layers=n, pipeline_model_parallel_size=1,
                num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None)
            if self.value_tokens is not None:
                spec = value_block_spec(cfg, spec, first_layer[part], total_layers,
                                        self.value_tokens, vocab_size)
            built = TransformerBlock(config=cfg, spec=spec, post_layer_norm=final_norm,
                                     pre_process=True, post_process=True)
            if self.value_tokens is not None:
                built.value_tokens = self.value_tokens  # (layer_forward.call: recomputation)
            return built

        # A pipeline stage builds only its part (GPTModel's pre_process / post_process): embedding,
        # prelude and injection on the first stage; step norm, coda, gate and head on the last.
        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config=config, vocab_size=vocab_size,
                max_sequence_length=model_cfg.max_position_embeddings,
                position_embedding_type=model_cfg.position_embedding_type)
        if model_cfg.position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                kv_channels=config.kv_channels, rotary_percent=model_cfg.rotary_percent,
                rotary_interleaved=config.rotary_interleaved, rotary_base=model_cfg.rotary_base,
                rope_scaling=model_cfg.use_rope_scaling,
                rope_scaling_factor=model_cfg.rope_scaling_factor,
                use_cpu_initialization=config.use_cpu_initialization)
        self.prelude = block(loop.num_prelude_layers, False, part="prelude") \
            if pre_process and loop.num_prelude_layers else None
        self.core = block(num_core, False, split=True, spec=core_spec, part="core")
        self.step_norm = build_norm(config, use_te, loop.step_norm) if post_process else None
        # --readout-projection: the readout reads C step_norm(h) (Parcae's C; the loop goes on
        # from h under --step-norm-placement readout), megaloop/model/readout_projection.py.
        self.step_norm = with_readout_projection(self.step_norm, config, loop)
        # The coda's final norm is the readout norm before gate and head (--share-final-norm:
        # the step norm again, applied by ``readout``).
        self.coda = block(loop.num_coda_layers, not loop.share_final_norm, part="coda") \
            if post_process and loop.num_coda_layers else None
        self.exit_gate = ExitGate(config) if post_process and loop.gated else None
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, vocab_size, config=config, init_method=config.init_method,
            bias=False, skip_bias_add=False, gather_output=False,
            skip_weight_param_allocation=pre_process and self.share_embeddings_and_output_weights
        ) if post_process else None
        self.setup_embeddings_and_output_layer()
        if self.coda is not None and loop.step_norm != "rms" and not loop.share_final_norm \
                and not loop.readout_projection:
            # The coda's final norm is the readout norm before gate and head: --step-norm too
            # (not under --readout-projection: Parcae's coda ends in its own norm, ln_f).
            self.coda.final_layernorm = build_norm(config, use_te, loop.step_norm)
        # Every stage builds every variant (so every stage lays the carry out alike); the
        # injections' parameters live on the first stage, where they run.
        self.injection = build_injection(config, loop, first=pre_process)
        self.history_injection = build_history_injection(config, loop, first=pre_process)
        # Huginn's random initial state (after the injection, which keeps the prelude output).
        self.initial_state = build_initial_state(config, loop, model_cfg.embedding_scale,
                                                 first=pre_process)
        self.timestep = build_timestep_conditioning(config, loop, clock, last=post_process)
        # SpiralFormer per-step resolutions and the Anchor / MeSH topologies (None: plain loop).
        # Under PP a step is down-scaled where it starts and up-scaled where it ends.
        self.spiral = build_spiral(config, loop, first=pre_process, last=post_process)
        # The loop variants, in hook order (megaloop.model.recurrence.LoopVariant): history and
        # input injection feed the core, the spiral down-scales, timestep features and LoRA
        # adapters are selected around the core pass, the spiral up-scales and loop gating mixes
        # after it. A plain list: the modules are registered above under their own names.
        self.variants = [v for v in (self.history_injection, self.injection, self.initial_state,
                                     self.spiral, self.timestep, self.lora) if v is not None]
        for name, build in VARIANTS.items():
            variant = build(config, loop, pre_process, post_process)
            if variant is not None:
                if hasattr(self, name):
                    raise ValueError(f"loop variant {name!r}: the model already has an "
                                     f"attribute of that name; register it under another")
                setattr(self, name, variant)
                self.variants.append(variant)
        if model_cfg.qk_bias and not hold_value_bias_at_zero(self):
            raise ValueError("--qk-bias: the model has no attention QKV bias to hold")

    def carry_slots(self, num_loops: int) -> tuple:
        """What the carry holds when ``num_loops`` loops run: the variants' slots and the exit
        objective's accumulators (megaloop/model/carry.py); the same on every pipeline stage."""
        declared = [slot for variant in self.variants for slot in variant.carry_slots(num_loops)]
        # A step whose LM loss the first stage reads carries its loss weight w_t there
        # (ExitObjective.add_gate; megaloop/model/recurrence.py).
        moved = [Slot("readout_weight", SIDE)] if self.first_stage_readouts_at(num_loops) else []
        return merge_slots(declared + ExitObjective.carry_slots(num_loops, self.loop.exit_loss)
                           + moved)

    first_stage_readouts: tuple = ()
    """Pipeline stages (megaloop/parallel/pipeline.py): loop steps whose LM loss the first stage
    computes, one step later (--pipeline-first-stage-readouts); none on a single stage."""

    def first_stage_readouts_at(self, num_loops: int) -> tuple:
        """Of ``num_loops`` steps, those whose LM loss is read out on the first stage: the
        flag's steps before the last (the last step's loss ends the forward on the last stage;
        random depth draws T per step)."""
        return tuple(t for t in self.first_stage_readouts if t < num_loops)

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline hook (megatron schedules call it); with one stage there is nothing to take."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def readout(self, y, attention_mask, rotary_pos_emb, gate: bool, labels=None,
                inference_context=None):
        """Coda, head and gate on y_t: (vocab-parallel logits [s, b, v/tp] or, with ``labels``,
        the [b, s] LM loss; gate logit or None). --loop-readout chooses how the loss is computed
        (megaloop/model/readout.py); both give the same loss and gradients."""
        r = y
        if self.coda is not None:
            r = layer_forward.call(self.coda, y, attention_mask, rotary_pos_emb,
                                   inference_context)
            if self.loop.share_final_norm:
                r = self.step_norm(r)
        gate_logit = self.exit_gate(r) if gate else None
        return self.lm_head(r, labels), gate_logit

    def head_module(self):
        """The vocab-parallel head module (a pipeline's first stage may have its own)."""
        return self.output_layer

    def lm_head(self, r, labels=None):
        """The LM head on the readout's input r [s, b, h]: vocab-parallel logits, or with
        ``labels`` the [b, s] LM loss (--loop-readout: how; megaloop/model/readout.py)."""
        weight = self.shared_embedding_or_output_weight() if \
            self.share_embeddings_and_output_weights else None
        head = self.head_module()
        if labels is not None and self.loop.loop_readout == "chunked":
            return chunked_language_model_loss(head, r, weight, labels,
                                               self.loop.loop_readout_chunk_tokens)
        logits, _ = head(r, weight=weight)
        if labels is not None:
            # megatron-core's vocab-parallel cross-entropy overwrites the logits in place.
            return self.compute_language_model_loss(labels, logits)
        return logits

    def forward(self, input_ids, position_ids, attention_mask=None, labels=None,
                num_loops: Optional[int] = None, no_grad_steps: int = 0, kv_cache=None,
                short_route: Optional[tuple] = None):
        """With labels: a LoopOutput. Without: the last step's logits [b, s, v/tp].
        ``no_grad_steps``: truncated backpropagation, the first n steps (core and readout) run
        without gradient; their losses still enter the objective's value, as constants.
        ``kv_cache``: a megaloop.inference.kv_cache.LoopKVCache holding the positions before
        ``input_ids`` (cached decoding; the caller advances it). ``short_route``: training
        under --loopformer-objective, the shorter route of this micro-batch (its step sizes;
        megaloop/model/shortcut_objective.py)."""
        if short_route is not None:
            return shortcut_objective.forward(self, input_ids, position_ids, attention_mask,
                                              labels, num_loops or self.loop.num_loops,
                                              no_grad_steps, short_route)
        ctx = recurrence.context(self, input_ids, attention_mask, labels, num_loops, kv_cache)
        carry = recurrence.begin(self, input_ids, position_ids, ctx)
        return recurrence.fold(self, carry, ctx, no_grad_steps=no_grad_steps)


def build_model(model_cfg: ModelConfig, loop: LoopConfig, vocab_size: int, *, tp_size: int = 1,
                sequence_parallel: bool = False, bf16: bool = False, fp16: bool = False,
                recompute: Optional[dict] = None) -> LoopedGPTModel:
    """Build the model for the current rank (parallel state must be initialised). ``fp16``:
    inference only (the trainer refuses --fp16)."""
    from megaloop.model.config import padded_vocab_size, transformer_config, use_transformer_engine

    config = transformer_config(model_cfg, model_cfg.num_layers, tp_size=tp_size,
                                sequence_parallel=sequence_parallel, bf16=bf16, fp16=fp16,
                                recompute=recompute)
    padded = padded_vocab_size(vocab_size, model_cfg.make_vocab_size_divisible_by, tp_size)
    return LoopedGPTModel(config, model_cfg, loop, padded, use_te=use_transformer_engine(model_cfg))
