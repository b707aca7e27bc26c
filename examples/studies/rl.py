"""RL after mid-training: GRPO against RLTT (exit_pdf loop weights) from the mid-trained
checkpoints of examples/studies/midtrain.py, on demo-task problems the checkpoints solve
sometimes; held-out accuracy before and after, and the RL telemetry.

After "Closing the Loop" (arXiv 2610.00673) Appendix C, which runs RL on its mid-trained LoopLM
and finds that it helps only when the rollout solve rate is neither too low nor too high (all
rewards of a group equal: no learning signal), and "Prioritize the Process, Not Just the
Outcome" (RLTT: the log-probability of a sampled token as sum_t w_t log P^(t) over the loop
steps, here with w the model's own exit distribution, detached; GRPO reads the last step only).

The problems: the mid-training study's held-out accuracy by (family, k) of the mid-trained
checkpoints (mean over seeds, at the trained depth) picks one family and the k at which it lies
between 20% and 60% (the family with most such k; if there is none, the (family, k) closest to
40%, said in the table). Training prompts and held-out problems of that family and those k are
generated with two more seeds of ``make_demo_corpus.py`` (neither the corpus', nor the SFT
pairs', nor the mid-training study's held-out problems'). Seed s of each arm starts from the
mid-trained checkpoint of seed s and runs ``train_rl.py`` (megaloop/rl/train.py) for the size's
steps; both arms share every other setting. Held-out accuracy is the exact greedy answer
(``tools/evaluate.py --task-file``) at the trained depth, before (the mid-trained checkpoint) and
after; gains get the project's verdict (the spread includes the checkpoints' own). Telemetry per
step (reward, solve rate, equal-reward groups, KL to the reference, gradient norm) is plotted for
every seed.

    python examples/studies/rl.py --size cpu --output-dir studies_out
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import midtrain  # noqa: E402
from study import (ROOT, Study, in_child, mean_sd, md_table, spread,  # noqa: E402
                   verdict_cell, _quietly)

# RL steps, prompts (groups) per step, group size, held-out and training problems per k
RL = {"tiny": dict(steps=2, prompts=4, group=4, heldout=16, train=40),
      "cpu": dict(steps=30, prompts=16, group=8, heldout=100, train=400),
      "gpu": dict(steps=200, prompts=32, group=8, heldout=400, train=5000)}
MAX_NEW_TOKENS = 4  # " 14." and the end of document: an answer is at most 4 tokens here
TEMPERATURE = 0.9   # Closing the Loop's
LR_FRACTION = 1 / 30  # of the size's pretraining LR, constant (no warmup: few steps)
RANGE = (0.2, 0.6)
LAST = 5  # the table's telemetry after RL: the mean over each run's last LAST steps
TRAIN_SEED, HELDOUT_SEED = 31, 41
ARMS = {"GRPO": ["--objective", "grpo"],
        "RLTT (exit_pdf)": ["--objective", "rltt", "--loop-weighting", "exit_pdf"]}
TELEMETRY = [("reward_mean", "reward mean"), ("solve_rate", "solve rate"),
             ("uniform_reward_groups", "groups with equal rewards"),
             ("kl", "KL to the reference (k3)"), ("grad_norm", "gradient norm")]


def pick_problems(evals: list, T: int) -> tuple[str, list, dict, bool]:
    """(family, ks, {(family, k): mean accuracy}, whether in RANGE) from the mid-trained
    checkpoints' evaluations."""
    cells = {}
    for ev in evals:
        tasks = next(d for d in ev["depths"] if d["depth"] == T)["tasks"]
        for family, by_k in tasks["by_family"].items():
            for k, acc in by_k.items():
                cells.setdefault((family, int(k)), []).append(acc)
    means = {cell: sum(v) / len(v) for cell, v in cells.items()}
    inside = {}
    for (family, k), acc in means.items():
        if RANGE[0] <= acc <= RANGE[1]:
            inside.setdefault(family, []).append(k)
    if inside:
        family = max(inside, key=lambda f: (len(inside[f]), -sum(
            abs(means[(f, k)] - 0.4) for k in inside[f])))
        return family, sorted(inside[family]), means, True
    family, k = min(means, key=lambda cell: abs(means[cell] - 0.4))
    return family, [k], means, False


def problems(study: Study, family: str, ks: list) -> tuple[str, str]:
    """Training prompts and held-out problems of ``family`` at ``ks`` (generated once); their
    paths."""
    data = os.path.dirname(study.data_prefix)
    r = RL[study.size["name"]]
    paths = {}
    for name, seed, per_k in (("train", TRAIN_SEED, r["train"]),
                              ("heldout", HELDOUT_SEED, r["heldout"])):
        path = os.path.join(data, f"rl_{name}_{family}_{'_'.join(map(str, ks))}.jsonl")
        if not os.path.isfile(path):
            in_child(_quietly, _make_problems, path + ".log", path, family, ks, seed, per_k)
        paths[name] = path
    return paths["train"], paths["heldout"]


