"""Study 6, extrapolation: BaseLoop vs CoreLoop vs channel-wise history injection with loop
gating, scored under, at and beyond the training horizon.

After "What Makes Recurrence Effective in Looped Language Models?" sections 3-5: BaseLoop loops
the whole stack; CoreLoop keeps a prelude and a coda outside the loop; the third arm adds
channel-wise history-state injection (window 2) and loop gating to CoreLoop. All train with the
last-step loss (no exit gate) at the same T on the same tokens and the same physical layers, then
run at inference depths 1..2T (with T+1 and 2T beyond the horizon): held-out loss and accuracy by
k on the reasoning data (a 16-cell row after k = 1..6 steps of a rule-30 automaton, as in
loop_vs_dense.py). Every arm is pre-norm (it trains at this LR) over the size's seeds; accuracy
at each depth is compared with the arm's own at the trained depth T (mean difference, verdict),
which is what extrapolation asks: does looping past the horizon keep, gain or lose accuracy.

    python examples/studies/extrapolation.py --size cpu --output-dir studies_out
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from study import (Study, accuracy_by_k, figure, mean_sd, md_table, spread,  # noqa: E402
                   verdict_cell)

# (physical layers, core layers of CoreLoop, T)
SHAPE = {"tiny": (3, 1, 3), "cpu": (4, 2, 3), "gpu": (8, 4, 4)}
ITERS = {"tiny": 8, "cpu": 3000, "gpu": 5000}  # as loop_vs_dense.py


def main(argv=None) -> int:
    study = Study("extrapolation", __doc__, argv, corpus="automaton")
    L, K, T = SHAPE[study.size["name"]]
    edge = str((L - K) // 2)
    common = ["--num-layers", str(L), "--num-loops", str(T), "--exit-loss", "last",
              "--norm-scheme", "pre"]
    core = ["--num-prelude-layers", edge, "--num-coda-layers", edge]
    arms = {
        f"BaseLoop {L} x {T}": common,
        f"CoreLoop {edge} + {K} x {T} + {edge}": common + core,
        "CoreLoop + history injection + loop gating": common + core + [
            "--history-injection", "channel-wise", "--history-window", "2",
            "--timestep-conditioning", "loop-gating"],
    }
    depths = list(range(1, 2 * T + 1))
    iters = ITERS[study.size["name"]]
    runs = {arm: study.train_seeds(arm, flags + ["--lr-warmup-iters", str(max(iters // 20, 1))],
                                   iters=iters) for arm, flags in arms.items()}
    evals = {arm: [study.evaluate(arm, run["ckpt"], depths, seed=run["seed"]) for run in rs]
             for arm, rs in runs.items()}

    def overall(arm_evals, depth):  # per seed
        return [ev["depths"][depth - 1]["tasks"]["overall"] for ev in arm_evals]

    rows = []
    fig, axes = figure(2)
    for i, (arm, arm_evals) in enumerate(evals.items()):
        for depth in depths:
            cells = [ev["depths"][depth - 1] for ev in arm_evals]
            by_k = [accuracy_by_k(c["tasks"]) for c in cells]
            rows.append([arm, depth, cells[0]["regime"], spread([c["loss"] for c in cells]),
                         spread(overall(arm_evals, depth)),
                         "-" if depth == T else verdict_cell(overall(arm_evals, depth),
                                                             overall(arm_evals, T)),
                         " ".join(f"k{k}:{mean_sd([b[k] for b in by_k])[0]:.2f}"
                                  for k in sorted(by_k[0]))])
        loss = [mean_sd([ev["depths"][d - 1]["loss"] for ev in arm_evals]) for d in depths]
        acc = [mean_sd(overall(arm_evals, d)) for d in depths]
        axes[0].errorbar(depths, [m for m, _ in loss], yerr=[0 if s != s else s for _, s in loss],
                         fmt="o-", capsize=3, label=arm, color=f"C{i}")
        axes[1].errorbar(depths, [m for m, _ in acc], yerr=[0 if s != s else s for _, s in acc],
                         fmt="o-", capsize=3, label=arm, color=f"C{i}")
    for ax, label in zip(axes, ("held-out loss", "task accuracy")):
        ax.axvline(T, color="grey", ls=":", lw=0.8)
        ax.set_xlabel("inference depth (loop steps)")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    study.write(
        "Extrapolation beyond the training horizon",
        f"python examples/studies/extrapolation.py --size {study.size['name']}",
        [f"Trained at T = {T} on k steps of a 16-cell rule-30 automaton (the whole row scored: "
         f"guessing gets none right), pre-norm, LR "
         f"{study.size['lr']} with warmup and cosine decay, {iters} iterations; depths > T "
         f"extrapolate. Accuracy by k: means over the seeds.",
         md_table(["arm", "depth", "regime", "loss", "accuracy", f"accuracy vs depth {T}",
                   "accuracy by k"], rows)],
        figure=fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
