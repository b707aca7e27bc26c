"""Pipeline balance of a looped model: a FLOP cost model of each stage's chunk, and the split of
the core's layers that evens the stages out.

Under interleaved 1F1B every stage runs one virtual chunk per loop step and micro-batch
(megaloop/parallel/pipeline.py): V = T chunks (plain 1F1B, V = 1, for T = 1). A stage's chunk
costs its core layers at that step; on top of that

- the first stage embeds and runs the prelude once per forward: spread here over its T chunks,
  as they add to the stage's busy time;
- the last stage reads out at every step the objective reads (step norm, coda, exit gate, LM
  head: ``readouts_per_forward``), once per forward in ``last`` mode, spread the same way.

Costs are forward matmul FLOPs per token (megaloop.training.metrics, where the throughput line
counts them; the backward pass is twice the forward for every matmul, so the ratios hold for a
training step). The schedule advances at the pace of its slowest stage, so one iteration takes
about (V*M + P - 1) chunk slots of the slowest chunk time (M micro-batches), and the predicted
bubble, the share of stage time spent idle, is

    1 - mean_s(t_s) * V*M / ((V*M + P - 1) * max_s(t_s)),

which is interleaved 1F1B's (P - 1) / (V*M + P - 1) when the stages are equal. The balanced split
(``--pipeline-balance auto``) is the valid (first, last) split of Megatron-LM's uneven rule (the
middle stages equal), with the first stage's readout count, that makes the slowest stage
fastest; on a tie the fewest readouts moved, the even split, then the most even one. Layers
are whole: where one layer is finer than the imbalance (a large vocabulary read out
T times), layers cannot even the stages out; there the first stage can take over the LM loss of
steps 1..n (``--pipeline-first-stage-readouts``, megaloop/parallel/pipeline.py), which moves n of
the T head + cross-entropy readouts off the last stage, and ``auto`` chooses n with the split.
Whatever remains above theory, the start-up line says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megaloop.model.config import LoopConfig, ModelConfig


@dataclass(frozen=True)
class Balance:
    """A split of the core's layers over the pipeline stages and what the cost model predicts."""

    layers: tuple
    """Core layers per stage, first to last."""
    chunk_cost: tuple
    """Forward FLOPs per token of each stage's chunk (one loop step)."""
    bubble: float
    """Predicted share of stage time spent idle."""
    theory: float
    """Interleaved 1F1B's bubble with equal stages, (P - 1) / (V*M + P - 1)."""
    first_readouts: int = 0
    """Loop steps whose LM loss the first stage computes (--pipeline-first-stage-readouts)."""

    @property
    def flags(self) -> tuple:
        """(--decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers), None for
        an even split."""
        if len(set(self.layers)) == 1:
            return None, None
        return self.layers[0], self.layers[-1]

    def describe(self) -> str:
        first, last = self.flags
        how = "even split" if first is None else \
            f"--decoder-first-pipeline-num-layers {first} --decoder-last-pipeline-num-layers {last}"
        costs = ", ".join(f"{c / self.chunk_cost[0]:.2f}" for c in self.chunk_cost)
        if self.first_readouts:
            how += f"; LM loss of steps 1-{self.first_readouts} on the first stage"
        return (f"core layers per stage {', '.join(map(str, self.layers))} ({how}); chunk cost "
                f"per stage {costs} (first = 1); predicted bubble {100 * self.bubble:.1f}% "
                f"(equal stages: {100 * self.theory:.1f}%)")


def stage_costs(model: ModelConfig, loop: LoopConfig, vocab_size: int, seq_length: int,
                layers: tuple, first_readouts: int = 0) -> tuple:
    """Forward FLOPs per token of one chunk (loop step) of each stage holding ``layers``, with
    the LM loss of ``first_readouts`` steps computed on the first stage."""
    from megaloop.training.metrics import (core_flops_per_token, layer_flops_per_token,
                                           readouts_per_forward)

    T, K = loop.num_loops, sum(layers)
    per_layer = layer_flops_per_token(model, seq_length)
    core_layer = core_flops_per_token(model, loop, seq_length) / (T * K)  # mean over steps
    h = model.hidden_size
    head = 2 * h * vocab_size
    readout = readouts_per_forward(loop) * (
        loop.num_coda_layers * per_layer + head + (2 * h if loop.gated else 0))
    costs = [n * core_layer for n in layers]
    costs[0] += (loop.num_prelude_layers * per_layer + first_readouts * head) / T
    costs[-1] += (readout - first_readouts * head) / T
    return tuple(costs)