def _make_problems(path: str, family: str, ks: list, seed: int, per_k: int) -> bool:
    from megaloop.cli import make_demo_corpus as tool  # tools/make_demo_corpus.py's command

    # k is uniform on 1..max(ks): enough problems that every wanted k has per_k of them
    raw = path + ".all"
    tool.main(["--output", path + ".unused", "--num-docs", "1", "--families", family,
               "--max-steps", str(max(ks)), "--tasks-output", raw,
               "--num-tasks", str(3 * per_k * max(ks)), "--seed", str(seed)])
    counts = dict.fromkeys(ks, 0)
    with open(raw) as src, open(path + ".tmp", "w") as dst:
        for line in src:
            k = json.loads(line)["k"]
            if k in counts and counts[k] < per_k:
                counts[k] += 1
                dst.write(line)
    os.replace(path + ".tmp", path)
    for extra in (raw, path + ".unused"):
        os.remove(extra)
    return True


def _train_rl(argv):
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_rl", os.path.join(ROOT, "train_rl.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    code = tool.main(argv)
    if code != 0:
        raise RuntimeError(f"train_rl.py exited {code}")
    return code


def train_rl(study: Study, arm: str, argv: list, seed: int) -> dict:
    """One RL run (reused when it finished before with the same flags); like Study.train."""
    start = time.time()
    d, ckpt, log, _, ran = study.run_once(arm, seed, argv, _train_rl)
    timing = os.path.join(d, "seconds.json")
    if ran:
        with open(timing, "w") as f:  # the run's own wall time, for the table when reused
            json.dump(time.time() - start, f)
    records = [json.loads(line) for line in open(log)]
    seconds = json.load(open(timing)) if os.path.isfile(timing) else float("nan")
    study.say(f"RL {arm}, seed {seed}: last step's solve rate {records[-1]['solve_rate']:.3f} "
              f"({seconds:.0f} s)")
    return {"dir": d, "ckpt": ckpt, "records": records, "seed": seed, "seconds": seconds}


def rl_flags(study: Study, T: int, K: int, ckpt: str, env_path: str, seed: int) -> list:
    """The mid-trained model's architecture and tokenizer, the RL schedule and environment."""
    s, r = study.size, RL[study.size["name"]]
    lr = float(f"{s['lr'] * LR_FRACTION:.3g}")
    return ["--hidden-size", str(s["hidden"]), "--num-attention-heads", str(s["heads"]),
            "--max-position-embeddings", str(s["seq"]), "--swiglu",
            "--position-embedding-type", "rope", "--normalization", "RMSNorm",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--disable-bias-linear",
            "--num-layers", str(K), "--num-loops", str(T), "--norm-scheme", "pre",
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", study.tokenizer,
            "--load", ckpt, "--env", "demo-tasks", "--env-path", env_path,
            "--prompts-per-step", str(r["prompts"]), "--group-size", str(r["group"]),
            "--max-new-tokens", str(MAX_NEW_TOKENS), "--temperature", str(TEMPERATURE),
            "--micro-batch-size", str(s["mbs"]), "--train-iters", str(r["steps"]),
            "--lr", str(lr), "--min-lr", str(lr), "--lr-decay-style", "constant",
            "--lr-warmup-iters", "0", "--weight-decay", "0.0", "--clip-grad", "1.0",
            "--seed", str(seed), "--log-interval", "1"]


