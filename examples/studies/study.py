"""What every study script shares: sizes, data, training and evaluation runs, tables, plots.

A study trains several configurations ("arms") on the same data for the same number of tokens
through ``pretrain_looplm.py``'s ``main`` (each in a forked child process: a fresh process group
and megatron-core state per run, megatron-core imported once by the parent), evaluates their
checkpoints with ``tools/evaluate.py`` (depth sweeps, exit rules, held-out task accuracy by
family and k) and writes ``<output-dir>/studies/<name>.md`` and ``.png``.

Data: by default the demo corpus (tools/make_demo_corpus.py), its sentencepiece tokenizer and its
``.bin/.idx``, built once into ``<output-dir>/data`` (or ``--data-dir``) and shared by the studies,
plus held-out problems generated with another seed. ``--data-path`` / ``--tokenizer-model`` use a
preprocessed corpus instead (task accuracy then needs ``--task-file``).

Reasoning data (``corpus="automaton"``): only the problems of the task family of
``make_demo_corpus.py`` where depth is needed (a 16-cell row after k steps of a rule-30
automaton, every cell one piece), as question/answer pairs trained with the loss on the answers
only (``--sft``), packed several to a sequence but each alone in its attention window, with the
family's settings (``REASONING``) and a model of their own (``REASONING_MODEL``); held-out
problems uniform over k = 1..6. How far models get on them at each size is a measurement, in the
README's Studies section.

Seeds: every arm trains ``seeds`` times (``cpu``/``gpu``: 3, ``tiny``: 1) with --seed, --seed+1,
...; tables give mean and sample standard deviation over the seeds, and a difference between two
arms is called a finding only under ``VERDICT_RULE`` (``compare``).

Sizes: ``tiny`` (what the test suite runs: seconds per arm), ``cpu`` (minutes per arm on 2
cores), ``gpu`` (one GPU; the arms run one process each). ``STUDY_THREADS`` sets torch's threads
per run (``tiny``: 1): on a machine shared with other jobs use 1, as oversubscribed OpenMP
threads slow a run down by an order of magnitude.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from verdicts import (VERDICT_RULE, compare, mean_sd, spread,  # noqa: E402,F401  (studies' names)
                      verdict_cell)

SIZES = {
    # hidden, heads, seq, micro/global batch, iterations, lr, warmup, eval iters, corpus docs,
    # held-out problems, hardest k of the corpus
    "tiny": dict(hidden=32, heads=4, seq=64, mbs=4, gbs=4, iters=8, lr=3e-3, warmup=2,
                 eval_iters=1, docs=300, tasks=24, max_steps=3, log=4, evals=1, seeds=1),
    "cpu": dict(hidden=96, heads=4, seq=128, mbs=8, gbs=16, iters=120, lr=3e-3, warmup=12,
                eval_iters=4, docs=20000, tasks=300, max_steps=6, log=25, evals=4, seeds=3),
    "gpu": dict(hidden=1024, heads=16, seq=1024, mbs=8, gbs=64, iters=5000, lr=1e-3,
                warmup=500, eval_iters=20, docs=400000, tasks=1200, max_steps=6, log=50,
                evals=10, seeds=3),
}
# The reasoning data: documents (for the tokenizer), question/answer pairs (the training data),
# held-out problems, hardest k, tokenizer size, the share of training problems at k = 1
# (make_demo_corpus.py --one-step-share).
# The cellular automaton: 39 tokens a problem (16 cells, "after k", 16 cells, ".", end of
# document), 3 to a sequence (whole_problems cuts the size's 128 to 117). Its alphabet is
# small, so the tokenizer is the byte fallback, the specials and about 20 pieces (the two cell
# states, the letters of "after", digits, "."). k stays
# uniform: every k has cells near the left edge that need fewer steps, so the first steps are
# learned without a k = 1 share. At cpu size (2026-12-02, results/loop_vs_dense.md, 3000
# iterations, 3 seeds) dense 8 and the looped 2 x 4 learned k <= 3 in every seed, dense 2 k = 3
# in none (at most 0.33); at 2000 iterations dense 8 had learned in 1 seed of 3.
AUTOMATON = {"tiny": dict(docs=300, pairs=600, tasks=24, max_steps=3, vocab=276, one_step=0.0),
             "cpu": dict(docs=2000, pairs=100000, tasks=480, max_steps=6, vocab=280,
                         one_step=0.0),
             "gpu": dict(docs=2000, pairs=2000000, tasks=1200, max_steps=6, vocab=280,
                         one_step=0.0)}
REASONING = {"automaton": AUTOMATON}
# The reasoning studies' model (over the size's). Each problem is alone in its attention window
# (--reset-attention-mask --reset-position-ids), 3 to a sequence: 16 sequences carry 48 rows per
# iteration.
REASONING_MODEL = {"tiny": dict(hidden=32), "cpu": dict(hidden=64),
                   "gpu": dict(hidden=512, heads=8)}


# An arm has left the initial plateau (the loss of predicting token frequencies alone) when its
# final validation loss is this many nats below it: the loop trains at all, not only counts tokens.
PLATEAU_MARGIN = 1.0


def unigram_entropy(prefix: str) -> float:
    """Entropy (nats per token) of the corpus's token frequencies: the loss of a model that
    predicts them alone, the level of the plateau a run starts on."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    counts = np.bincount(np.concatenate([ds.get(i) for i in range(len(ds))]))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def machine(load_at_start: tuple) -> str:
    """The machine a table was made on: cores, threads per run, load (other jobs share it)."""
    return (f"Machine: {os.cpu_count()} CPU cores, {os.environ.get('STUDY_THREADS', 'all')} "
            f"torch thread(s) per run; load average {load_at_start[0]:.1f} "
            f"(1 min) at the start, {os.getloadavg()[2]:.1f} (15 min) at the end.")


