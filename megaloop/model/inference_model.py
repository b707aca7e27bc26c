"""A LoopedGPTModel built for inference (generation, serving, evaluation, lm-eval) in fp32, bf16 or
fp16: megaloop.inference.loading builds checkpoints with it, megaloop.convert.hf_import's
``load_exported`` exported folders. Which precision is the caller's choice
(megaloop/inference/precision.py)."""

from __future__ import annotations

import dataclasses

from megaloop.model.config import LoopConfig, ModelConfig

PRECISIONS = ("fp32", "bf16", "fp16")


def inference_model_config(model_cfg: ModelConfig) -> ModelConfig:
    """``model_cfg`` with megatron-core's masked-softmax fusion off.

    With bf16/fp16 inputs on a GPU, megatron-core's FusedScaleMaskSoftmax
    (megatron/core/fusions/fused_softmax.py) runs apex's fused kernel whenever the shapes fit
    (16 < sk <= 4096, sq and sk multiples of 4, ...). For the causal mask type the layer spec
    builds, that kernel is ScaledUpperTriangMaskedSoftmax: it asserts sq == sk and applies the
    causal triangle only, ignoring any mask passed. Cached decoding breaks both: the batching
    engine forwards a second prompt chunk (sq new tokens against sk = cached + sq keys) and a
    speculation verify of k + 1 tokens against the whole cache (sq != sk: the assertion fails),
    and its padded layouts pass a padding mask (with sq == sk the kernel would silently attend
    to padding). Off, the same softmax runs in PyTorch, in fp32 (attention_softmax_in_fp32),
    with the mask applied. An fp32 model never takes the kernel, so this changes nothing there.
    """
    return dataclasses.replace(model_cfg, no_masked_softmax_fusion=True)


def build_inference_model(model_cfg: ModelConfig, loop: LoopConfig, vocab_size: int, *,
                          tp_size: int = 1, precision: str = "fp32"):
    """The LoopedGPTModel for this rank (parallel state initialised), its weights not yet
    loaded, held in ``precision`` (one of PRECISIONS) with ``inference_model_config``'s
    settings. Load the weights into it afterwards: a copy into a 16-bit parameter rounds as
    the cast of a loaded fp32 model would."""
    from megatron.core.transformer.module import Float16Module

    from megaloop.model.looped_gpt import build_model

    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    model_cfg = inference_model_config(model_cfg)
    # The TransformerConfig must say the precision before the layers are built: the attention's
    # softmax reads it at construction (input_in_bf16/fp16: softmax in fp32).
    model = build_model(model_cfg, loop, vocab_size, tp_size=tp_size,
                        bf16=precision == "bf16", fp16=precision == "fp16")
    if precision != "fp32":
        # Cast as an RL run with --bf16 casts its policy and reference (megaloop/rl/trainer.py,
        # megaloop/training/trainer.py): megatron-core's Float16Module casts every weight, the
        # local layers' norm weights and the exit gate included, which the bf16 config alone
        # leaves fp32. So a checkpoint served, evaluated or generated from computes what its RL
        # rollouts computed (they decode with the policy's unwrapped module through the same
        # engine), not a mix of bf16 matmuls and fp32 norms. The wrapper's own forward (casting
        # inputs, fp32 outputs) is not kept: the engine and the recurrence call the module's
        # methods directly, as rollouts do, and take their logits in fp32 (``.float()``).
        model = Float16Module(model.config, model).module
    return model
