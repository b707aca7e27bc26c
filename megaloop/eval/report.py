"""The depth sweep's report: a Markdown table, a JSON file and PNG plots."""

from __future__ import annotations

import json
import os

from megaloop.eval.sweep import DepthResult, as_json


def _f(x, digits=4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(results: list[DepthResult], meta: dict) -> str:
    """Summary per depth, then per-step losses, the exit distribution and the geometry."""
    rules = list(results[0].rules) if results else []
    lines = [f"# Depth sweep: {meta['load']}", "",
             f"Data: {meta['data']}. Trained loop count T = {meta['trained_loops']}.", "",
             "| depth | regime | loss | perplexity | E[exit step] | "
             + " | ".join(f"{r} loss (mean depth)" for r in rules) + " |",
             "|---:|---|---:|---:|---:|" + "---:|" * len(rules)]
    for r in results:
        cells = [str(r.depth), r.regime, _f(r.loss), _f(r.perplexity, 2),
                 _f(r.expected_exit_step, 2)]
        cells += [f"{_f(r.rules[x]['loss'])} ({r.rules[x]['mean_depth']:.2f})" for x in rules]
        lines.append("| " + " | ".join(cells) + " |")
    width = max(r.depth for r in results)
    header = "| depth | " + " | ".join(f"step {t}" for t in range(1, width + 1)) + " |"
    rule = "|---:|" + "---:|" * width

    def table(title, row_of):
        out = ["", f"## {title}", "", header, rule]
        for r in results:
            values = row_of(r)
            if values is None:
                continue
            out.append(f"| {r.depth} | " + " | ".join(
                [_f(v) for v in values] + [""] * (width - len(values))) + " |")
        return out if len(out) > 5 else []

    if results and results[0].tasks:
        cols = [(f, k) for f, ks in results[0].tasks["by_family"].items() for k in ks]
        lines += ["", "## Held-out task accuracy (by family and k)", "",
                  "| depth | all | " + " | ".join(f"{f} k={k}" for f, k in cols) + " |",
                  "|---:|---:|" + "---:|" * len(cols)]
        for r in results:
            lines.append(f"| {r.depth} | {r.tasks['overall']:.3f} | " + " | ".join(
                f"{r.tasks['by_family'][f][k]:.2f}" for f, k in cols) + " |")
        counts = results[0].tasks["count"]
        lines += ["", "Problems per cell: " + ", ".join(
            f"{f} k={k}: {n}" for f, ks in counts.items() for k, n in ks.items()) + "."]
    lines += table("LM loss per step", lambda r: r.step_losses)
    lines += table("Exit distribution p_t", lambda r: r.exit_probs)
    for key, title in (("angular_distance", "Angular distance between a step's input and output"),
                       ("relative_update_norm", "Relative update norm"),
                       ("state_variance", "State variance (relative to the last step)")):
        lines += table(title, lambda r, key=key: r.geometry.get(key))
    return "\n".join(lines) + "\n"


def plot(results: list[DepthResult], meta: dict, out_dir: str) -> list[str]:
    """loss_vs_depth.png and exit_distribution.png; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trained = meta["trained_loops"]
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    depths = [r.depth for r in results]
    ax.plot(depths, [r.loss for r in results], "o-", color="black", lw=2,
            label="loss at the last step")
    for r in results:
        ax.plot(range(1, r.depth + 1), r.step_losses, lw=0.8, alpha=0.6,
                label=f"per step, depth {r.depth}")
    for name in (results[0].rules if results else {}):
        ax.plot([r.rules[name]["mean_depth"] for r in results],
                [r.rules[name]["loss"] for r in results], "x--", label=f"exit {name}")
    ax.axvline(trained, color="grey", ls=":", label=f"training horizon T = {trained}")
    ax.set_xlabel("loop steps (inference depth)")
    ax.set_ylabel("LM loss (nats/token)")
    ax.set_title("Loss vs inference depth")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "loss_vs_depth.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    gated = [r for r in results if r.exit_probs is not None]
    if gated:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        width = 0.8 / len(gated)
        for i, r in enumerate(gated):
            ax.bar([t + 1 + (i - (len(gated) - 1) / 2) * width for t in range(r.depth)],
                   r.exit_probs, width=width, label=f"depth {r.depth} "
                   f"(E[exit] {r.expected_exit_step:.2f})")
        ax.set_xlabel("exit step t")
        ax.set_ylabel("mean p_t")
        ax.set_title("Exit distribution per inference depth")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "exit_distribution.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def write(results: list[DepthResult], meta: dict, out_dir: str, plots: bool) -> list[str]:
    """depth_sweep.json, depth_sweep.md and (``plots``) the PNGs; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "depth_sweep.json"), os.path.join(out_dir, "depth_sweep.md")]
    with open(paths[0], "w") as f:
        json.dump(as_json(results, meta), f, indent=1)
    with open(paths[1], "w") as f:
        f.write(markdown(results, meta))
    if plots:
        paths += plot(results, meta, out_dir)
    return paths
