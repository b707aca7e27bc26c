"""Pictures of a training run from its ``--log-jsonl`` file (``tools/plot_run.py``).

One PNG with a panel per concern: per-step training and validation loss, the exit distribution
over time, p0 against the collapse threshold, the gradient norm, per-step gradient norms (where
``--log-grad-norm-per-step`` logged them), the learning rate, the loop geometry of the validation
passes, throughput and memory, and the stability counters. Every key the trainer logs is either
drawn or listed in ``NOT_DRAWN`` with the reason; a key this module does not know is reported, so
a new logged field cannot go unseen.

A diverged run logs NaN and infinity as null (megaloop/training/metrics.py): such points of the
loss and the gradient norm are marked at the top edge of their panel ("non-finite"), so a run that
diverged at once does not draw an empty panel. Every line has a label in its panel's legend.
"""

from __future__ import annotations

import json
import math
from typing import Optional

# key -> the panel that draws it
DRAWN = {
    "loss": "loss", "step_losses": "loss",
    "exit_probs": "exit distribution",
    "p0": "p0", "p0_collapse_iters": "p0",
    "grad_norm": "gradient norm", "skipped_iters": "gradient norm",
    "params_norm": "gradient norm",
    "grad_norm_per_step": "per-step gradient norm",
    "lr": "learning rate",
    "angular_distance": "geometry", "relative_update_norm": "geometry",
    "state_variance": "geometry",
    "tokens_per_sec": "throughput", "mem_gib": "throughput",
    "loss_spikes": "stability",
}
# key -> why it has no panel
NOT_DRAWN = {
    "iteration": "the x axis", "split": "selects train or validation records",
    "train_iters": "the run's length (the x range)",
    "consumed_samples": "proportional to the iteration",
    "ms_per_iter": "the inverse of tokens_per_sec (drawn)",
    "tflops_per_gpu": "proportional to tokens_per_sec at a fixed depth",
    "depth": "the loop count of the step (constant unless random depth is on)",
    "startup_s": "start-up seconds of a process (its first record): printed in the log",
    "elapsed_s": "wall time of the process's training so far: printed in the log",
    "eta_s": "estimated time left to --train-iters: printed in the log",
}


class NotARunLog(ValueError):
    """The file is not a megaloop --log-jsonl file."""


