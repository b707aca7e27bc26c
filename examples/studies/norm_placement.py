"""Study 3, norm placement: ouro, pre, magic, post and sandwich norms in the looped core.

After "Closing the Loop" (arXiv 2610.00673) App. A: post-norm and sandwich-norm loops train worse
or plateau, and the per-step gradient norms show why (post-norm starves the first layers at the
later loop steps). Reported per scheme: the training loss curve, the final per-step validation
loss, the per-layer gradient norm at loop steps 1 and T (--log-grad-norm-per-step, last logged
iteration), and whether the loss plateaus: the second half of training lowered the training loss
by less than a tenth of what the first half did. Every scheme trains over the size's seeds; the
final objective of each is compared with pre-norm's (mean difference, verdict).

    python examples/studies/norm_placement.py --size cpu --output-dir studies_out
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from study import Study, figure, machine, md_table, spread, verdict_cell  # noqa: E402

SHAPE = {"tiny": (2, 2), "cpu": (3, 3), "gpu": (8, 4)}  # (K, T)
SCHEMES = ("ouro", "pre", "magic", "post", "sandwich")


def main(argv=None) -> int:
    load_at_start = os.getloadavg()
    study = Study("norm_placement", __doc__, argv)
    K, T = SHAPE[study.size["name"]]
    runs = {s: study.train_seeds(s, ["--num-layers", str(K), "--num-loops", str(T),
                                     "--norm-scheme", s, "--exit-kl-beta", "0.1",
                                     "--log-grad-norm-per-step",
                                     # enough logged points for the plateau test
                                     "--log-interval", str(max(study.size["iters"] // 20, 1))])
            for s in SCHEMES}

    def train_records(run):
        return [r for r in run["records"] if r["split"] == "train"]

    final = {s: [[r for r in run["records"] if r["split"] == "valid"][-1] for run in rs]
             for s, rs in runs.items()}
    objective = {s: [v["loss"] for v in vs] for s, vs in final.items()}
    rows, grad_rows = [], []
    fig, axes = figure(2)
    for i, (scheme, scheme_runs) in enumerate(runs.items()):
        drops, plateaus, first_norms, last_norms, ratios = [], [], [], [], []
        for j, run in enumerate(scheme_runs):
            train = train_records(run)
            losses = [r["loss"] for r in train]
            first, mid, last = losses[0], losses[len(losses) // 2], losses[-1]
            drops.append((first - mid, mid - last))
            plateaus.append((mid - last) < 0.1 * (first - mid))
            norms = next(r["grad_norm_per_step"] for r in reversed(train)
                         if r.get("grad_norm_per_step"))  # [layer][step]
            first_norms.append([layer[0] for layer in norms])
            last_norms.append([layer[-1] for layer in norms])
            ratios.append(norms[0][-1] / max(norms[-1][-1], 1e-30))
            axes[0].plot([r["iteration"] for r in train], losses, color=f"C{i}", lw=1,
                         label=scheme if j == 0 else None)
            axes[1].semilogy(range(1, K + 1), last_norms[-1], "o-", color=f"C{i}", lw=1,
                             label=f"{scheme}, step {T}" if j == 0 else None)
        n = len(scheme_runs)
        rows.append([scheme, spread(objective[scheme]),
                     " / ".join(spread([v["step_losses"][t] for v in final[scheme]])
                                for t in range(T)),
                     spread([d[0] for d in drops]), spread([d[1] for d in drops]),
                     f"{sum(plateaus)} of {n}",
                     "-" if scheme == "pre" else verdict_cell(objective[scheme],
                                                              objective["pre"])])
        grad_rows.append([scheme,
                          " / ".join(spread([f[layer] for f in first_norms]) for layer in range(K)),
                          " / ".join(spread([f[layer] for f in last_norms]) for layer in range(K)),
                          spread(ratios)])
    axes[0].set_xlabel("iteration")
    axes[0].set_ylabel("training objective")
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("core layer")
    axes[1].set_ylabel(f"gradient norm at loop step {T}")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    study.write(
        "Norm placement", f"python examples/studies/norm_placement.py --size "
                          f"{study.size['name']}",
        [machine(load_at_start),
         f"Layout {K} x {T}, LR {study.size['lr']} with warmup and cosine decay, exit KL beta "
         f"0.1; plateau: the second half lowered the training loss by less than a tenth of the "
         f"first half (seeds where it did).",
         md_table(["scheme", "final validation objective", "per-step validation loss",
                   "drop, first half", "drop, second half", "plateau",
                   "objective vs pre"], rows),
         "Per-layer gradient norm (last logged iteration), core layers 1..K:",
         md_table(["scheme", "at loop step 1", f"at loop step {T}",
                   f"layer 1 / layer {K} at step {T}"], grad_rows)],
        figure=fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