def first_readout_blocker(model: ModelConfig, loop: LoopConfig) -> Optional[str]:
    """Why this model's first pipeline stage cannot compute LM losses
    (--pipeline-first-stage-readouts), or None. The first stage reads step t's loss from the
    state the carry brings into step t + 1, with the embedding as head and the loss weight the
    last stage's gate gives."""
    if loop.num_loops < 2 or loop.exit_loss not in ("expected", "smoothed"):
        return ("it needs --num-loops >= 2 and --exit-loss expected or smoothed (the loss of a "
                "step before the last enters the objective only there)")
    if model.untie_embeddings_and_output_weights:
        return ("it needs the LM head tied to the embedding, which the first stage holds (drop "
                "--untie-embeddings-and-output-weights)")
    if loop.num_coda_layers:
        return "it needs a model without coda layers (the coda lives on the last stage)"
    if loop.step_norm_placement != "recurrent" and loop.step_norm != "identity":
        return ("it needs --step-norm-placement recurrent (or --step-norm identity): the state "
                "the carry brings must be the readout's input")
    if loop.loop_resolutions or loop.loop_topology != "plain":
        return "SpiralFormer resolutions and the Anchor/MeSH topologies are not supported with it"
    return None


def predicted_bubble(costs: tuple, chunks: int) -> float:
    """The bubble of a schedule of ``chunks`` = V*M chunk slots per stage (module docstring)."""
    p = len(costs)
    return 1 - (sum(costs) / p) * chunks / ((chunks + p - 1) * max(costs))


def valid_splits(num_core_layers: int, pp: int) -> list:
    """Every split Megatron-LM's uneven rule allows: first and last stage any size >= 1, the
    middle stages equal (>= 1), as layer counts per stage."""
    out = []
    for first in range(1, num_core_layers - pp + 2):
        for last in range(1, num_core_layers - first - pp + 3):
            middle, stages = num_core_layers - first - last, pp - 2
            if stages == 0 and middle == 0:
                out.append((first, last))
            elif stages > 0 and middle >= stages and middle % stages == 0:
                out.append((first, *[middle // stages] * stages, last))
    return out


def balance(model: ModelConfig, loop: LoopConfig, vocab_size: int, seq_length: int, pp: int,
            num_microbatches: int, layers: Optional[tuple] = None,
            first_readouts: Optional[int] = None) -> Balance:
    """The cost model's view of ``layers`` and ``first_readouts`` (None: the balanced choice
    of each; the readout count only where the model allows any, ``first_readout_blocker``)."""
    K = loop.num_core_layers(model.num_layers)
    chunks = (loop.num_loops if loop.num_loops > 1 else 1) * num_microbatches
    theory = (pp - 1) / (chunks + pp - 1)

    def view(split, n):
        costs = stage_costs(model, loop, vocab_size, seq_length, split, n)
        return Balance(tuple(split), costs, predicted_bubble(costs, chunks), theory, n)

    splits = [layers] if layers is not None else valid_splits(K, pp)
    if first_readouts is not None:
        counts = [first_readouts]
    elif first_readout_blocker(model, loop) is None:
        counts = range(loop.num_loops)
    else:
        counts = [0]
    even = (K // pp,) * pp if K % pp == 0 else None

    def key(choice):
        split, n = choice
        costs = stage_costs(model, loop, vocab_size, seq_length, split, n)
        # (slowest stage, to the FLOP: float noise aside; fewest readouts moved; not the even
        # split; spread of layers)
        return round(max(costs)), n, split != even, max(split) - min(split)

    return view(*min(((split, n) for split in splits for n in counts), key=key))


def layers_per_stage(num_core_layers: int, pp: int, first: Optional[int],
                     last: Optional[int]) -> tuple:
    """The split the flags give (megaloop/parallel/config.py checks them): Megatron-LM's rule."""
    if first is None and last is None:
        return (num_core_layers // pp,) * pp
    stages = pp - (first is not None) - (last is not None)
    middle = num_core_layers - (first or 0) - (last or 0)
    each = middle // stages if stages else 0
    split = [each] * pp
    if first is not None:
        split[0] = first
    if last is not None:
        split[-1] = last
    return tuple(split)


def plan(run, vocab_size: int, num_microbatches: int) -> Balance:
    """The split a RunConfig ``run`` trains with (PP > 1): under ``--pipeline-balance auto`` the
    balanced one, written into its --decoder-first/last-pipeline-num-layers (the same on every
    rank: a function of the configuration); else the flags' (or the even) split."""
    par = run.parallel
    pp, K = par.pipeline_model_parallel_size, run.loop.num_core_layers(run.model.num_layers)
    args = (run.model, run.loop, vocab_size, run.training.seq_length, pp, num_microbatches)
    if par.pipeline_balance == "auto":
        chosen = balance(*args, first_readouts=par.pipeline_first_stage_readouts)
        par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers = \
            chosen.flags
        par.pipeline_first_stage_readouts = chosen.first_readouts
        return chosen
    return balance(*args, layers=layers_per_stage(K, pp, par.decoder_first_pipeline_num_layers,
                                                  par.decoder_last_pipeline_num_layers),
                   first_readouts=par.pipeline_first_stage_readouts or 0)