def read_run(path: str) -> list[dict]:
    """The records of a --log-jsonl file; NotARunLog naming the line otherwise."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise NotARunLog(f"{path}:{lineno}: not JSON; expected a megaloop --log-jsonl "
                                 f"file (one JSON record per logged iteration)") from None
            if not isinstance(record, dict) or not isinstance(record.get("iteration"), int) \
                    or record.get("split") not in ("train", "valid"):
                raise NotARunLog(f"{path}:{lineno}: not a megaloop log record (needs an integer "
                                 f"'iteration' and 'split' train or valid); expected the file "
                                 f"written by pretrain_looplm.py --log-jsonl")
            records.append(record)
    if not records:
        raise NotARunLog(f"{path}: no records; expected a megaloop --log-jsonl file")
    return records


def unknown_keys(records: list[dict]) -> list[str]:
    keys = {k for r in records for k in r}
    return sorted(keys - set(DRAWN) - set(NOT_DRAWN))


def _finite(value) -> bool:
    """A drawable value: a finite number, or a list (per-step values, checked one by one)."""
    if isinstance(value, list):
        return True
    return isinstance(value, (int, float)) and math.isfinite(value)


def _series(records, key):
    """(iterations, values) of the records holding a finite ``key``."""
    pairs = [(r["iteration"], r[key]) for r in records if key in r and _finite(r[key])]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _non_finite(records, key) -> list:
    """Iterations whose record has ``key`` without a finite value (NaN and infinity are logged as
    null; a hand-written file may hold NaN or Infinity)."""
    return [r["iteration"] for r in records if key in r and not _finite(r[key])]


def _mark_non_finite(ax, iterations: list, what: str, color: str, marker: str = "v") -> None:
    """Markers at the top edge of ``ax`` (x: iteration, y: the axes' height), labelled."""
    if iterations:
        ax.plot(iterations, [0.97] * len(iterations), marker, color=color, ms=6, ls="none",
                clip_on=False, transform=ax.get_xaxis_transform(),
                label=f"{what} non-finite ({len(iterations)})")


def _legend(ax, *twins, **kw) -> None:
    """One legend on ``ax`` for its lines and those of its twin axes."""
    handles, labels = [], []
    for a in (ax, *twins):
        h, lab = a.get_legend_handles_labels()
        handles += h
        labels += lab
    if handles:
        ax.legend(handles, labels, **kw)


def _per_step(values):
    """[[v_1..v_T] per record] -> per step t, the values (NaN where a record has fewer steps)."""
    width = max(len(v) for v in values)
    return [[v[t] if t < len(v) and v[t] is not None else math.nan for v in values]
            for t in range(width)]


def plot_run(records: list[dict], output: str, p0_threshold: float = 0.95,
             title: Optional[str] = None) -> list[str]:
    """Draw the run into ``output`` (PNG); returns the panels drawn."""
    import matplotlib.pyplot as plt

    fig, drawn = draw_run(records, p0_threshold, title)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return drawn


def draw_run(records: list[dict], p0_threshold: float = 0.95, title: Optional[str] = None):
    """(the matplotlib figure of the run, the panels drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r["split"] == "train"]
    valid = [r for r in records if r["split"] == "valid"]
    fig, axes = plt.subplots(3, 3, figsize=(16, 12))
    axes = axes.flatten()
    drawn = []

    def panel(i, name, ylabel):
        ax = axes[i]
        ax.set_title(name)
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        drawn.append(name)
        return ax

    ax = panel(0, "loss", "LM loss")
    for recs, style, tag in ((train, "-", "train"), (valid, "o--", "valid")):
        x, v = _series(recs, "loss")
        if x:
            ax.plot(x, v, style, color="black", lw=1.5, label=f"{tag} objective")
        x, steps = _series(recs, "step_losses")
        for t, ys in enumerate(_per_step(steps) if x else []):
            ax.plot(x, ys, style, color=f"C{t}", lw=0.8, alpha=0.8, label=f"{tag} step {t + 1}")
        _mark_non_finite(ax, _non_finite(recs, "loss"), f"{tag} loss", "red",
                         "v" if tag == "train" else "s")
    _legend(ax, fontsize=6, ncol=2)

    ax = panel(1, "exit distribution", "p_t (train)")
    x, probs = _series(train, "exit_probs")
    if x:
        ax.stackplot(x, _per_step(probs), labels=[f"p_{t + 1}" for t in range(
            max(len(p) for p in probs))])
        ax.set_ylim(0, 1)
        ax.legend(fontsize=6, loc="upper right")
    else:
        ax.text(0.5, 0.5, "no exit gate", ha="center", transform=ax.transAxes)

    ax = panel(2, "p0", "p0 (exit after step 1)")
    x, p0 = _series(train, "p0")
    if x:
        ax.plot(x, p0, color="tab:red", label="p0")
        ax.axhline(p0_threshold, color="grey", ls=":", label=f"collapse threshold {p0_threshold}")
        ax.set_ylim(0, 1.02)
        xc, run = _series(train, "p0_collapse_iters")
        twins = []
        if xc and max(run) > 0:
            twins.append(ax.twinx())
            twins[0].plot(xc, run, color="tab:purple", lw=0.8, label="iterations above")
            twins[0].set_ylabel("iterations in a row above the threshold")
        _legend(ax, *twins, fontsize=7)

    ax = panel(3, "gradient norm", "global gradient norm")
    x, g = _series(train, "grad_norm")
    ax.plot(x, g, color="tab:blue", label="grad norm")
    ax.set_yscale("log")
    xp, params = _series(train, "params_norm")  # --log-params-norm
    if xp:
        ax.plot(xp, params, color="tab:gray", label="params norm")
    _mark_non_finite(ax, _non_finite(train, "grad_norm"), "grad norm", "red")
    xs, skipped = _series(train, "skipped_iters")
    twins = []
    if xs and max(skipped) > 0:
        twins.append(ax.twinx())
        twins[0].plot(xs, skipped, color="tab:orange", label="skipped steps (total)")
        twins[0].set_ylabel("skipped steps (total)")
    _legend(ax, *twins, fontsize=7)

    ax = panel(4, "per-step gradient norm", "norm over core layers")
    x, per = _series(train, "grad_norm_per_step")  # [layer][step] per record
    if x:
        steps = max(len(layer) for rec in per for layer in rec)
        for t in range(steps):
            ax.plot(x, [math.sqrt(sum(layer[t] ** 2 for layer in rec if t < len(layer)))
                        for rec in per], label=f"step {t + 1}")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "not logged (--log-grad-norm-per-step)", ha="center",
                transform=ax.transAxes)

    ax = panel(5, "learning rate", "lr")
    ax.plot(*_series(train, "lr"), color="tab:green", label="lr")
    _legend(ax, fontsize=7)

    ax = panel(6, "geometry", "validation, per step")
    styles = {"angular_distance": "-", "relative_update_norm": "--", "state_variance": ":"}
    for key, style in styles.items():
        x, vals = _series(valid, key)
        for t, ys in enumerate(_per_step(vals) if x else []):
            ax.plot(x, ys, style, color=f"C{t}", lw=1, label=f"{key} step {t + 1}")
    if any(_series(valid, k)[0] for k in styles):
        ax.set_yscale("log")
        ax.legend(fontsize=5, ncol=2)
    else:
        ax.text(0.5, 0.5, "no validation geometry", ha="center", transform=ax.transAxes)

    ax = panel(7, "throughput", "tokens/s")
    ax.plot(*_series(train, "tokens_per_sec"), color="tab:cyan", label="tokens/s")
    xm, mem = _series(train, "mem_gib")
    twins = []
    if xm:
        twins.append(ax.twinx())
        twins[0].plot(xm, mem, color="tab:brown", label="peak memory (GiB)")
        twins[0].set_ylabel("peak memory (GiB)")
    _legend(ax, *twins, fontsize=7)

    ax = panel(8, "stability", "loss spikes (total)")
    ax.step(*_series(train, "loss_spikes"), where="post", color="tab:red",
            label="loss spikes (total)")
    _legend(ax, fontsize=7)

    fig.suptitle(title or "megaloop run")
    fig.tight_layout()
    return fig, drawn
