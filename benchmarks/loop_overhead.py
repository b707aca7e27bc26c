"""Cost of looping, of the exit objective and of its per-step readout, on CPU (prints, never
asserts).

    python benchmarks/loop_overhead.py [--hidden-size 128 --num-heads 4 --seq-length 128
                                        --micro-batch-size 4 --num-core-layers 2 --num-loops 4
                                        --vocab-size 1024 --steps 20 --threads 1
                                        --part all|overhead|readout]

Three comparisons, each a full training step (forward, backward, torch.optim.AdamW step):

(a) loop overhead: LoopedGPTModel with K core layers run T times (`--exit-loss last`, pre-norm)
    against megatron-core's own GPTModel with K*T distinct layers (local spec, RMSNorm), same
    width, sequence, batch and vocabulary. Same FLOPs per step except T step norms instead of
    one final norm; the looped model has T times fewer core weights. Target: looped/unrolled
    <= 1.02 (forward+backward).
(b) exit-objective cost: the same looped model with `--exit-loss expected` (LM head, gate and
    vocab-parallel cross-entropy at every step) against `last` (head once). Target:
    expected/last <= 1.10. Where the default shape misses it, the ratio is also measured at other
    vocabulary sizes and sequence lengths (same tokens per step) to show that the extra cost is
    the T-1 additional LM heads, which scale with vocab / (effective depth x per-layer cost).
(c) per-step readout, at a vocabulary-heavy shape (--readout-*: hidden 256, vocab 32000, seq 512,
    micro batch 1; K and T as above): `expected` / `last` in peak memory and step time, with
    each step's LM loss from `--loop-readout logits` (megatron-core's head + vocab-parallel
    cross-entropy: autograd keeps every read-out step's [s, b, V] softmax) and from
    `--loop-readout chunked` (megaloop/model/readout.py: logits recomputed in the backward).
    Targets: peak memory expected/last <= 1.10, step time expected/last <= 1.10; and chunked
    against logits at the same mode.

Method. Timing runs in this one process: megaloop's CPU shim, a size-1 gloo process group and
megaloop's parallel initialization, then all variants built side by side and their steps
interleaved in rounds (rotating order) so that drifts of the machine hit every variant alike;
the figure is the median over the timed steps. Peak memory cannot be read from the CPU allocator
(torch keeps no CPU memory statistics), and a max-RSS of a process that has already run another
variant mostly reports the earlier variant, so each variant is also run in a fresh process forked
*before* any model exists: it resets its RSS high-water mark (/proc/self/clear_refs), builds the
model and optimizer, runs three steps and reports VmHWM minus its RSS at the start - weights,
grads, Adam state, activations and allocator slack together. The same process then reports the
peak of one more forward + backward above its resting RSS (weights and Adam state; gradients
freed): what a step adds before the optimizer runs - activations, gradients, transient logits
(AdamW's own temporaries, the same for every variant with the same parameters, are left out so
they cannot mask the difference). For that figure
glibc's mmap threshold is pinned at 64 KiB (mallopt) in the child, so a freed tensor's pages leave
the RSS at once instead of being kept for reuse, which would hide the step's peak below the
resting RSS. As an exact, allocator-free figure for activations, the bytes autograd keeps for
backward (save_for_backward, deduplicated by storage, parameters excluded) are counted with
saved-tensor hooks during one forward.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megaloop import runtime  # noqa: E402

runtime.quiet_megatron()

import torch  # noqa: E402

VARIANTS = ("unrolled", "looped-last", "looped-expected")
# (c): "looped-<exit loss>/<loop readout>"
READOUT_VARIANTS = ("looped-last/logits", "looped-expected/logits", "looped-last/chunked",
                    "looped-expected/chunked")


# --- building ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Shape:
    hidden: int
    heads: int
    ffn: int | None
    seq: int
    batch: int
    K: int
    T: int
    vocab: int


def build(variant: str, s: Shape, seed: int = 1234):
    """(model, AdamW, is_looped) for one variant; the same seed for every variant.
    ``looped-<exit loss>[/<loop readout>]``: without a readout, LoopConfig's default."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megaloop.model.config import (LoopConfig, ModelConfig, padded_vocab_size,
                                       transformer_config)
    from megaloop.model.looped_gpt import build_model

    torch.manual_seed(seed)
    # "pre" norm: the looped layers are then exactly GPTModel's layers (same spec).
    model_cfg = ModelConfig(num_layers=s.K, hidden_size=s.hidden, num_attention_heads=s.heads,
                            ffn_hidden_size=s.ffn, max_position_embeddings=s.seq,
                            norm_scheme="pre", transformer_impl="local", swiglu=True,
                            position_embedding_type="rope", normalization="RMSNorm",
                            hidden_dropout=0.0, attention_dropout=0.0,
                            disable_bias_linear=True)
    if variant == "unrolled":
        depth = s.K * s.T
        config = transformer_config(dataclasses.replace(model_cfg, num_layers=depth), depth)
        model = GPTModel(config=config,
                         transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                         vocab_size=padded_vocab_size(
                             s.vocab, model_cfg.make_vocab_size_divisible_by, 1),
                         max_sequence_length=s.seq, position_embedding_type="rope",
                         share_embeddings_and_output_weights=True)
        looped = False
    else:
        mode, _, readout = variant.split("-", 1)[1].partition("/")
        loop = LoopConfig(num_loops=s.T, exit_loss=mode,
                          **({"loop_readout": readout} if readout else {}))
        model = build_model(model_cfg, loop, s.vocab)
        looped = True
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), looped


