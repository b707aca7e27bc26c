"""Study 1, loop vs dense: K x T looped against its parameter-matched (K layers) and
compute-matched (K*T layers) dense twins, same tokens.

After "Closing the Loop" (arXiv 2610.00673) section 5 and "What Makes Recurrence Effective in
Looped Language Models?" section 3: validation loss, per-step loss of the looped model, and
held-out task accuracy by k at inference depths 1..2T (the dense twins at their one depth).

    python examples/studies/loop_vs_dense.py --size cpu --output-dir studies_out
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from study import Study, accuracy_by_k, figure, md_table, valid_curve  # noqa: E402

SHAPE = {"tiny": (1, 2), "cpu": (2, 4), "gpu": (4, 4)}  # (K, T)


def main(argv=None) -> int:
    study = Study("loop_vs_dense", __doc__, argv)
    K, T = SHAPE[study.size["name"]]
    arms = {
        f"looped {K} x {T}": ["--num-layers", str(K), "--num-loops", str(T),
                              "--exit-kl-beta", "0.1"],
        f"dense {K} (same parameters)": ["--num-layers", str(K), "--num-loops", "1"],
        f"dense {K * T} (same compute)": ["--num-layers", str(K * T), "--num-loops", "1"],
    }
    runs = {arm: study.train(arm, flags) for arm, flags in arms.items()}
    looped = next(iter(arms))
    evals = {looped: study.evaluate(looped, runs[looped]["ckpt"], list(range(1, 2 * T + 1)))}
    for arm in list(arms)[1:]:
        evals[arm] = study.evaluate(arm, runs[arm]["ckpt"], [1])

    rows, acc_rows = [], []
    ks = sorted(accuracy_by_k(evals[looped]["depths"][0]["tasks"])) \
        if evals[looped]["depths"][0].get("tasks") else []
    for arm, ev in evals.items():
        final = [r for r in runs[arm]["records"] if r["split"] == "valid"][-1]
        trained = ev["trained_loops"]
        at_t = next(d for d in ev["depths"] if d["depth"] == trained)
        rows.append([arm, final["loss"], at_t["step_losses"],
                     at_t["tasks"]["overall"] if at_t.get("tasks") else "-"])
        for d in ev["depths"]:
            if d.get("tasks"):
                by_k = accuracy_by_k(d["tasks"])
                acc_rows.append([arm, d["depth"], d["regime"], d["loss"], d["tasks"]["overall"]]
                                + [by_k.get(k, "-") for k in ks])

    fig, axes = figure(2)
    for arm in arms:
        axes[0].plot(*valid_curve(runs[arm]["records"]), "o-", label=arm)
    axes[0].set_xlabel("iteration")
    axes[0].set_ylabel("validation loss")
    axes[0].legend(fontsize=8)
    depths = [d["depth"] for d in evals[looped]["depths"]]
    axes[1].plot(depths, [d["loss"] for d in evals[looped]["depths"]], "o-", label=looped)
    for arm in list(arms)[1:]:
        axes[1].axhline(evals[arm]["depths"][0]["loss"], ls=":", label=arm,
                        color="C1" if "parameters" in arm else "C2")
    axes[1].axvline(T, color="grey", lw=0.6)
    axes[1].set_xlabel("inference depth (loop steps)")
    axes[1].set_ylabel("held-out loss")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    study.write(
        "Loop vs dense", f"python examples/studies/loop_vs_dense.py --size {study.size['name']}",
        ["## Validation loss (same tokens)",
         md_table(["arm", "final validation loss", "per-step loss at T", "task accuracy at T"],
                  rows),
         "## Held-out loss and task accuracy by inference depth and k",
         md_table(["arm", "depth", "regime", "loss", "accuracy"] + [f"k={k}" for k in ks],
                  acc_rows)],
        figure=fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
