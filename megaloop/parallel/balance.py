"""Pipeline balance of a looped model: a FLOP cost model of every stage's chunks, megatron-core's
interleaved schedule replayed on it, and the split of the core's layers (and of the readouts)
that the replay finds fastest.

Under interleaved 1F1B every stage runs one virtual chunk per loop step and micro-batch
(megaloop/parallel/pipeline.py): V = T chunks (plain 1F1B, V = 1, for T = 1). Chunk t of a
stage costs its core layers; on top of that

- the first stage embeds and runs the prelude in its first chunk, and with
  ``--pipeline-first-stage-readouts`` computes step t - 1's LM loss (head and cross-entropy) in
  chunk t;
- the last stage reads out in chunk t when the objective reads step t (step norm, coda, exit
  gate, LM head; in ``last`` mode only at T), or only the gate when the first stage takes the
  step's LM loss.

Costs are forward matmul FLOPs per token (megaloop.model.flops, with which the throughput line
counts them too); a chunk's backward costs twice its forward, as it does for every matmul.
``simulate`` replays megatron-core's schedule on these costs: each stage's order of forward and
backward chunks (warm-up, 1F1B steady state, cool-down; ``get_schedule_table``'s order of
micro-batches and chunks), each waiting for the chunk it depends on on the neighbouring stage,
and under interleaving, in the steady state, for both messages its 1F1B step receives together.
With equal chunks it gives interleaved 1F1B's (V*M + P - 1) slots, the bubble
(P - 1) / (V*M + P - 1); with unequal ones it sees what a per-stage total cannot: which chunks
meet in a time slot. Moving step t's LM loss to the first stage's chunk t + 1 makes that chunk
heavy while the last stage's chunk t gets light, and the two may run in the same slot: moving
the losses of steps 1 and 2 of four can leave the replay slower than moving none, and steps 1
and 3 faster than either.

The predicted bubble is the share of stage time spent idle, 1 - mean_s(busy_s) / makespan.
``--pipeline-balance auto`` picks the valid (first, last) split of Megatron-LM's uneven rule (the
middle stages equal) and the set of steps whose LM loss the first stage computes, with the
shortest replay (steps added one at a time while that helps; on a tie fewer steps moved, the even
split, then the most even one). Communication is not modelled: on CPU (gloo) it adds a bubble
that this model does not predict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from megaloop.model.config import LoopConfig, ModelConfig
from megaloop.model.flops import core_flops_per_token, layer_flops_per_token


@dataclass(frozen=True)
class Balance:
    """A split of the core's layers over the pipeline stages and what the cost model predicts."""

    layers: tuple
    """Core layers per stage, first to last."""
    chunk_cost: tuple
    """Forward FLOPs per token of each stage's chunk, averaged over its V chunks."""
    bubble: float
    """Predicted share of stage time spent idle (the schedule replayed, ``simulate``)."""
    theory: float
    """Interleaved 1F1B's bubble with equal stages, (P - 1) / (V*M + P - 1)."""
    first_readouts: tuple = ()
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
            steps = ",".join(map(str, self.first_readouts))
            how += f"; LM loss of steps {steps} on the first stage"
        return (f"core layers per stage {', '.join(map(str, self.layers))} ({how}); chunk cost "
                f"per stage {costs} (first = 1); predicted bubble {100 * self.bubble:.1f}% "
                f"(equal stages: {100 * self.theory:.1f}%)")


def chunk_costs(model: ModelConfig, loop: LoopConfig, vocab_size: int, seq_length: int,
                layers: tuple, first_readouts: Sequence[int] = ()) -> list:
    """Forward FLOPs per token of chunk c (loop step c + 1) of each stage holding ``layers``:
    [stage][chunk], with the LM loss of the steps in ``first_readouts`` on the first stage."""
    T, K = loop.num_loops, sum(layers)
    per_layer = layer_flops_per_token(model, seq_length)
    core_layer = core_flops_per_token(model, loop, seq_length) / (T * K)  # mean over steps
    h = model.hidden_size
    head, gate = 2 * h * vocab_size, (2 * h if loop.gated else 0)
    readout = loop.num_coda_layers * per_layer + head + gate
    reads = [loop.exit_loss != "last" or t == T for t in range(1, T + 1)]
    costs = [[n * core_layer] * T for n in layers]
    costs[0][0] += loop.num_prelude_layers * per_layer
    for t in range(1, T + 1):
        if t in first_readouts:
            costs[0][t] += head  # chunk t runs step t + 1
            costs[-1][t - 1] += gate
        elif reads[t - 1]:
            costs[-1][t - 1] += readout
    return costs


def stage_costs(model: ModelConfig, loop: LoopConfig, vocab_size: int, seq_length: int,
                layers: tuple, first_readouts: Sequence[int] = ()) -> tuple:
    """Forward FLOPs per token of each stage's chunk, averaged over its chunks."""
    costs = chunk_costs(model, loop, vocab_size, seq_length, layers, first_readouts)
    return tuple(sum(c) / len(c) for c in costs)