def make_batch(s: Shape):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, s.vocab, (s.batch, s.seq), generator=g)
    labels = torch.randint(0, s.vocab, (s.batch, s.seq), generator=g)
    return ids, torch.arange(s.seq).expand(s.batch, s.seq), labels


def loss_of(model, looped: bool, batch) -> torch.Tensor:
    ids, pos, labels = batch
    out = model(ids, pos, None, labels=labels)
    return (out.objective if looped else out).mean()


def train_step(model, opt, looped: bool, batch) -> tuple[float, float]:
    """(forward+backward seconds, optimizer seconds) of one step."""
    t0 = time.perf_counter()
    loss_of(model, looped, batch).backward()
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return t1 - t0, time.perf_counter() - t1


def saved_activation_bytes(model, looped: bool, batch) -> int:
    """Bytes autograd holds for backward after one forward (unique storages, no parameters)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(model, looped, batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# --- process group -----------------------------------------------------------------------------
def init_group() -> None:
    """Size-1 gloo group + megatron-core parallel state (vocab-parallel CE needs the TP group)."""
    from megaloop.parallel.initialize import initialize_single_process

    initialize_single_process()


# --- memory: one fresh forked process per variant ----------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so a later peak is what came after."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _pin_mmap_threshold() -> bool:
    """mallopt(M_MMAP_THRESHOLD, 64 KiB): every larger block is its own mapping, returned to the
    OS when freed (glibc otherwise raises the threshold after large frees and keeps the pages)."""
    path = ctypes.util.find_library("c")
    if path is None:
        return False
    M_MMAP_THRESHOLD = -3
    return bool(ctypes.CDLL(path).mallopt(M_MMAP_THRESHOLD, 64 * 1024))


def _memory_child(variant: str, s: Shape, threads: int, queue) -> None:
    try:
        torch.set_num_threads(threads)
        pinned = _pin_mmap_threshold()
        init_group()
        batch = make_batch(s)
        reset = _reset_peak()
        base = _status_kib("VmRSS")
        model, opt, looped = build(variant, s)
        for _ in range(3):  # the first step allocates Adam's state
            train_step(model, opt, looped, batch)
        peak = _status_kib("VmHWM")
        run = (peak - base) * 1024 if reset or peak > base else None
        step = None
        if pinned and _reset_peak():  # one more forward + backward above the resting RSS
            rest = _status_kib("VmRSS")
            loss_of(model, looped, batch).backward()
            step = (_status_kib("VmHWM") - rest) * 1024
        queue.put((variant, {"run": run, "step": step}))
    except BaseException as exc:  # report, never hang the parent
        queue.put((variant, f"{type(exc).__name__}: {exc}"))
    finally:
        # put() hands the item to a feeder thread; flush it before os._exit kills that thread.
        queue.close()
        queue.join_thread()
        os._exit(0)


def measure_memory(s: Shape, threads: int, variants=VARIANTS) -> dict:
    """variant -> {"run": peak bytes of build + 3 steps, "step": peak bytes of one forward +
    backward above the resting RSS}, or an error string."""
    ctx = mp.get_context("fork")
    out = {}
    for variant in variants:  # one at a time: concurrent children would share the 2 cores
        queue = ctx.Queue()
        proc = ctx.Process(target=_memory_child, args=(variant, s, threads, queue))
        proc.start()
        try:
            _, out[variant] = queue.get(timeout=600)
        except Exception:
            out[variant] = "timed out"
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return out


# --- timing: interleaved in this process -------------------------------------------------------
def measure_time(s: Shape, variants, steps: int, warmup: int, rounds: int) -> dict:
    """Median forward+backward and optimizer seconds per variant, steps interleaved in rounds."""
    built = {v: build(v, s) for v in variants}
    batch = make_batch(s)
    for v in variants:
        for _ in range(warmup):
            train_step(*built[v][:2], built[v][2], batch)
    fb = {v: [] for v in variants}
    op = {v: [] for v in variants}
    per_round = max(1, steps // rounds)
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            model, opt, looped = built[v]
            for _ in range(per_round):
                a, b = train_step(model, opt, looped, batch)
                fb[v].append(a)
                op[v].append(b)
    res = {}
    for v in variants:
        model, _, looped = built[v]
        res[v] = {"fb": statistics.median(fb[v]), "opt": statistics.median(op[v]),
                  "step": statistics.median([a + b for a, b in zip(fb[v], op[v])]),
                  "n": len(fb[v]), "params": num_params(model),
                  "saved": saved_activation_bytes(model, looped, batch)}
    del built
    return res


# --- a FLOP model of (b), to say where the cost comes from --------------------------------------
def flops_per_token(hidden, ffn, seq, layers_eff, vocab, heads_read, causal_skip=False):
    """Forward FLOPs per token: layers (QKV/out proj, SwiGLU MLP, attention) + LM heads.

    Attention scores and context cost 4*s*h per token when the full s x s matrix is computed
    (megatron-core's local, unfused attention: what runs here), 2*s*h with a causal flash kernel.
    """
    attn = (2 if causal_skip else 4) * seq * hidden
    layer = 2 * (4 * hidden * hidden + 3 * hidden * ffn) + attn
    return layers_eff * layer + heads_read * 2 * hidden * vocab


def predicted_expected_over_last(hidden, ffn, seq, K, T, vocab, causal_skip=False) -> float:
    return flops_per_token(hidden, ffn, seq, K * T, vocab, T, causal_skip) / \
        flops_per_token(hidden, ffn, seq, K * T, vocab, 1, causal_skip)


# --- main --------------------------------------------------------------------------------------
def mib(n) -> str:
    return f"{n / 2**20:8.1f}" if isinstance(n, (int, float)) else f"{str(n):>8s}"


def _mem(mem: dict, variant: str, key: str):
    """A variant's memory figure, or what went wrong (a string)."""
    m = mem.get(variant, "-")
    return m.get(key) if isinstance(m, dict) else m


def _ratio(a, b) -> str:
    return f"{a / b:.3f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b \
        else "n/a"


def print_table(res: dict, mem: dict, variants) -> None:
    print(f"{'variant':24s} {'params':>10s} {'fwd+bwd ms':>10s} {'AdamW ms':>9s} "
          f"{'step ms':>8s} {'peak MiB':>8s} {'f+b MiB':>8s} {'saved MiB':>9s}")
    for v in variants:
        r = res[v]
        print(f"{v:24s} {r['params']:10,d} {r['fb'] * 1e3:10.1f} {r['opt'] * 1e3:9.1f} "
              f"{r['step'] * 1e3:8.1f} {mib(_mem(mem, v, 'run'))} {mib(_mem(mem, v, 'step'))} "
              f"{mib(r['saved']):>9s}")
    print("  peak MiB: VmHWM - start RSS of a fresh forked process (build + 3 steps: weights, "
          "grads, Adam state, activations, allocator slack)\n  f+b MiB: VmHWM of one more forward "
          "+ backward - the resting RSS before it, same process, glibc mmap threshold pinned at "
          "64 KiB (activations, grads, transient tensors)\n  saved MiB: tensors autograd keeps for "
          "backward after one forward (unique storages, parameters excluded)")


def run_overhead(args, s: Shape, ffn: int, mem: dict) -> None:
    """(a) and (b) at the main shape, with LoopConfig's default readout."""
    res = measure_time(s, list(VARIANTS), args.steps, args.warmup, args.rounds)

    print(f"\n(a), (b): median over {res['unrolled']['n']} steps per variant ({args.rounds} "
          f"interleaved rounds, {args.warmup} warmup steps); AdamW = plain torch.optim.AdamW, "
          f"same on all; looped variants use the default --loop-readout")
    print_table(res, mem, VARIANTS)

    u, last, exp = res["unrolled"], res["looped-last"], res["looped-expected"]
    print("\n(a) looped (K x T, exit-loss last) / unrolled GPTModel (K*T layers); target <= 1.02")
    print(f"    fwd+bwd {last['fb'] / u['fb']:.3f}   full step {last['step'] / u['step']:.3f}"
          f"   (the full step includes AdamW over {u['params'] / last['params']:.1f}x fewer "
          f"parameters on the looped side)")
    print(f"    peak memory {_ratio(_mem(mem, 'looped-last', 'run'), _mem(mem, 'unrolled', 'run'))}"
          f"   saved activations {last['saved'] / u['saved']:.3f}")
    ratio_b = exp["fb"] / last["fb"]
    pred = predicted_expected_over_last(s.hidden, ffn, s.seq, s.K, s.T, s.vocab)
    print(f"\n(b) exit-loss expected / last; target <= 1.10")
    print(f"    fwd+bwd {ratio_b:.3f}   full step {exp['step'] / last['step']:.3f}   "
          f"(FLOP model: {pred:.3f})")
    print(f"    peak memory {_ratio(_mem(mem, 'looped-expected', 'run'), _mem(mem, 'looped-last', 'run'))}"
          f"   f+b memory {_ratio(_mem(mem, 'looped-expected', 'step'), _mem(mem, 'looped-last', 'step'))}"
          f"   saved activations {exp['saved'] / last['saved']:.3f}")

    if args.sweep == "always" or (args.sweep == "auto" and ratio_b > 1.10):
        if ratio_b > 1.10:
            head_in_layers = 2 * s.hidden * s.vocab / flops_per_token(s.hidden, ffn, s.seq, 1, 0, 0)
            print(f"    MISSED at this shape: 'expected' runs the LM head ({s.hidden} x {s.vocab}) "
                  f"and vocab-parallel cross-entropy at all {s.T} steps, 'last' once; at hidden "
                  f"{s.hidden} one head costs as much as {head_in_layers:.1f} layers, against "
                  f"{s.K * s.T} layers of depth.")
        print("    where the cost comes from (same tokens per step, 12 timed steps each):")
        print(f"    {'vocab':>6s} {'seq':>5s} {'batch':>5s} {'last ms':>8s} {'expected ms':>11s} "
              f"{'ratio':>6s} {'FLOP model':>10s}")
        tokens = s.seq * s.batch
        points = [(256, s.seq), (s.vocab, s.seq), (4096, s.seq), (s.vocab, 4 * s.seq)]
        for vocab, seq in points:
            sh = dataclasses.replace(s, vocab=vocab, seq=seq, batch=max(1, tokens // seq))
            if (vocab, seq) == (s.vocab, s.seq):
                r = {"looped-last": last, "looped-expected": exp}
            else:
                r = measure_time(sh, ["looped-last", "looped-expected"], 12, 2, 4)
            a, b = r["looped-last"]["fb"], r["looped-expected"]["fb"]
            model = predicted_expected_over_last(s.hidden, ffn, seq, s.K, s.T, vocab)
            print(f"    {vocab:6d} {seq:5d} {sh.batch:5d} {a * 1e3:8.1f} {b * 1e3:11.1f} "
                  f"{b / a:6.3f} {model:10.3f}")
        big = predicted_expected_over_last(2048, 5632, 4096, 24, 4, 49152, causal_skip=True)
        print(f"    FLOP model at the 1.4B recipe (hidden 2048, ffn 5632, 24 layers x T=4, seq "
              f"4096, vocab 49152, causal flash attention): {big:.3f}")


def readout_shape(args) -> Shape:
    return Shape(args.readout_hidden_size, args.num_heads, None, args.readout_seq_length,
                 args.readout_micro_batch_size, args.num_core_layers, args.num_loops,
                 args.readout_vocab_size)


def run_readout(args, s: Shape, mem: dict) -> None:
    """(c): expected / last with each readout, at the vocabulary-heavy shape."""
    ffn = 4 * s.hidden
    res = measure_time(s, list(READOUT_VARIANTS), args.readout_steps, args.warmup,
                       args.readout_rounds)
    print(f"\n(c) per-step readout at hidden {s.hidden}, ffn {ffn}, vocab {s.vocab}, seq {s.seq}, "
          f"micro batch {s.batch}, K={s.K} x T={s.T}, default chunk "
          f"{default_chunk_tokens()} tokens; median over {res[READOUT_VARIANTS[0]]['n']} steps "
          f"({args.readout_rounds} interleaved rounds)")
    print_table(res, mem, READOUT_VARIANTS)
    pred = predicted_expected_over_last(s.hidden, ffn, s.seq, s.K, s.T, s.vocab)
    print(f"    {'readout':8s} {'expected/last:':>14s} {'peak MiB':>8s} {'f+b MiB':>8s} "
          f"{'saved':>6s} {'step time':>9s}   (targets <= 1.10; FLOP model of the time ratio "
          f"{pred:.3f})")
    for readout in ("logits", "chunked"):
        e, l = f"looped-expected/{readout}", f"looped-last/{readout}"
        print(f"    {readout:8s} {'':>14s} {_ratio(_mem(mem, e, 'run'), _mem(mem, l, 'run')):>8s} "
              f"{_ratio(_mem(mem, e, 'step'), _mem(mem, l, 'step')):>8s} "
              f"{res[e]['saved'] / res[l]['saved']:6.3f} {res[e]['step'] / res[l]['step']:9.3f}")
    print(f"    {'mode':8s} {'chunked/logits:':>14s} {'peak MiB':>8s} {'f+b MiB':>8s} "
          f"{'saved':>6s} {'step time':>9s}")
    for mode in ("last", "expected"):
        c, g = f"looped-{mode}/chunked", f"looped-{mode}/logits"
        print(f"    {mode:8s} {'':>14s} {_ratio(_mem(mem, c, 'run'), _mem(mem, g, 'run')):>8s} "
              f"{_ratio(_mem(mem, c, 'step'), _mem(mem, g, 'step')):>8s} "
              f"{res[c]['saved'] / res[g]['saved']:6.3f} {res[c]['step'] / res[g]['step']:9.3f}")
    layer = flops_per_token(s.hidden, ffn, s.seq, 1, 0, 0)
    print(f"    the step-time ratio is bounded by FLOPs: one head ({s.hidden} x {s.vocab}) costs "
          f"{2 * s.hidden * s.vocab / layer:.1f} layers here, and `expected` runs {s.T} heads "
          f"against {s.K * s.T} layers of depth; the chunked readout adds one head GEMM per "
          f"read-out step (4 instead of 3) and saves the passes over kept [s, b, V] tensors.")


def default_chunk_tokens() -> int:
    from megaloop.model.config import LoopConfig

    return LoopConfig().loop_readout_chunk_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--num-core-layers", type=int, default=2, help="K")
    p.add_argument("--num-loops", type=int, default=4, help="T")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=6, help="interleaving rounds")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (all variants)")
    p.add_argument("--sweep", choices=("auto", "always", "never"), default="auto",
                   help="(b) at other vocab sizes / sequence lengths: auto = when (b) misses")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--part", choices=("all", "overhead", "readout"), default="all",
                   help="overhead: (a) and (b); readout: (c)")
    p.add_argument("--readout-hidden-size", type=int, default=256, help="(c)")
    p.add_argument("--readout-vocab-size", type=int, default=32000, help="(c)")
    p.add_argument("--readout-seq-length", type=int, default=512, help="(c)")
    p.add_argument("--readout-micro-batch-size", type=int, default=1, help="(c)")
    p.add_argument("--readout-steps", type=int, default=12, help="(c): timed steps per variant")
    p.add_argument("--readout-rounds", type=int, default=4, help="(c): interleaving rounds")
    args = p.parse_args()

    from megaloop import cpu_shim

    cpu_shim.enable()
    torch.set_num_threads(args.threads)
    s = Shape(args.hidden_size, args.num_heads, args.ffn_hidden_size, args.seq_length,
              args.micro_batch_size, args.num_core_layers, args.num_loops, args.vocab_size)
    ffn = s.ffn or 4 * s.hidden
    rs = readout_shape(args)
    overhead, readout = args.part in ("all", "overhead"), args.part in ("all", "readout")
    t_start = time.perf_counter()
    print(f"loop_overhead: hidden {s.hidden}, heads {s.heads}, ffn {ffn} (SwiGLU), seq {s.seq}, "
          f"micro batch {s.batch}, K={s.K} x T={s.T} (unrolled: {s.K * s.T} layers), vocab "
          f"{s.vocab}; fp32 CPU, {args.threads} thread(s) of {os.cpu_count()} cores; "
          f"torch {torch.__version__}")

    # Memory first: the children must fork before this process has built any model.
    mem, rmem = {}, {}
    if not args.skip_memory:
        if overhead:
            mem = measure_memory(s, args.threads)
        if readout:
            rmem = measure_memory(rs, args.threads, READOUT_VARIANTS)

    init_group()
    if overhead:
        run_overhead(args, s, ffn, mem)
    if readout:
        run_readout(args, rs, rmem)

    from megaloop.parallel.initialize import destroy

    destroy()
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
