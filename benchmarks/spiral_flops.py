"""SpiralFormer FLOPs and CPU step time against the full-resolution loop (prints, never asserts).

    python benchmarks/spiral_flops.py [--seq-length 4096] [--cpu-seq-length 512 --steps 8]

(a) Prefill FLOPs ("SpiralFormer" (arXiv 2602.11698) Table 1's column: one forward over --seq-length
    tokens, matmul FLOPs with the attention square counted in full, one LM head) from megaloop's own
    counter (megaloop.training.metrics), per loop step at each resolution, for SpiralFormer-B at the
    four Pythia scales of SpiralFormer Table 1 (GELU MLP 4d, untied head, vocab 50304, MeSH with B =
    T + 3), against
      * LoopedFormer at the same layer allocation as in SpiralFormer Table 1 (P + K x {1, 1} + C),
        the comparison SpiralFormer reports (it gives ~0.89-0.93), and
      * the same T = 4 steps all at full resolution (P + K x {1,1,1,1} + C).
(b) Measured CPU step time (forward + backward, median over --steps interleaved rounds) of a
    small 1 + 2 x {1/8,1/4,1/2,1} + 1 MeSH model against 1 + 2 x {1,1} + 1 and 1 + 2 x {1,1,1,1}
    + 1 (MeSH), --cpu-seq-length tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megaloop import runtime  # noqa: E402

runtime.quiet_megatron()

from megaloop.model.config import LoopConfig, ModelConfig  # noqa: E402
from megaloop.model.spiral import num_chunks  # noqa: E402
from megaloop.model.spiral_schedule import offset  # noqa: E402
from megaloop.training.metrics import core_step_flops_per_token, flops_per_iteration  # noqa

# Pythia (SpiralFormer Table 1): hidden, heads, layout (P, K, C).
SCALES = {"160M": (768, 12, (2, 4, 2)), "410M": (1024, 16, (4, 8, 4)),
          "1B": (2048, 8, (3, 5, 3)), "1.4B": (2048, 16, (4, 8, 4))}
VOCAB = 50304


# The model family the measurements were taken with (megaloop's defaults are Megatron-LM's).
LLAMA_STYLE = dict(swiglu=True, position_embedding_type="rope", normalization="RMSNorm",
                   hidden_dropout=0.0, attention_dropout=0.0, disable_bias_linear=True)

def configs(hidden, heads, layout, resolutions):
    P, K, C = layout
    T = len(resolutions.split(","))
    model = ModelConfig(num_layers=P + K + C, hidden_size=hidden, num_attention_heads=heads,
                        ffn_hidden_size=4 * hidden, swiglu=False,
                        position_embedding_type="rope", normalization="RMSNorm",
                        hidden_dropout=0.0, attention_dropout=0.0, disable_bias_linear=True,
                        untie_embeddings_and_output_weights=True)
    loop = LoopConfig(num_loops=T, num_prelude_layers=P, num_coda_layers=C, exit_loss="last",
                      loop_resolutions=resolutions, loop_topology="mesh")
    loop.validate(model.num_layers)
    return model, loop


def prefill(model, loop, L):
    return flops_per_iteration(model, loop, VOCAB, L, global_batch=1) / 3.0


def flops_report(L):
    print(f"(a) prefill FLOPs, {L} tokens, MeSH topology, megaloop's counter\n")
    hidden, heads, layout = SCALES["410M"]
    model, loop = configs(hidden, heads, layout, "1/8,1/4,1/2,1")
    full_m, full_l = configs(hidden, heads, layout, "1,1,1,1")
    print(f"per loop step, 410M SpiralFormer-B {layout[0]} + {layout[1]} x "
          "{1/8,1/4,1/2,1} + " f"{layout[2]} (core only):")
    print(f"  {'step':>4} {'r_t':>5} {'L_t':>6} {'spiral GFLOP':>13} {'full-res GFLOP':>15} {'ratio':>6}")
    sp = core_step_flops_per_token(model, loop, L)
    fr = core_step_flops_per_token(full_m, full_l, L)
    for t, (g, a, b) in enumerate(zip([8, 4, 2, 1], sp, fr), 1):
        print(f"  {t:>4} {'1/' + str(g) if g > 1 else '1':>5} {(num_chunks(L, g, offset(g, loop.resolution_offset)) if g > 1 else L):>6} {a * L / 1e9:>13.2f} "
              f"{b * L / 1e9:>15.2f} {a / b:>6.3f}")
    print()
    print(f"  {'scale':>5} {'SpiralFormer-B':>15} {'LoopedFormer':>13} {'ratio':>6} "
          f"{'paper':>6}   {'T=4 full-res':>13} {'ratio':>6}")
    paper = {"160M": (1.48, 1.65), "410M": (4.11, 4.59), "1B": (8.95, 9.67), "1.4B": (12.92, 14.08)}
    for name, (hidden, heads, layout) in SCALES.items():
        spiral = prefill(*configs(hidden, heads, layout, "1/8,1/4,1/2,1"), L)
        looped = prefill(*configs(hidden, heads, layout, "1,1"), L)
        full4 = prefill(*configs(hidden, heads, layout, "1,1,1,1"), L)
        ps, pl = paper[name]
        print(f"  {name:>5} {spiral / 1e12:>13.2f} T {looped / 1e12:>11.2f} T {spiral / looped:>6.3f} "
              f"{ps / pl:>6.3f}   {full4 / 1e12:>11.2f} T {spiral / full4:>6.3f}")
    print("  (paper column: SpiralFormer Table 1's SpiralFormer-B / LoopedFormer prefill FLOPs)\n")


def step_time_report(seq, steps, micro_batch):
    import torch

    from megaloop import cpu_shim

    cpu_shim.enable()
    from megaloop.model.looped_gpt import build_model
    from megaloop.parallel.initialize import initialize_single_process

    initialize_single_process(seed=1)
    variants = {}
    for name, res in (("spiral {1/8,1/4,1/2,1}", "1/8,1/4,1/2,1"), ("looped {1,1}", "1,1"),
                      ("looped {1,1,1,1}", "1,1,1,1")):
        T = len(res.split(","))
        model_cfg = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4,
                                max_position_embeddings=seq, **LLAMA_STYLE)
        loop = LoopConfig(num_loops=T, num_prelude_layers=1, num_coda_layers=1, exit_loss="last",
                          loop_resolutions=res, loop_topology="mesh")
        variants[name] = build_model(model_cfg, loop, 512)
    ids = torch.randint(0, 512, (micro_batch, seq))
    pos = torch.arange(seq).expand(micro_batch, seq)
    times = {k: [] for k in variants}
    names = list(variants)
    for r in range(steps + 1):
        for k in names[r % 3:] + names[:r % 3]:
            model = variants[k]
            t0 = time.perf_counter()
            model(ids, pos, None, labels=ids).objective.mean().backward()
            if r:  # the first round warms up
                times[k].append(time.perf_counter() - t0)
            model.zero_grad()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"(b) CPU step time (forward + backward), 1 + 2 x {{...}} + 1, hidden 128, MeSH, "
          f"{micro_batch} x {seq} tokens, {torch.get_num_threads()} threads, median of {steps}")
    for k in names:
        print(f"  {k:<24} {med[k] * 1e3:8.1f} ms")
    s = med[names[0]]
    print(f"  spiral / looped {{1,1}}: {s / med[names[1]]:.3f}   spiral / looped {{1,1,1,1}}: "
          f"{s / med[names[2]]:.3f}")
    counted = {r: flops_per_iteration(*_small(r, seq), 512, seq, 1)
               for r in ("1/8,1/4,1/2,1", "1,1", "1,1,1,1")}
    print(f"  counted FLOP ratios of the same models: spiral / looped {{1,1}}: "
          f"{counted['1/8,1/4,1/2,1'] / counted['1,1']:.3f}   spiral / looped {{1,1,1,1}}: "
          f"{counted['1/8,1/4,1/2,1'] / counted['1,1,1,1']:.3f}")
    torch.distributed.destroy_process_group()


def _small(res, seq):
    model_cfg = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4,
                            max_position_embeddings=seq, **LLAMA_STYLE)
    loop = LoopConfig(num_loops=len(res.split(",")), num_prelude_layers=1, num_coda_layers=1,
                      exit_loss="last", loop_resolutions=res, loop_topology="mesh")
    return model_cfg, loop


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--cpu-seq-length", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip-timing", action="store_true")
    args = p.parse_args()
    flops_report(args.seq_length)
    if not args.skip_timing:
        step_time_report(args.cpu_seq_length, args.steps, args.micro_batch_size)


if __name__ == "__main__":
    main()
