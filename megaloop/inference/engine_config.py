"""The batching engine's scheduling and memory knobs (megaloop/inference/engine.py), apart from
the engine: tools/generate.py and tools/serve.py derive flags from them, and their ``--help``
imports no torch. Standard library only."""

from __future__ import annotations

from dataclasses import dataclass

from megaloop.inference.flags import parse_speculate

LAYER_FORWARDS = ("auto", "megatron-core")


@dataclass
class EngineConfig:
    """The engine's scheduling and memory knobs."""

    max_sequence_length: int = 2048
    """Prompt plus generated tokens of one request at most (longer requests are refused)."""
    max_batch: int = 64
    """Requests decoded together at most (the rows of one decode forward)."""
    block_size: int = 16
    """Tokens per KV block (the unit a request's cache grows and is freed by)."""
    num_blocks: int = 0
    """KV blocks in the pool (0: enough for ``max_batch`` rows of ``max_sequence_length``)."""
    prefill_chunk: int = 256
    """Prompt tokens prefilled per engine step at most (a longer prompt takes several steps)."""
    prefill_budget: int = 0
    """Prompt tokens of several requests prefilled per engine step at most (0: prefill_chunk);
    a prompt is still cut at multiples of prefill_chunk."""
    layer_forward: str = "auto"
    """``auto``: decode with megaloop's inference forward of the model's layers
    (megaloop/model/layer_forward.py: the same modules and weights, less host work per token)
    where it can compute them, else with megatron-core's (``InferenceEngine.forward_impl``
    says which, and why); ``megatron-core``: megatron-core's layer forward always."""
    cuda_graphs: bool = False
    """Decode forwards with static shapes, each gathered view's captured as a CUDA graph once
    and replayed (megaloop/inference/cuda_graphs.py); on a CPU the same static forwards run
    eagerly. Not with --exit, --speculate, a KV policy other than full, TP > 1 or
    megatron-core's layer forward."""
    speculate: str = ""
    """``d:k``: self-speculative decoding, up to k tokens drafted at loop depth d and verified at
    the full depth in one forward, each round's number picked from the measured acceptance and
    costs (0: a plain step; lossless; megaloop/inference/speculation.py). Empty: off."""
    speculate_fixed: bool = False
    """With --speculate: every round drafts k (as the rows' room allows) instead of the
    measured choice; reproducible rounds, for tests and benchmarks."""

    def validate(self) -> None:
        for name in ("max_sequence_length", "max_batch", "block_size", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        if self.prefill_budget < 0:
            raise ValueError(f"prefill_budget {self.prefill_budget}: must be >= 0 (0: "
                             f"--prefill-chunk)")
        parse_speculate(self.speculate)
        if self.layer_forward not in LAYER_FORWARDS:
            raise ValueError(f"--layer-forward {self.layer_forward}: choose one of "
                             f"{', '.join(LAYER_FORWARDS)}")
        if self.num_blocks < 0:
            raise ValueError(f"--num-blocks {self.num_blocks}: must be >= 0 (0: sized from "
                             f"--max-batch and --max-sequence-length)")
