"""Mid-training against continued pretraining: from the same pretraining checkpoint, the same
number of tokens either of the demo tasks' instruction form (prompt/response pairs, loss on the
response only) or of more pretraining corpus; held-out task accuracy by k before and after.

After "Closing the Loop" (arXiv 2610.00673) section 3.4 and Table 1, the second stage of its
recipe (examples/recipes/looplm_1.4b_midtrain.sh): the pretrained looped model continues on
high-quality and instruction data with a re-warmed LR. Here each seed pretrains one looped model
on the demo corpus; from its checkpoint two arms start with ``--finetune`` (its weights only,
fresh AdamW moments, iteration 0) and the same re-warmed schedule (a third of the pretraining
peak LR, warmup, cosine to a tenth of that): *mid-trained* on ``--data-format sft`` pairs of the
demo tasks (``make_demo_corpus.py --sft-output``, another seed than the corpus and the held-out
problems), and *continued pretraining* on the demo corpus. The held-out problems
(``--tasks-output``, scored by exact greedy answer through ``tools/evaluate.py``) are the same
for the checkpoint before and both arms after. Every arm is pre-norm (it trains at the size's
LR) and keeps its exit gate (expected-loss objective) so that the mid-trained checkpoint can
start the RL study (examples/studies/rl.py). Reported over the size's seeds: accuracy by k at
the trained depth, before and after, with verdicts (mid-trained - continued; each - before),
the held-out corpus loss of all three (what the SFT stage costs on plain text), and the
accuracy of the mid-trained model at depths 1..T.

    python examples/studies/midtrain.py --size cpu --output-dir studies_out
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from study import (Study, accuracy_by_k, figure, in_child, mean_sd,  # noqa: E402
                   md_table, slug, spread, verdict_cell, _quietly)

# (K, T): T = 4 as in Closing the Loop's recipe; one layer at cpu size, so that the 9 runs of
# 3 seeds fit well under an hour on 2 busy cores
SHAPE = {"tiny": (1, 2), "cpu": (1, 4), "gpu": (4, 4)}
# Iterations of the second stage (both arms: the same tokens); the pretraining stage is the
# size's.
STAGE = {"tiny": 4, "cpu": 60, "gpu": 2000}
SFT_PAIRS = {"tiny": 400, "cpu": 20000, "gpu": 400000}
HELDOUT_DOCS = {"tiny": 40, "cpu": 300, "gpu": 2000}
SFT_SEED = 11  # make_demo_midtrain_data.sh's: neither the corpus' (1) nor its held-out problems'
BEFORE, MID, CONT = "before (pretrained)", "mid-trained (SFT)", "continued pretraining"


def sft_data(study: Study) -> tuple[str, str]:
    """The demo tasks as prompt/response pairs, tokenized with the study's tokenizer in SFT form,
    and held-out corpus documents from the same generator seed (built once next to the corpus);
    (the pairs' prefix, the documents' JSONL)."""
    data = os.path.dirname(study.data_prefix)
    prefix = os.path.join(data, "midtrain_sft_text_document")
    stamp = os.path.join(data, "midtrain_sft.json")
    docs = os.path.join(data, "midtrain_heldout_docs.jsonl")
    wanted = {"pairs": SFT_PAIRS[study.size["name"]], "seed": SFT_SEED,
              "docs": HELDOUT_DOCS[study.size["name"]],
              "max_steps": study.size["max_steps"], "tokenizer": study.tokenizer}
    if os.path.isfile(stamp) and json.load(open(stamp)) == wanted and \
            os.path.isfile(prefix + ".idx"):
        return prefix, docs
    study.say(f"writing {wanted['pairs']} prompt/response pairs in {data}")
    in_child(_quietly, _make_sft, os.path.join(data, "midtrain_sft.log"), data, wanted)
    with open(stamp, "w") as f:
        json.dump(wanted, f)
    return prefix, docs


def _make_sft(data: str, wanted: dict) -> bool:
    from megaloop.cli import make_demo_corpus as tool  # tools/make_demo_corpus.py's command
    from megaloop.data.config import TokenizerConfig
    from megaloop.data.preprocess import preprocess

    pairs = os.path.join(data, "midtrain_sft.jsonl")
    # the documents of this seed (not the corpus': held out) score the corpus loss
    tool.main(["--output", os.path.join(data, "midtrain_heldout_docs.jsonl"),
               "--num-docs", str(wanted["docs"]),
               "--sft-output", pairs, "--num-sft", str(wanted["pairs"]),
               "--max-steps", str(wanted["max_steps"]), "--seed", str(wanted["seed"])])
    preprocess(pairs, os.path.join(data, "midtrain_sft"),
               TokenizerConfig("SentencePieceTokenizer", wanted["tokenizer"]),
               data_format="sft", workers=0, progress=False)
    return True


def evaluate_once(study: Study, arm: str, run: dict, depths: list, extra: tuple,
                  tasks: bool = True, tag: str = "eval") -> dict:
    """``study.evaluate`` of ``run``'s checkpoint, reused when the same evaluation of the same
    finished run (its done.json, rewritten by a new run) was made before."""
    out = os.path.join(study.run_dir, slug(arm), f"seed_{run['seed']}", tag)
    stamp = os.path.join(out, "done.json")
    key = {"ckpt": run["ckpt"], "depths": depths, "extra": list(extra), "tasks": tasks,
           "task_file": study.task_file,
           "trained": os.path.getmtime(os.path.join(run["dir"], "done.json"))}
    if os.path.isfile(stamp) and json.load(open(stamp)) == key:
        with open(os.path.join(out, "depth_sweep.json")) as f:
            return json.load(f)
    result = study.evaluate(arm, run["ckpt"], depths, tasks=tasks, extra=extra, tag=tag,
                            seed=run["seed"])
    with open(stamp, "w") as f:
        json.dump(key, f)
    return result


def stages(study: Study) -> tuple[dict, dict, int]:
    """Train (or reuse) the three checkpoints of every seed and evaluate them at depths 1..T:
    ({checkpoint: [run per seed]}, {checkpoint: [depth_sweep.json per seed]}, T)."""
    size = study.size["name"]
    K, T = SHAPE[size]
    iters = STAGE[size]
    sft, heldout = sft_data(study)
    lr = study.size["lr"] / 3
    model = ["--num-layers", str(K), "--num-loops", str(T), "--norm-scheme", "pre"]
    stage2 = ["--finetune", "--lr", str(lr), "--min-lr", str(lr / 10),
              "--lr-warmup-iters", str(max(iters // 20, 1))]
    looped = f"looped {K} x {T}"
    pre = study.train_seeds(f"{looped} pretrained", model)
    mid, cont = [], []
    for run in pre:
        start = ["--load", run["ckpt"]] + stage2
        mid.append(study.train(f"{looped} {MID}", model + start + [
            "--data-path", sft, "--data-format", "sft"], iters=iters, seed=run["seed"]))
        cont.append(study.train(f"{looped} {CONT}", model + start, iters=iters,
                                seed=run["seed"]))
    runs = {BEFORE: pre, MID: mid, CONT: cont}
    # Every checkpoint scored on the same held-out problems and the same held-out corpus
    # documents (the first eval-iters x global-batch windows), at depths 1..T.
    corpus = ("--input-file", heldout, "--eval-iters", str(study.size["eval_iters"]))
    evals = {arm: [evaluate_once(study, f"{looped} {arm}" if arm != BEFORE else
                                 f"{looped} pretrained", r, list(range(1, T + 1)), corpus)
                   for r in rs] for arm, rs in runs.items()}
    return runs, evals, T


def main(argv=None) -> int:
    study = Study("midtrain", __doc__, argv)
    size = study.size["name"]
    K, T = SHAPE[size]
    iters = STAGE[size]
    lr = study.size["lr"] / 3
    runs, evals, T = stages(study)

    def at(ev, depth):
        return next(d for d in ev["depths"] if d["depth"] == depth)

    by_k = {arm: [accuracy_by_k(at(ev, T)["tasks"]) for ev in evs] for arm, evs in evals.items()}
    ks = sorted(by_k[BEFORE][0])
    acc = {arm: {k: [s[k] for s in seeds] for k in ks} for arm, seeds in by_k.items()}
    overall = {arm: [at(ev, T)["tasks"]["overall"] for ev in evs] for arm, evs in evals.items()}
    loss = {arm: [at(ev, T)["loss"] for ev in evs] for arm, evs in evals.items()}
    families = sorted(at(evals[BEFORE][0], T)["tasks"]["by_family"])

    def family_acc(arm, family):  # over its problems of every k
        out = []
        for ev in evals[arm]:
            tasks = at(ev, T)["tasks"]
            n = tasks["count"][family]
            out.append(sum(a * n[k] for k, a in tasks["by_family"][family].items())
                       / sum(n.values()))
        return out

    rows = [[arm, spread(loss[arm]), spread(overall[arm])] + [spread(acc[arm][k]) for k in ks]
            for arm in runs]
    diffs = [[f"{a} - {b}", verdict_cell(loss[a], loss[b]), verdict_cell(overall[a], overall[b])]
             + [verdict_cell(acc[a][k], acc[b][k]) for k in ks]
             for a, b in ((MID, CONT), (MID, BEFORE), (CONT, BEFORE))]
    fam_rows = [[arm] + [spread(family_acc(arm, f)) for f in families] for arm in runs]
    sweep = []
    for depth in range(1, T + 1):
        per_seed = [accuracy_by_k(at(ev, depth)["tasks"]) for ev in evals[MID]]
        sweep.append([depth, spread([at(ev, depth)["tasks"]["overall"] for ev in evals[MID]])]
                     + [spread([s[k] for s in per_seed]) for k in ks])

    fig, axes = figure(2)
    for i, arm in enumerate(runs):
        means = [mean_sd(acc[arm][k]) for k in ks]
        axes[0].errorbar(ks, [m for m, _ in means], yerr=[0 if sd != sd else sd
                                                          for _, sd in means],
                         fmt="o-", capsize=3, label=arm, color=f"C{i}")
        for j, run in enumerate(runs[arm] if arm != BEFORE else []):
            train = [r for r in run["records"] if r["split"] == "train"]
            axes[1].plot([r["iteration"] for r in train], [r["loss"] for r in train],
                         color=f"C{i}", lw=1, label=arm if j == 0 else None)
    axes[0].set_xlabel("k (steps or hops)")
    axes[0].set_ylabel(f"held-out accuracy at depth {T} (mean ± sd over seeds)")
    axes[0].set_ylim(0, 1.02)
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("iteration of the second stage")
    axes[1].set_ylabel("training loss (SFT: response tokens), per seed")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    s = study.size
    study.write(
        "Mid-training against continued pretraining",
        f"python examples/studies/midtrain.py --size {size}",
        [f"Looped {K} x {T}, pre-norm, exit gate (expected loss). Pretraining: {s['iters']} "
         f"iterations of {s['gbs']} x {s['seq']} tokens of the demo corpus at LR {s['lr']} "
         f"(warmup {s['warmup']}, cosine). Second stage from that checkpoint (--finetune), "
         f"{iters} iterations of the same batch shape for both arms, LR {lr:g} re-warmed over "
         f"{max(iters // 20, 1)} iterations, cosine to {lr / 10:g}: the mid-trained arm on "
         f"{SFT_PAIRS[size]} prompt/response pairs of the demo tasks (--data-format sft, "
         f"generator seed {SFT_SEED}), the continued arm on the corpus. Held-out problems: "
         f"{s['tasks']} (arithmetic chains, variable binding, pointer chasing; k = "
         f"1..{s['max_steps']}), exact greedy answer; corpus loss on "
         f"{s['eval_iters'] * s['gbs']} windows of held-out documents (generator seed "
         f"{SFT_SEED}).",
         f"## Held-out accuracy by k at depth {T}, before and after",
         md_table(["checkpoint", "held-out corpus loss", "accuracy"]
                  + [f"k={k}" for k in ks], rows),
         "## Differences (mean difference, verdict)",
         md_table(["comparison", "held-out corpus loss", "accuracy"]
                  + [f"k={k}" for k in ks], diffs),
         f"## Accuracy by task family at depth {T} (all k)",
         md_table(["checkpoint"] + families, fam_rows),
         f"## The mid-trained model at depths 1..{T}",
         md_table(["depth", "accuracy"] + [f"k={k}" for k in ks], sweep)],
        figure=fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
