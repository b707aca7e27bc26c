"""Study 5, multi-resolution recursion: coarse-to-fine SpiralFormer loops (Anchor and MeSH) against
the full-resolution loop at the same layer allocation, loss against training FLOPs.

After "SpiralFormer" (arXiv 2602.11698): the core runs at resolutions 1/8, 1/4, 1/2, 1 of the
sequence across the loop steps, so a step costs less; the question is the loss reached per
training FLOP. Every arm is P + K x T + C with the same layers and tokens; FLOPs per iteration
are megaloop's count at each step's resolution (megaloop/training/metrics.py). Every arm trains
over the size's seeds; its final loss is compared with the full-resolution loop's (mean
difference, verdict).

    python examples/studies/multi_resolution.py --size cpu --output-dir studies_out
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from study import (PLATEAU_MARGIN, Study, figure, machine, md_table, spread,  # noqa: E402
                   unigram_entropy, verdict_cell)

SHAPE = {"tiny": (1, 1, 4), "cpu": (1, 2, 4), "gpu": (2, 4, 4)}  # (P = C, K, T)
SCHEDULE = "1/8,1/4,1/2,1"


def flops_per_iteration(argv: list) -> float:
    from megaloop.data.tokenizers import build_tokenizer
    from megaloop.training.metrics import flops_per_iteration as count
    from megaloop.training.run_config import parse_args

    cfg = parse_args(argv)
    vocab = build_tokenizer(cfg.tokenizer).vocab_size
    return count(cfg.model, cfg.loop, vocab, cfg.training.seq_length,
                 cfg.training.global_batch_size)


def main(argv=None) -> int:
    load_at_start = os.getloadavg()
    study = Study("multi_resolution", __doc__, argv)
    P, K, T = SHAPE[study.size["name"]]
    common = ["--num-layers", str(P + K + P), "--num-prelude-layers", str(P),
              "--num-coda-layers", str(P), "--num-loops", str(T), "--exit-loss", "last",
              "--step-norm-placement", "readout",
              # pre-norm: every arm leaves the initial plateau at this LR (ouro is slow here)
              "--norm-scheme", "pre"]
    spiral = ["--loop-resolutions", SCHEDULE, "--resolution-down", "self-aggregation",
              "--resolution-up", "allocation"]
    arms = {
        "full resolution (plain loop)": common,
        f"SpiralFormer {SCHEDULE}, Anchor": common + spiral + ["--loop-topology", "anchor"],
        f"SpiralFormer {SCHEDULE}, MeSH": common + spiral + ["--loop-topology", "mesh"],
    }
    runs = {arm: study.train_seeds(arm, flags) for arm, flags in arms.items()}
    base = next(iter(arms))
    final = {arm: [[r for r in run["records"] if r["split"] == "valid"][-1] for run in rs]
             for arm, rs in runs.items()}
    loss = {arm: [v["loss"] for v in vs] for arm, vs in final.items()}
    per_iter = {arm: flops_per_iteration(rs[0]["argv"]) for arm, rs in runs.items()}
    plateau = unigram_entropy(study.data_prefix)
    rows = []
    fig, axes = figure(1)
    for i, (arm, arm_runs) in enumerate(runs.items()):
        for j, run in enumerate(arm_runs):
            valid = [r for r in run["records"] if r["split"] == "valid"]
            axes[0].plot([r["iteration"] * per_iter[arm] for r in valid],
                         [r["loss"] for r in valid], "o-", color=f"C{i}", lw=1,
                         label=arm if j == 0 else None)
        rows.append([arm, f"{per_iter[arm]:.3e}", f"{per_iter[arm] / per_iter[base]:.3f}",
                     f"{per_iter[arm] * study.size['iters']:.3e}", spread(loss[arm]),
                     spread([v["step_losses"][-1] for v in final[arm]]),
                     f"{sum(r['seconds'] for r in arm_runs) / len(arm_runs):.0f}",
                     f"{sum(v < plateau - PLATEAU_MARGIN for v in loss[arm])} of {len(arm_runs)}",
                     "-" if arm == base else verdict_cell(loss[arm], loss[base])])
    axes[0].set_xscale("log")
    axes[0].set_xlabel("training FLOPs")
    axes[0].set_ylabel("validation loss")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    study.write(
        "Multi-resolution recursion (SpiralFormer) vs the full-resolution loop",
        f"python examples/studies/multi_resolution.py --size {study.size['name']}",
        [f"Layout {P} + {K} x {T} + {P}, pre-norm (every arm trains at LR "
         f"{study.size['lr']}; the ouro scheme is slow at it), same tokens for every arm. "
         f"Plateau: the corpus's unigram entropy, {plateau:.3f} nats; an arm left it when its "
         f"final validation loss is more than {PLATEAU_MARGIN} below (seeds where it did).",
         machine(load_at_start),
         md_table(["arm", "FLOPs / iteration", "vs full", "training FLOPs",
                   "final validation loss", "loss at the last step", "wall s per run",
                   "left the plateau", "loss vs full resolution"], rows)],
        figure=fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
