"""Study 2, gate collapse and its cures: the exit gate without LR warmup at KL weights beta 0.05,
0.10 and 0.50, and with warmup at beta 0.15.

After "Closing the Loop" (arXiv 2610.00673) section 3.3 and App. B: without warmup and with a
small beta the gate collapses onto step 1 (p0 -> 1, the model trains as a one-step transformer);
warmup prevents it and a larger beta lets the gate recover. Reported: p0 over iterations against
the collapse threshold, whether the trainer's collapse alarm fired (p0 above the threshold for
--p0-collapse-iters iterations in a row), and the final per-step validation losses.

    python examples/studies/gate_collapse.py --size cpu --output-dir studies_out
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from study import Study, figure, md_table  # noqa: E402

SHAPE = {"tiny": (1, 3), "cpu": (2, 3), "gpu": (4, 4)}  # (K, T)
THRESHOLD = 0.95


def main(argv=None) -> int:
    study = Study("gate_collapse", __doc__, argv)
    K, T = SHAPE[study.size["name"]]
    # The alarm's patience: a tenth of the run (the trainer's default of 100 iterations is
    # longer than the small sizes' runs).
    patience = max(study.size["iters"] // 10, 1)
    common = ["--num-layers", str(K), "--num-loops", str(T), "--log-interval", "1",
              "--p0-collapse-threshold", str(THRESHOLD), "--p0-collapse-iters", str(patience)]
    arms = {f"no warmup, beta {b}": ["--exit-kl-beta", str(b), "--lr-warmup-iters", "0"]
            for b in (0.05, 0.10, 0.50)}
    arms["warmup, beta 0.15"] = ["--exit-kl-beta", "0.15"]
    runs = {arm: study.train(arm, common + flags) for arm, flags in arms.items()}

    rows = []
    fig, axes = figure(2)
    for arm, run in runs.items():
        train = [r for r in run["records"] if r["split"] == "train"]
        valid = [r for r in run["records"] if r["split"] == "valid"][-1]
        p0 = [r["p0"] for r in train]
        longest = max(r["p0_collapse_iters"] or 0 for r in train)
        rows.append([arm, p0[-1], max(p0), longest,
                     "yes" if longest >= patience else "no", valid["loss"],
                     valid["step_losses"], valid["exit_probs"]])
        axes[0].plot([r["iteration"] for r in train], p0, label=arm)
        axes[1].plot(range(1, T + 1), valid["step_losses"], "o-", label=arm)
    axes[0].axhline(THRESHOLD, color="grey", ls=":", label=f"collapse threshold {THRESHOLD}")
    axes[0].set_xlabel("iteration")
    axes[0].set_ylabel("p0 (exit after step 1)")
    axes[0].set_ylim(0, 1.02)
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("loop step")
    axes[1].set_ylabel("final validation loss")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    study.write(
        "Gate collapse and its cures",
        f"python examples/studies/gate_collapse.py --size {study.size['name']}",
        [f"Alarm: p0 > {THRESHOLD} for {patience} iterations in a row (--p0-collapse-iters).",
         md_table(["arm", "final p0", "max p0", "longest run above threshold", "alarm fired",
                   "final validation objective", "per-step validation loss",
                   "exit distribution"], rows)],
        figure=fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