def whole_problems(prefix: str, seq: int) -> int:
    """The longest sequence length up to ``seq`` that holds a whole number of the corpus's
    problems, which all have the same number of tokens. The dataset concatenates them and cuts
    windows of that many tokens, so then every window starts at a problem's start. At 128 tokens
    (3.3 automaton problems) one problem in four was split across two windows and its answer
    trained without the start of its row: a looped 2 x 4 trained so for 1200 iterations had
    learned the 3 left-most cells and no whole row, even at k = 1 (2026-12-02)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)  # held while reading: the lengths are a view of its mmap
    lengths = set(ds.sequence_lengths.tolist())
    if len(lengths) != 1:
        raise ValueError(f"{prefix}: problems of {sorted(lengths)} tokens; the reasoning data "
                         f"needs one length, so that windows hold whole problems")
    length = lengths.pop()
    if length > seq:
        raise ValueError(f"{prefix}: a problem is {length} tokens, longer than the {seq}-token "
                         f"sequence")
    return seq // length * length


def _child(fn, args, queue):
    try:
        import torch

        # Tiny models: one thread per run is faster than two fighting over small matrices.
        torch.set_num_threads(int(os.environ.get("STUDY_THREADS", torch.get_num_threads())))
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
            os.environ.pop(key, None)
        queue.put(("ok", fn(*args)))
    except BaseException:  # the parent reports it
        queue.put(("error", traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)


def in_child(fn, *args, timeout: float = 6 * 3600):
    """``fn(*args)`` in a forked process (its own process group); its return value."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, args, queue))
    proc.start()
    try:
        status, value = queue.get(timeout=timeout)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    if status != "ok":
        raise RuntimeError(value)
    return value


def _quietly(fn, log_path, *args):
    """Run ``fn`` with stdout and stderr into ``log_path`` (a run's own log)."""
    import contextlib

    with open(log_path, "w") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        return fn(*args)


def _pretrain(argv):
    import pretrain_looplm

    code = pretrain_looplm.main(argv)
    if code != 0:
        raise RuntimeError(f"pretrain_looplm.py exited {code}")
    return code


def _evaluate(argv):
    from megaloop.cli import evaluate as tool  # tools/evaluate.py's command

    code = tool.main(argv)
    if code != 0:
        raise RuntimeError(f"tools/evaluate.py exited {code}")
    return code


