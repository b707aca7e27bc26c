"""Study 6, extrapolation: BaseLoop vs CoreLoop vs channel-wise history injection with loop
gating, scored under, at and beyond the training horizon.

After "What Makes Recurrence Effective in Looped Language Models?" sections 3-5: BaseLoop loops
the whole stack; CoreLoop keeps a prelude and a coda outside the loop; the third arm adds
channel-wise history-state injection (window 2) and loop gating to CoreLoop. All train with the
last-step loss (no exit gate) at the same T on the same tokens and the same physical layers, then
run at inference depths 1..2T (with T+1 and 2T beyond the horizon): held-out loss and task
accuracy by k.

    python examples/studies/extrapolation.py --size cpu --output-dir studies_out
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from study import Study, accuracy_by_k, figure, md_table  # noqa: E402

# (physical layers, core layers of CoreLoop, T)
SHAPE = {"tiny": (3, 1, 3), "cpu": (4, 2, 3), "gpu": (8, 4, 4)}


def main(argv=None) -> int:
    study = Study("extrapolation", __doc__, argv)
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
    runs = {arm: study.train(arm, flags) for arm, flags in arms.items()}
    evals = {arm: study.evaluate(arm, run["ckpt"], depths) for arm, run in runs.items()}

    rows = []
    fig, axes = figure(2)
    for i, (arm, ev) in enumerate(evals.items()):
        for d in ev["depths"]:
            by_k = accuracy_by_k(d["tasks"]) if d.get("tasks") else {}
            rows.append([arm, d["depth"], d["regime"], d["loss"],
                         d["tasks"]["overall"] if d.get("tasks") else "-",
                         " ".join(f"k{k}:{a:.2f}" for k, a in by_k.items())])
        axes[0].plot(depths, [d["loss"] for d in ev["depths"]], "o-", label=arm, color=f"C{i}")
        if ev["depths"][0].get("tasks"):
            axes[1].plot(depths, [d["tasks"]["overall"] for d in ev["depths"]], "o-", label=arm,
                         color=f"C{i}")
    for ax, label in zip(axes, ("held-out loss", "task accuracy")):
        ax.axvline(T, color="grey", ls=":", lw=0.8)
        ax.set_xlabel("inference depth (loop steps)")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    study.write(
        "Extrapolation beyond the training horizon",
        f"python examples/studies/extrapolation.py --size {study.size['name']}",
        [f"Trained at T = {T}; depths > T extrapolate.",
         md_table(["arm", "depth", "regime", "loss", "accuracy", "accuracy by k"], rows)],
        figure=fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
