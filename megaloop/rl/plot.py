"""The picture of an RL run (train_rl.py --log-jsonl), drawn by tools/plot_run.py when the records
are RL ones: the telemetry megaloop/rl/telemetry.py logs, one panel per question Closing the Loop
Appendix C asks of it (is the solve rate in the band where RL helps, how many groups carry no
signal, is the policy moving: KL and gradient norm, how long are the answers, how do the loop
steps' log-probs and the exit distribution change)."""

from __future__ import annotations

from typing import Optional

# key -> the panel that draws it; the other keys of an RL record are not drawn.
PANELS = {"reward_mean": "reward and solve rate", "solve_rate": "reward and solve rate",
          "uniform_reward_groups": "groups with equal rewards", "kl": "KL to the reference",
          "grad_norm": "gradient norm", "response_length": "response length",
          "step_log_probs": "log-prob per loop step", "exit_probs": "exit distribution",
          "loss": "loss", "clip_fraction": "loss"}


def is_rl_run(records: list[dict]) -> bool:
    """Whether the records are train_rl.py's (they carry the reward)."""
    return any("reward_mean" in r for r in records)


def _series(records, key):
    rows = [(r["iteration"], r[key]) for r in records if r.get(key) is not None]
    return [x for x, _ in rows], [v for _, v in rows]


def draw_rl_run(records: list[dict], title: Optional[str] = None):
    """(the matplotlib figure, the panels drawn, in order)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r["split"] == "train"]
    names = list(dict.fromkeys(PANELS.values()))
    fig, axes = plt.subplots(2, 4, figsize=(20, 9))
    axes = dict(zip(names, axes.flatten()))
    for name, ax in axes.items():
        ax.set_title(name)
        ax.set_xlabel("RL step")
    for key, label in (("reward_mean", "reward mean"), ("solve_rate", "solve rate")):
        axes["reward and solve rate"].plot(*_series(train, key), label=label)
    for key, name in (("uniform_reward_groups", "groups with equal rewards"),
                      ("kl", "KL to the reference"), ("grad_norm", "gradient norm"),
                      ("response_length", "response length"), ("loss", "loss")):
        axes[name].plot(*_series(train, key), label=key)
    axes["loss"].plot(*_series(train, "clip_fraction"), label="clip_fraction")
    for key, name in (("step_log_probs", "log-prob per loop step"),
                      ("exit_probs", "exit distribution")):
        x, v = _series(train, key)
        for t in range(max((len(row) for row in v), default=0)):
            axes[name].plot(x, [row[t] for row in v], label=f"t={t + 1}")
    for ax in axes.values():
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", transform=ax.transAxes)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig, names


def plot_rl_run(records: list[dict], output: str, title: Optional[str] = None) -> list[str]:
    """Draw the RL run into ``output`` (PNG); returns the panels drawn."""
    import matplotlib.pyplot as plt

    fig, names = draw_rl_run(records, title)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return names
