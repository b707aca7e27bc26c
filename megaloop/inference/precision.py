"""The precision a model is held in for generation, serving, evaluation and lm-eval: the flags
(``PrecisionConfig``, Megatron-LM's ``--bf16`` / ``--fp16`` and ``--fp32``), the default when none
is given (``trained_precision``, ``resolve_precision``) and its one-line announcement. The model
itself is built by ``megaloop.model.inference_model.build_inference_model``.

Standard library only at import: the tools' ``--help`` reads this module before torch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from typing import Callable, Optional

from megaloop.inference.flags import cli_name

# config.json's torch_dtype (transformers' name; newer versions write "dtype") -> a precision.
HF_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass
class PrecisionConfig:
    """Precision the loaded model is held in (weights and activations; logits stay fp32).

    At most one flag; none: on a GPU the precision the checkpoint trained in (its --bf16; an
    exported folder's config.json torch_dtype), on CPU fp32 (a 16-bit forward is slow there)."""

    bf16: bool = False
    """Hold the model in bf16, as an RL run with --bf16 holds its policy for rollouts
    (megatron-core's Float16Module; default: bf16 on a GPU when the checkpoint trained with
    --bf16)."""

    fp16: bool = False
    """Hold the model in fp16 (megatron-core's Float16Module; fp16's range is narrower than
    bf16's, so activations of a model trained in bf16 may overflow; default: off)."""

    fp32: bool = False
    """Hold the model in fp32 whatever the checkpoint trained in (default: off; fp32 is the
    default on CPU, and on a GPU for a checkpoint trained in fp32)."""

    def given(self) -> list[str]:
        """The precisions (field names) whose flag is set; lm-eval may have set one to a value
        other than a bool, which ``validate`` refuses."""
        return [f.name for f in fields(self) if getattr(self, f.name) is not False]

    def requested(self) -> Optional[str]:
        """The precision a flag asks for, or None (the default rule decides)."""
        given = self.given()
        return given[0] if given else None

    def validate(self, spell: Callable[[str], str] = cli_name) -> None:
        """ValueError naming the flags: each a bool, at most one of them set."""
        given = self.given()
        for name in given:
            if getattr(self, name) is not True:  # e.g. lm-eval's bf16=yes, read as a string
                raise ValueError(f"{spell(name)} {getattr(self, name)!r}: must be true or false "
                                 f"(or leave it out)")
        if len(given) > 1:
            raise ValueError(f"{' and '.join(spell(n) for n in given)}: choose one precision "
                             f"(or none: on a GPU the checkpoint's, on CPU fp32)")


def trained_precision(load: str, ckpt_step: Optional[int] = None) -> tuple[str, str]:
    """(precision, where it came from) of the model in ``load``: a checkpoint's saved run config
    (``run["training"]["bf16"]``, the trainer's --bf16; the trainer has no fp16), or an exported
    folder's config.json ``torch_dtype`` (``dtype`` in newer transformers; an Ouro folder says
    bfloat16; a folder without one: fp32)."""
    from megaloop.inference.loading import is_hf_folder

    if is_hf_folder(load):
        from megaloop.convert.hf_folder import read_hf_config

        cfg = read_hf_config(load)
        key = "torch_dtype" if "torch_dtype" in cfg else "dtype"
        name = cfg.get(key)
        if name in HF_DTYPES:
            return HF_DTYPES[name], f"config.json's {key} is {name}"
        return "fp32", "config.json names no 16-bit dtype"
    from megaloop.checkpoint.config import read_run_config

    run = read_run_config(load, ckpt_step)
    if run.get("training", {}).get("bf16"):
        return "bf16", "the checkpoint trained in bf16"
    return "fp32", "the checkpoint trained in fp32"


def resolve_precision(config: Optional[PrecisionConfig], trained: str, source: str,
                      spell: Callable[[str], str] = cli_name) -> str:
    """The precision to hold the model in: the flag's, else on a GPU ``trained`` (from
    ``source``, as ``trained_precision`` says), else fp32. Announced in one line on rank 0's
    stderr, except the CPU default, which leaves a CPU run's output as it was before precision
    had a flag (fp32 is all a CPU run ever used)."""
    import torch

    from megaloop import runtime

    config = config or PrecisionConfig()
    config.validate(spell)
    given = config.requested()
    if given is not None:
        precision = given
        # A CPU without bf16/fp16 matrix instructions runs 16-bit matmuls through slow kernels:
        # [256, 1024] x [1024, 1024] on one thread of the AMD EPYC the tests were written on
        # took 10 ms in fp32 and 0.9 s in bf16 or fp16. A user asking for 16 bits to go faster
        # should hear it.
        note = "" if precision == "fp32" or torch.cuda.is_available() else \
            "; on CPU a 16-bit forward can be far slower than fp32"
        line = f"inference precision: {precision} ({spell(precision)}{note})"
    elif torch.cuda.is_available():
        precision = trained
        other = f"{spell('fp32')} to override" if precision != "fp32" else \
            f"{spell('bf16')} or {spell('fp16')} for 16 bits"
        line = f"inference precision: {precision} ({source}; {other})"
    else:
        return "fp32"
    if runtime.is_rank_zero():
        print(line, file=sys.stderr, flush=True)
    return precision