def main(argv=None) -> int:
    mt = Study("midtrain", midtrain.__doc__, argv)
    runs, evals, T = midtrain.stages(mt)
    K = midtrain.SHAPE[mt.size["name"]][0]
    study = Study("rl", __doc__, argv)
    family, ks, means, in_range = pick_problems(evals[midtrain.MID], T)
    train_path, heldout = problems(study, family, ks)
    study.say(f"RL problems: {family} at k = {', '.join(map(str, ks))}")
    _, docs = midtrain.sft_data(study)
    extra = ("--task-file", heldout, "--input-file", docs,
             "--eval-iters", str(study.size["eval_iters"]))
    starts = runs[midtrain.MID]

    def held_out_accuracy(arm, run):
        ev = midtrain.evaluate_once(study, arm, run, [T], extra, tasks=False)
        return ev["depths"][0]["tasks"]["overall"]

    before = [held_out_accuracy("mid-trained (before RL)", run) for run in starts]
    rl_runs, after = {}, {}
    for arm, flags in ARMS.items():
        rl_runs[arm] = [train_rl(study, arm, rl_flags(study, T, K, run["ckpt"], train_path,
                                                      run["seed"]) + flags, run["seed"])
                        for run in starts]
        after[arm] = [held_out_accuracy(arm, run) for run in rl_runs[arm]]

    r, s = RL[study.size["name"]], study.size
    cells = ", ".join(f"{f} k={k}: {a:.2f}" for (f, k), a in sorted(means.items()))
    rows = [["mid-trained (before RL)", spread(before), "-", "-"] + ["-"] * len(TELEMETRY)]
    for arm in ARMS:
        gains = [a - b for a, b in zip(after[arm], before)]
        last = [run["records"][-LAST:] for run in rl_runs[arm]]
        rows.append([arm, spread(after[arm]), verdict_cell(after[arm], before),
                     " ".join(f"{g:+.3f}" for g in gains)]
                    + [spread([sum(rec[key] for rec in recs) / len(recs) for recs in last], 4)
                       for key, _ in TELEMETRY])
    first = {arm: [run["records"][0] for run in rl_runs[arm]] for arm in ARMS}
    start_rows = [[arm] + [spread([rec[key] for rec in first[arm] if key in rec], 4)
                           for key, _ in TELEMETRY] for arm in ARMS]
    seconds = {arm: spread([run["seconds"] for run in rl_runs[arm]], 0) for arm in ARMS}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # 2 x 3: the curves (the solve rate stands for the reward mean: equal under 0/1 rewards),
    # the sampled tokens' log-prob at the last loop step, and the held-out accuracy
    fig, grid = plt.subplots(2, 3, figsize=(16, 8))
    axes = list(grid.flat)
    curves = [c for c in TELEMETRY if c[0] != "reward_mean"] + [
        ("last_step_log_prob", f"log-prob of the sampled tokens at step {T}")]
    for i, arm in enumerate(ARMS):
        for j, run in enumerate(rl_runs[arm]):
            steps = [rec["iteration"] for rec in run["records"]]
            for ax, (key, label) in zip(axes, curves):
                values = [rec["step_log_probs"][-1] if key == "last_step_log_prob" else
                          rec.get(key, float("nan")) for rec in run["records"]]
                ax.plot(steps, values, color=f"C{i}", lw=1, alpha=0.8,
                        label=arm if j == 0 else None)
                ax.set_xlabel("RL step")
                ax.set_ylabel(f"{label}, one line per seed", fontsize=8)
        m, sd = mean_sd(after[arm])
        axes[-1].errorbar([i + 1], [m], yerr=[0 if sd != sd else sd], fmt="o", capsize=3,
                          color=f"C{i}", label=arm)
    m, sd = mean_sd(before)
    axes[-1].errorbar([0], [m], yerr=[0 if sd != sd else sd], fmt="o", capsize=3, color="grey",
                      label="before RL")
    axes[-1].set_xticks(range(len(ARMS) + 1), ["before"] + list(ARMS), fontsize=8)
    axes[-1].set_ylabel("held-out accuracy (mean ± sd over seeds)", fontsize=8)
    axes[-1].set_ylim(0, max(0.3, 2 * max(before + sum(after.values(), []))))
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    where = "" if in_range else (f" No (family, k) of the mid-trained checkpoints lies in "
                                 f"{RANGE[0]:.0%}-{RANGE[1]:.0%}: the closest to 40% is used.")
    study.write(
        "RL after mid-training: GRPO against RLTT (exit_pdf)",
        f"python examples/studies/rl.py --size {study.size['name']}",
        [f"Start: the mid-trained looped {K} x {T} checkpoints of midtrain.py (one per seed). "
         f"Problems: {family} at k = {', '.join(map(str, ks))}, picked "
         + (f"because the mid-trained checkpoints' held-out accuracy there lies in "
            f"{RANGE[0]:.0%}-{RANGE[1]:.0%}" if in_range else "as below") +
         f" (mean over seeds by (family, k): {cells}).{where} Training prompts: {r['train']} per k "
         f"(generator seed {TRAIN_SEED}); held-out: {r['heldout']} per k (seed "
         f"{HELDOUT_SEED}), exact greedy answer at depth {T}. RL: {r['steps']} steps of "
         f"{r['prompts']} prompts x {r['group']} completions, temperature {TEMPERATURE}, at "
         f"most {MAX_NEW_TOKENS} new tokens, T = {T} for rollouts and updates, constant LR "
         f"{s['lr'] * LR_FRACTION:g}, no weight decay, clip 0.2, KL beta 0 (the KL to the "
         f"reference is logged), token-mean. Seconds per RL run: "
         + "; ".join(f"{a} {v}" for a, v in seconds.items()) + ".",
         f"## Held-out accuracy before and after RL, and the telemetry of the last {LAST} "
         f"steps (each run's mean)",
         md_table(["checkpoint", "held-out accuracy", "vs before RL", "gain per seed"]
                  + [label for _, label in TELEMETRY], rows),
         "## RLTT (exit_pdf) - GRPO after RL",
         md_table(["comparison", "held-out accuracy"],
                  [["RLTT (exit_pdf) - GRPO", verdict_cell(after["RLTT (exit_pdf)"],
                                                           after["GRPO"])]]),
         "## The first step's telemetry (the checkpoint's own rollouts)",
         md_table(["arm"] + [label for _, label in TELEMETRY], start_rows)],
        figure=fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
