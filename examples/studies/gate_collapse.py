"""Study 2, gate collapse and its cures: the exit gate trained at a constant LR from the first
step (no warmup) with a small KL weight, against a larger KL weight and against warmup.

After "Closing the Loop" (arXiv 2610.00673) section 3.3 and App. B: its no-warmup beta 0.05 run,
at a constant LR at its peak, collapses onto step 1 (p0 -> 1.00, the model trains as a one-step
transformer); warmup prevents it and a larger beta lets the gate recover. Arms: constant LR, no
warmup, beta 0.05 (the collapse regime) and beta 0.5 (the larger KL weight), and warmup + cosine
decay with beta 0.05, each at the size's LR and at 3 times it (the gate saturates only at the
higher one here). Every arm is pre-norm (it trains at the size's LR; the norm study compares
schemes) over the size's seeds. Reported: p0 over iterations per seed against the collapse
threshold, whether the trainer's collapse alarm fired (p0 above the threshold for
--p0-collapse-iters iterations in a row), the final p0 and per-step validation losses, and the
final p0 against the warmup arm's at the same peak LR with a verdict.

    python examples/studies/gate_collapse.py --size cpu --output-dir studies_out
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from study import Study, figure, md_table, spread, verdict_cell  # noqa: E402

SHAPE = {"tiny": (1, 3), "cpu": (2, 3), "gpu": (4, 4)}  # (K, T)
THRESHOLD = 0.95
# The collapse needs an LR at which the gate saturates; the size's LR is the first arm's, this
# multiple of it the second's.
HIGH_LR = 3


def main(argv=None) -> int:
    study = Study("gate_collapse", __doc__, argv)
    K, T = SHAPE[study.size["name"]]
    # The alarm's patience: a tenth of the run (the trainer's default of 100 iterations is
    # longer than the small sizes' runs).
    patience = max(study.size["iters"] // 10, 1)
    common = ["--num-layers", str(K), "--num-loops", str(T), "--log-interval", "1",
              "--norm-scheme", "pre",
              "--p0-collapse-threshold", str(THRESHOLD), "--p0-collapse-iters", str(patience)]
    constant = ["--lr-decay-style", "constant", "--lr-warmup-iters", "0"]
    high = study.size["lr"] * HIGH_LR
    at_high = ["--lr", str(high), "--min-lr", str(high / 10)]
    arms = {"constant LR, no warmup, beta 0.05": constant + ["--exit-kl-beta", "0.05"],
            f"constant LR x{HIGH_LR}, no warmup, beta 0.05": constant + [
                "--exit-kl-beta", "0.05"] + at_high,
            "constant LR, no warmup, beta 0.5": constant + ["--exit-kl-beta", "0.5"],
            f"constant LR x{HIGH_LR}, no warmup, beta 0.5": constant + [
                "--exit-kl-beta", "0.5"] + at_high,
            "warmup + cosine, beta 0.05": ["--exit-kl-beta", "0.05"],
            f"warmup + cosine, LR x{HIGH_LR}, beta 0.05": ["--exit-kl-beta", "0.05"] + at_high}
    # each arm against the warmup arm at its own peak LR
    baselines = {arm: f"warmup + cosine, LR x{HIGH_LR}, beta 0.05" if f"x{HIGH_LR}" in arm
                 else "warmup + cosine, beta 0.05" for arm in arms}
    runs = {arm: study.train_seeds(arm, common + flags) for arm, flags in arms.items()}

    def train_records(run):
        return [r for r in run["records"] if r["split"] == "train"]

    def final_valid(run):
        return [r for r in run["records"] if r["split"] == "valid"][-1]

    final_p0 = {arm: [train_records(r)[-1]["p0"] for r in rs] for arm, rs in runs.items()}
    rows = []
    fig, axes = figure(2)
    for i, (arm, arm_runs) in enumerate(runs.items()):
        longest = [max(r["p0_collapse_iters"] or 0 for r in train_records(run))
                   for run in arm_runs]
        valid = [final_valid(run) for run in arm_runs]
        rows.append([arm, spread(final_p0[arm]),
                     spread([max(r["p0"] for r in train_records(run)) for run in arm_runs]),
                     spread([float(n) for n in longest], 1),
                     f"{sum(n >= patience for n in longest)} of {len(longest)}",
                     spread([v["loss"] for v in valid]),
                     " / ".join(spread([v["step_losses"][t] for v in valid])
                                for t in range(T)),
                     "-" if arm == baselines[arm] else
                     verdict_cell(final_p0[arm], final_p0[baselines[arm]])])
        for j, run in enumerate(arm_runs):
            train = train_records(run)
            axes[0].plot([r["iteration"] for r in train], [r["p0"] for r in train],
                         color=f"C{i}", lw=1, label=arm if j == 0 else None)
            axes[1].plot(range(1, T + 1), final_valid(run)["step_losses"], "o-", color=f"C{i}",
                         lw=1, label=arm if j == 0 else None)
    axes[0].axhline(THRESHOLD, color="grey", ls=":", label=f"collapse threshold {THRESHOLD}")
    axes[0].set_xlabel("iteration")
    axes[0].set_ylabel("p0 (exit after step 1), one line per seed")
    axes[0].set_ylim(0, 1.02)
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("loop step")
    axes[1].set_ylabel("final validation loss, one line per seed")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    study.write(
        "Gate collapse and its cures",
        f"python examples/studies/gate_collapse.py --size {study.size['name']}",
        [f"Layout {K} x {T}, pre-norm, peak LR {study.size['lr']} (x{HIGH_LR}: {high:g}), "
         f"{study.size['iters']} iterations; alarm: p0 > {THRESHOLD} for {patience} iterations "
         f"in a row (--p0-collapse-iters).",
         md_table(["arm", "final p0", "max p0", "longest run above threshold", "alarm fired",
                   "final validation objective", "per-step validation loss",
                   "final p0 vs warmup + cosine at the same peak LR"], rows)],
        figure=fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