def simulate(forward: list, microbatches: int, group: Optional[int] = None) -> float:
    """The time megatron-core's pipeline schedule takes for ``microbatches`` micro-batches,
    given ``forward[s][c]``, the forward time of chunk c on stage s (a backward takes twice as
    long). V = len(forward[0]) > 1 replays interleaved 1F1B with micro-batch groups of
    ``group`` (default P, megatron-core's), V = 1 plain 1F1B."""
    P, V, M = len(forward), len(forward[0]), microbatches
    group = group or P
    table = []  # get_schedule_table: (micro-batch, chunk) in the order each stage runs forwards
    for low in range(0, M, group):
        high = M if low + group >= M else low + group
        table += [(m, c) for c in range(V) for m in range(low, high)]
    total, done, orders = M * V, {}, []
    for s in range(P):
        warmup = (P - s - 1) * 2 + (V - 1) * group if V > 1 else P - s - 1
        warmup = min(warmup, total)
        order = [("F", k, None) for k in range(warmup)]
        for k in range(total - warmup):  # steady state: forward k + warmup, then backward k
            order += [("F", k + warmup, k), ("B", k, None)]
        orders.append(order + [("B", k, None) for k in range(total - warmup, total)])

    def op(kind, k):  # (kind, micro-batch, chunk): backwards run the chunks in reverse
        m, c = table[k]
        return kind, m, (c if kind == "F" else V - 1 - c)

    def needs(kind, s, m, c):  # what this chunk waits for on another stage (or its own loss)
        if kind == "F":
            return [(s - 1, ("F", m, c))] if s > 0 else ([(P - 1, ("F", m, c - 1))] if c else [])
        if s < P - 1:
            return [(s + 1, ("B", m, c))]
        return [(0, ("B", m, c + 1))] if c < V - 1 else [(s, ("F", m, c))]

    free, position = [0.0] * P, [0] * P
    while any(position[s] < len(orders[s]) for s in range(P)):
        moved = False
        for s in range(P):
            while position[s] < len(orders[s]):
                kind, k, paired = orders[s][position[s]]
                this = op(kind, k)
                deps = needs(*this[:1], s, *this[1:])
                if paired is not None and V > 1:
                    # Interleaved: a 1F1B step's two inputs arrived together, at the end of the
                    # step before (plain 1F1B receives each just before it runs).
                    deps += [d for d in needs("B", s, *op("B", paired)[1:]) if d[0] != s]
                if any((d[0],) + d[1] not in done for d in deps):
                    break
                begin = max([free[s]] + [done[(d[0],) + d[1]] for d in deps])
                cost = forward[s][this[2]] * (1 if kind == "F" else 2)
                free[s] = done[(s,) + this] = begin + cost
                position[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("pipeline schedule replay is stuck (a dependency never runs)")
    return max(free)


def predicted_bubble(forward: list, microbatches: int) -> float:
    """1 - mean stage busy time / the replayed schedule's time."""
    busy = [3 * sum(stage) * microbatches for stage in forward]
    return 1 - (sum(busy) / len(busy)) / simulate(forward, microbatches)


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
            first_readouts: Optional[Sequence[int]] = None) -> Balance:
    """The cost model's view of ``layers`` and ``first_readouts`` (None: the fastest choice of
    each, module docstring; readouts only where the model allows, ``first_readout_blocker``)."""
    K, T, M = loop.num_core_layers(model.num_layers), loop.num_loops, num_microbatches
    V = T if T > 1 else 1
    theory = (pp - 1) / (V * M + pp - 1)
    args = (model, loop, vocab_size, seq_length)

    def time(split, steps):
        return simulate(chunk_costs(*args, split, steps), M)

    def view(split, steps):
        costs = chunk_costs(*args, split, steps)
        return Balance(tuple(split), stage_costs(*args, split, steps),
                       predicted_bubble(costs, M), theory, tuple(sorted(steps)))

    splits = [layers] if layers is not None else valid_splits(K, pp)
    movable = first_readouts is None and first_readout_blocker(model, loop) is None
    even = (K // pp,) * pp if K % pp == 0 else None
    candidates = []
    for split in splits:
        steps = tuple(sorted(first_readouts or ()))
        current = time(split, steps)
        while movable:  # add the step that shortens the replay most, while one does
            options = [(time(split, tuple(sorted(steps + (t,)))), t)
                       for t in range(1, T) if t not in steps]
            if not options or min(options)[0] >= current * (1 - 1e-9):
                break
            current, t = min(options)
            steps = tuple(sorted(steps + (t,)))
        candidates.append((current, split, steps))
    fastest = min(c[0] for c in candidates)
    # Among the fastest (float noise aside): fewest steps moved, the even split, least spread.
    _, split, steps = min((c for c in candidates if c[0] <= fastest * (1 + 1e-9)),
                          key=lambda c: (len(c[2]), c[1] != even, max(c[1]) - min(c[1])))
    return view(split, steps)


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
        chosen = balance(*args, first_readouts=par.first_stage_readout_steps())
        par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers = \
            chosen.flags
        par.pipeline_first_stage_readouts = ",".join(map(str, chosen.first_readouts))
        return chosen
    return balance(*args, layers=layers_per_stage(K, pp, par.decoder_first_pipeline_num_layers,
                                                  par.decoder_last_pipeline_num_layers),
                   first_readouts=par.first_stage_readout_steps() or ())