class Study:
    """One study's settings, output folder and runs."""

    def __init__(self, name: str, description: str, argv=None, corpus: str = "demo"):
        p = argparse.ArgumentParser(description=description.split("\n")[0])
        p.add_argument("--size", choices=list(SIZES), default="cpu")
        p.add_argument("--output-dir", default="studies_out",
                       help="runs go to OUTPUT/runs/<study>/, tables and PNGs to OUTPUT/studies/")
        p.add_argument("--data-dir", default=None,
                       help="where the demo corpus is built and reused (default OUTPUT/data)")
        p.add_argument("--data-path", default=None, help="a preprocessed corpus prefix instead")
        p.add_argument("--tokenizer-model", default=None,
                       help="its sentencepiece model (with --data-path)")
        p.add_argument("--task-file", default=None,
                       help="held-out problems (default: generated for the demo corpus)")
        p.add_argument("--seed", type=int, default=1234)
        p.add_argument("--seeds", type=int, default=None,
                       help="seeds per arm (--seed, --seed+1, ...); default: the size's "
                            "(tiny 1, cpu and gpu 3)")
        args = p.parse_args(argv)
        if args.seeds is not None and args.seeds < 1:
            p.error(f"--seeds {args.seeds}: give at least 1")
        if bool(args.data_path) != bool(args.tokenizer_model):
            p.error("--data-path and --tokenizer-model go together")
        self.name, self.args = name, args
        if args.size == "tiny":
            os.environ.setdefault("STUDY_THREADS", "1")
        self.size = dict(SIZES[args.size], name=args.size)
        if corpus not in ("demo", *REASONING):
            raise ValueError(f"corpus {corpus!r}: choose demo or one of {', '.join(REASONING)}")
        if corpus in REASONING:
            self.size.update(REASONING_MODEL[args.size])
        self.corpus = corpus
        self.seeds = [args.seed + i for i in range(args.seeds or self.size["seeds"])]
        self.out = os.path.abspath(args.output_dir)
        self.run_dir = os.path.join(self.out, "runs", name)
        os.makedirs(self.run_dir, exist_ok=True)
        os.makedirs(os.path.join(self.out, "studies"), exist_ok=True)
        self.started = time.time()
        from megaloop import runtime

        runtime.quiet_megatron()
        import megatron.core  # noqa: F401  (once here, inherited by every forked run)
        self.data_prefix, self.tokenizer, self.task_file = self._data()
        if corpus in REASONING and not args.data_path:
            self.size["seq"] = whole_problems(self.data_prefix, self.size["seq"])

    # --- data -----------------------------------------------------------------------------
    def _data(self):
        a = self.args
        if a.data_path:
            return a.data_path, os.path.abspath(a.tokenizer_model), a.task_file
        data = os.path.abspath(a.data_dir or os.path.join(self.out, "data"))
        wanted = {"docs": self.size["docs"], "max_steps": self.size["max_steps"],
                  "tasks": self.size["tasks"]}
        if self.corpus in REASONING:
            data = os.path.join(data, self.corpus)
            # version: raised when the problems' text changes, so that data built by an older
            # make_demo_corpus.py is rebuilt rather than reused
            wanted = dict(REASONING[self.corpus][self.size["name"]], families=self.corpus,
                          prose=0.0, version=2)
        os.makedirs(data, exist_ok=True)
        prefix, model = os.path.join(data, "corpus_text_document"), os.path.join(data,
                                                                                "tokenizer.model")
        if self.corpus in REASONING:
            prefix = os.path.join(data, "pairs_text_document")
        tasks = os.path.join(data, "tasks.jsonl")
        stamp = os.path.join(data, "size.json")
        if os.path.isfile(stamp) and json.load(open(stamp)) == wanted and \
                os.path.isfile(prefix + ".idx"):
            return prefix, model, a.task_file or tasks
        self.say(f"building the {self.corpus} corpus ({wanted['docs']} documents) in {data}")
        corpus = os.path.join(data, "corpus.jsonl")
        in_child(_quietly, _make_data, os.path.join(data, "data.log"), corpus, data, wanted)
        with open(stamp, "w") as f:
            json.dump(wanted, f)
        return prefix, model, a.task_file or tasks

    # --- runs -----------------------------------------------------------------------------
    def say(self, text: str) -> None:
        print(f"[{self.name} {time.time() - self.started:6.0f} s] {text}", flush=True)

    def base_flags(self, iters=None, seed=None) -> list:
        """Batch, schedule, data and logging flags every arm shares (matched token budgets)."""
        s = self.size
        iters = iters or s["iters"]
        return ["--hidden-size", str(s["hidden"]), "--num-attention-heads", str(s["heads"]),
                "--seq-length", str(s["seq"]), "--max-position-embeddings", str(s["seq"]),
                "--micro-batch-size", str(s["mbs"]), "--global-batch-size", str(s["gbs"]),
                "--train-iters", str(iters), "--lr", str(s["lr"]),
                "--min-lr", str(s["lr"] / 10), "--lr-warmup-iters", str(s["warmup"]),
                "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0",
                # The model family every arm shares, spelled out (not left to defaults).
                "--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
                "--hidden-dropout", "0", "--attention-dropout", "0", "--disable-bias-linear",
                "--num-workers", "0", "--data-path", self.data_prefix, "--split", "98,2,0",
                "--tokenizer-type", "SentencePieceTokenizer",
                "--tokenizer-model", self.tokenizer,
                # The reasoning data: loss on the answers, every problem alone in its window,
                # and an output layer of its own (in a 2026-12-02 plain-PyTorch sizing run on
                # the earlier pointer-chasing task, dense 8 with tied embeddings had not learned
                # k = 1 by step 450, untied had it by step 300).
                *(["--sft", "--reset-attention-mask", "--reset-position-ids",
                   "--untie-embeddings-and-output-weights"] if self.corpus in REASONING else []),
                "--seed", str(self.args.seed if seed is None else seed),
                "--log-interval", str(s["log"]),
                "--eval-interval", str(max(iters // s["evals"], 1)),
                "--eval-iters", str(s["eval_iters"])]

    def train_seeds(self, arm: str, flags: list, iters=None) -> list:
        """``train`` once per seed of this size (``self.seeds``); the runs in seed order."""
        return [self.train(arm, flags, iters, seed=seed) for seed in self.seeds]

    def run_once(self, arm: str, seed: int, argv: list, entry) -> tuple:
        """``entry(argv)`` (a training entry point's main) in a child, logging to and saving
        in the folder of ``arm`` at ``seed``, unless a run with the same flags finished there
        before; (folder, checkpoint, JSONL log, the full argv, whether it ran now)."""
        d = os.path.join(self.run_dir, slug(arm), f"seed_{seed}")
        os.makedirs(d, exist_ok=True)
        ckpt, log = os.path.join(d, "ckpt"), os.path.join(d, "train.jsonl")
        argv = list(argv) + ["--log-jsonl", log, "--save", ckpt]
        done = os.path.join(d, "done.json")  # written after a finished run: rerunning reuses it
        if os.path.isfile(done) and json.load(open(done)) == argv:
            self.say(f"reusing {arm}, seed {seed} (same flags, finished before)")
            return d, ckpt, log, argv, False
        for stale in (log, done):
            if os.path.exists(stale):
                os.remove(stale)
        in_child(_quietly, entry, os.path.join(d, "train.log"), argv)
        with open(done, "w") as f:
            json.dump(argv, f)
        return d, ckpt, log, argv, True

    def train(self, arm: str, flags: list, iters=None, seed=None) -> dict:
        """Train one arm (at ``seed``, default --seed); {"dir", "ckpt", "log", "records",
        "seconds", "seed"}."""
        seed = self.args.seed if seed is None else seed
        start = time.time()
        d, ckpt, log, argv, _ = self.run_once(arm, seed, self.base_flags(iters, seed) + list(flags),
                                              _pretrain)
        records = [json.loads(line) for line in open(log)]
        valid = [r for r in records if r["split"] == "valid"]
        self.say(f"trained {arm}, seed {seed}: final validation loss {valid[-1]['loss']:.4f} "
                 f"({time.time() - start:.0f} s)")
        return {"dir": d, "ckpt": ckpt, "log": log, "records": records, "argv": argv,
                "seconds": time.time() - start, "seed": seed}

    def evaluate(self, arm: str, ckpt: str, depths: list, rules: str = "none",
                 tasks: bool = True, extra: tuple = (), tag: str = "eval", seed=None) -> dict:
        """tools/evaluate.py on ``ckpt`` at ``depths`` (``extra``: more of its flags); the parsed
        depth_sweep.json. Written next to the arm's run at ``seed`` (default --seed)."""
        seed = self.args.seed if seed is None else seed
        out = os.path.join(self.run_dir, slug(arm), f"seed_{seed}", tag)
        os.makedirs(out, exist_ok=True)
        # --no-progress: the sweep's output goes to the log file, where a bar's redraws are
        # noise; the study says what it is doing on its own lines.
        argv = ["--load", ckpt, "--output-dir", out, "--num-loops", ",".join(map(str, depths)),
                "--exit-rules", rules, "--plots", "false", "--no-progress", *extra]
        if tasks and self.task_file:
            argv += ["--task-file", self.task_file]
        in_child(_quietly, _evaluate, os.path.join(os.path.dirname(out), f"{tag}.log"), argv)
        with open(os.path.join(out, "depth_sweep.json")) as f:
            return json.load(f)

    # --- output ---------------------------------------------------------------------------
    def write(self, title: str, command: str, sections: list, figure=None) -> str:
        """studies/<name>.md (title, how it was made, the sections' Markdown) and the figure."""
        path = os.path.join(self.out, "studies", f"{self.name}.md")
        png = os.path.join(self.out, "studies", f"{self.name}.png")
        lines = [f"# {title}", "",
                 f"Size `{self.size['name']}`, {time.strftime('%Y-%m-%d')}, "
                 f"{time.time() - self.started:.0f} s, seeds {', '.join(map(str, self.seeds))}"
                 f" (mean ± sample sd over them, then each seed's value). Command: `{command}`", "",
                 f"Verdicts: {VERDICT_RULE}.", ""]
        for section in sections:
            lines += [section, ""]
        if figure is not None:
            figure.savefig(png, dpi=110)
            lines += [f"![{self.name}]({os.path.basename(png)})", ""]
        with open(path, "w") as f:
            f.write("\n".join(lines))
        self.say(f"wrote {path}" + (f" and {png}" if figure is not None else ""))
        return path


def _make_data(corpus, data, wanted):
    """The corpus (``wanted``: documents, held-out problems, hardest k, and for the reasoning
    data its families, prose fraction and vocabulary), its tokenizer and its .bin/.idx."""
    import importlib

    def tool(name):  # the command behind tools/<name>.py
        return importlib.import_module(f"megaloop.cli.{name}")

    pairs = os.path.join(data, "pairs.jsonl")
    family = ["--families", wanted["families"], "--prose-fraction", str(wanted["prose"]),
              "--sft-output", pairs, "--num-sft", str(wanted["pairs"]),
              "--one-step-share", str(wanted["one_step"])] \
        if "families" in wanted else []
    tool("make_demo_corpus").main(["--output", corpus, "--num-docs", str(wanted["docs"]),
                                   "--max-steps", str(wanted["max_steps"]), "--seed", "1",
                                   "--tasks-output", os.path.join(data, "tasks.jsonl"),
                                   "--num-tasks", str(wanted["tasks"]), *family])
    tool("train_tokenizer").main(["--input", corpus, "--output-prefix",
                                  os.path.join(data, "tokenizer"), "--vocab-size",
                                  str(wanted.get("vocab", 512))])
    code = tool("preprocess_data").main([
        "--input", corpus, "--output-prefix", os.path.join(data, "corpus"),
        "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", os.path.join(data, "tokenizer.model"), "--append-eod",
        "--workers", "1"])
    if code:
        raise RuntimeError(f"preprocess_data.py exited {code}")
    if family:  # the question/answer pairs, loss on the answers
        code = tool("preprocess_data").main([
            "--input", pairs, "--output-prefix", os.path.join(data, "pairs"),
            "--tokenizer-type", "SentencePieceTokenizer", "--data-format", "sft",
            "--tokenizer-model", os.path.join(data, "tokenizer.model"), "--workers", "1"])
        if code:
            raise RuntimeError(f"preprocess_data.py --data-format sft exited {code}")
    return True


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text).strip("_").lower()


def md_table(header: list, rows: list) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, list):
        return " ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in value)
    return str(value)


def valid_curve(records: list) -> tuple[list, list]:
    pairs = [(r["iteration"], r["loss"]) for r in records if r["split"] == "valid"]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def accuracy_by_k(tasks: dict) -> dict:
    """{k: accuracy over all families}, weighted by the problems per cell."""
    hits, counts = {}, {}
    for family, by_k in tasks["by_family"].items():
        for k, acc in by_k.items():
            n = tasks["count"][family][k]
            hits[int(k)] = hits.get(int(k), 0) + acc * n
            counts[int(k)] = counts.get(int(k), 0) + n
    return {k: hits[k] / counts[k] for k in sorted(counts)}


def figure(panels: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2))
    return fig, (axes if panels > 1 else [axes])
