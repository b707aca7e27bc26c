"""train_rl.py as a user runs it: the whole script (train_rl.main) on 2 CPU ranks (TP=2) on the
shipped demo-tasks environment with a sentencepiece tokenizer, and the refusals of bad flags
before any process group (one line naming the flag, exit code 2)."""

import json
import os
import random

import pytest

from distributed import run_distributed
from flags import LLAMA_STYLE_FLAGS
from test_placement import check_placement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "examples", "lm_eval_tasks", "demo_tasks.jsonl")
TINY = [*LLAMA_STYLE_FLAGS, "--transformer-impl", "auto", "--distributed-backend", "auto",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--max-position-embeddings", "128", "--num-loops", "3"]


def _main(rank, world, argv, stderr=False):
    """train_rl.main(argv) in this rank: its exit code (and what it printed on stderr)."""
    import contextlib
    import io
    import sys

    sys.path.insert(0, ROOT)
    import train_rl

    check_placement()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = train_rl.main(argv)
    return (code, err.getvalue()) if stderr else code


def _first_word(text):
    words = text.split()
    return words[0].rstrip(".") if words else ""


def test_train_rl_runs_on_demo_tasks(tmp_path):
    import importlib.util

    from megaloop.data.tokenizers import train_sentencepiece

    spec = importlib.util.spec_from_file_location(
        "make_demo_corpus", os.path.join(ROOT, "megaloop", "cli", "make_demo_corpus.py"))
    corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus)
    rng = random.Random(0)
    sp = train_sentencepiece([corpus.document(rng, 6) for _ in range(300)], str(tmp_path / "sp"),
                             vocab_size=512)
    log, rollouts = tmp_path / "rl.jsonl", tmp_path / "rollouts.jsonl"
    argv = [*TINY, "--tensor-model-parallel-size", "2", "--tokenizer-type",
            "SentencePieceTokenizer", "--tokenizer-model", sp, "--env", "demo-tasks",
            "--env-path", TASKS, "--env-limit", "12", "--prompts-per-step", "3",
            "--group-size", "2", "--max-new-tokens", "4", "--micro-batch-size", "3",
            "--train-iters", "2", "--objective", "rltt", "--kl-beta", "0.1",
            "--save", str(tmp_path / "ckpt"), "--log-jsonl", str(log),
            "--rollout-log", str(rollouts)]
    assert run_distributed(_main, 2, argv) == [0, 0]
    records = [json.loads(x) for x in open(log)]
    assert [r["iteration"] for r in records] == [1, 2]
    for r in records:
        assert len(r["step_log_probs"]) == 3 and all(v < 0 for v in r["step_log_probs"])
        assert 0 <= r["solve_rate"] <= 1 and r["response_length"] >= 1
    rows = [json.loads(x) for x in open(rollouts)]
    assert len(rows) == 2 * 3 * 2
    tasks = {json.loads(x)["question"]: str(json.loads(x)["answer"]) for x in open(TASKS)}
    for row in rows:  # the demo-tasks reward, written out: the first word is the answer
        assert row["answer"] == tasks[row["prompt"]]
        assert row["reward"] == float(_first_word(row["completion"]) == row["answer"])
    assert open(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read().strip() == "2"


def _refusals(rank, world, cases):
    from megaloop.rl.train import configure

    out = []
    for argv in cases:
        try:
            configure(argv)
            out.append(None)
        except ValueError as exc:
            out.append(str(exc))
    return out


REFUSALS = [
    (["--loop-weighting", "uniform"], "--loop-weighting uniform weighs RLTT"),
    (["--objective", "rltt", "--loop-weighting-alpha", "2"], "--loop-weighting-alpha"),
    (["--objective", "rltt", "--loop-weighting", "exit_pdf", "--num-loops", "1"],
     "exit_pdf reads the exit gate"),
    (["--prompts-per-step", "3", "--group-size", "3"], "9 completions per data-parallel "
                                                         "rank"),
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size 2"),
    (["--temperature", "0"], "--temperature 0"),
    (["--env", "nope"], "--env nope"),
    (["--prompts-per-step", "20"], "has only 12 prompts"),
    (["--max-new-tokens", "125"], "exceeds --max-position-embeddings 128"),
    (["--env-args", "size"], "--env-args size: expected KEY=VALUE"),
    (["--hidden-dropout", "0.1"], "--hidden-dropout 0.1: RL scores the sampled tokens"),
    (["--group-size", "1", "--micro-batch-size", "1"], "--group-size 1: --objective grpo"),
    (["--group-size", "1", "--micro-batch-size", "1", "--objective", "rltt"],
     "--group-size 1: --objective rltt"),
    (["--fp8-format", "hybrid"], "--fp8-format hybrid: train_rl.py's rollouts decode one token"),
    (["--reward-timeout", "0"], "--reward-timeout 0.0 must be a number of seconds > 0"),
    (["--reward-timeout", "nan"], "--reward-timeout nan must be a number of seconds > 0"),
    (["--reward-timeout", "600"], "--reward-timeout 600 s must be below "
                                  "--distributed-timeout-minutes 10 (600 s)"),
    (["--reward-timeout", "61", "--distributed-timeout-minutes", "1"],
     "--reward-timeout 61 s must be below --distributed-timeout-minutes 1 (60 s)"),
]


def test_bad_flags_are_refused_before_any_process_group(tmp_path):
    from test_rl_train import ENV

    (tmp_path / "even_sum.py").write_text(ENV)
    base = [*TINY, "--tokenizer-type", "NullTokenizer", "--vocab-size", "63", "--env",
            f"{tmp_path / 'even_sum.py'}:EvenSum", "--env-args", "size=12",
            "--prompts-per-step", "4", "--group-size", "2", "--micro-batch-size", "2"]
    messages = run_distributed(_refusals, 1, [base] + [base + extra for extra, _ in REFUSALS])[0]
    assert messages[0] is None  # the base command is valid
    for (extra, want), got in zip(REFUSALS, messages[1:]):
        assert got is not None and want in got, (extra, got)
        # one line per refusal (a flag that breaks two rules is refused twice), no traceback
        assert all(line.startswith("error: ") for line in got.split("\n")[1:]), got


@pytest.mark.parametrize("flag", ["--data-path", "--global-batch-size", "--seq-length",
                                  "--eval-iters", "--random-depth-mean",
                                  "--loopformer-objective"])
def test_pretraining_only_flags_are_not_flags_of_train_rl(flag):
    from megaloop.rl.config import build_parser

    assert flag not in build_parser()._option_string_actions


def test_plot_run_draws_the_rl_telemetry(tmp_path):
    """tools/plot_run.py on an RL log draws megaloop/rl/plot.py's panels; each line holds the
    records' values (per loop step: one line per t)."""
    import sys

    import torch

    from megaloop.rl.plot import draw_rl_run
    from megaloop.rl.telemetry import step_record

    g = torch.Generator().manual_seed(0)
    records = []
    for step in (1, 2, 3):
        rewards = torch.randint(0, 2, (2, 3), generator=g).double()
        mask = torch.ones(6, 4)
        logp = -torch.rand(3, 6, 4, generator=g)
        records.append({**step_record(step, rewards, mask, logp, logp[-1], logp[-1] * 0.9),
                        "grad_norm": 0.5 * step, "loss": 0.1 / step, "clip_fraction": 0.0,
                        "exit_probs": [0.2, 0.3, 0.5]})
    path = tmp_path / "rl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import plot_run
    finally:
        sys.path.remove(os.path.join(ROOT, "tools"))
    assert plot_run.main([str(path), "--output", str(tmp_path / "rl.png")]) == 0
    assert os.path.getsize(tmp_path / "rl.png") > 0
    fig, panels = draw_rl_run(records)
    axes = {ax.get_title(): ax for ax in fig.axes}
    lines = {ax.get_title(): [list(line.get_ydata()) for line in ax.lines]
             for ax in fig.axes}
    assert set(panels) <= set(axes)
    assert lines["log-prob per loop step"] == [[r["step_log_probs"][t] for r in records]
                                               for t in range(3)]
    assert lines["reward and solve rate"][0] == [r["reward_mean"] for r in records]
    assert lines["KL to the reference"] == [[r["kl"] for r in records]]
    assert lines["exit distribution"] == [[0.2] * 3, [0.3] * 3, [0.5] * 3]


def test_null_tokenizer_with_a_text_environment_is_refused_in_one_line():
    argv = [*TINY, "--tokenizer-type", "NullTokenizer", "--vocab-size", "63", "--env",
            "demo-tasks", "--env-path", TASKS, "--env-limit", "4", "--prompts-per-step", "2",
            "--group-size", "2", "--micro-batch-size", "2"]
    got = run_distributed(_refusals, 1, [argv])[0][0]
    assert got is not None and "\n" not in got, got
    assert got.startswith("--tokenizer-type NullTokenizer reads text as space-separated token "
                          "ids, and prompt 0 of --env demo-tasks is text"), got


BAD_REWARD = '''
import math

from megaloop.rl.environments import Environment, Prompt


class BadReward(Environment):
    """Two prompts of NullTokenizer ids: prompt ``bad`` is rewarded ``value`` (``raise``: its
    reward() raises; ``hang``: it never returns, and writes ``unwound`` if its call unwinds),
    the other 1.0."""

    def __init__(self, value="nan", bad=1, unwound=None):
        self.value, self.bad, self.unwound = value, bad, unwound
        self.items = [Prompt("1 2 3", ""), Prompt("4 5", "")]

    def prompts(self):
        return self.items

    def reward(self, prompt, completion):
        if self.items.index(prompt) != self.bad:
            return 1.0
        if self.value == "raise":
            raise ZeroDivisionError("the checker divided by zero")
        if self.value == "hang":  # a busy loop that catches every Exception, as careless code may
            try:
                while True:
                    try:
                        pass
                    except Exception:
                        pass
            finally:
                open(self.unwound, "w").close()
        return {"nan": math.nan, "inf": -math.inf, "none": None, "text": "1.0",
                "huge": 10 ** 400}[self.value]
'''


@pytest.mark.parametrize("value,world,want", [
    ("nan", 1, "reward() returned nan for prompt 1 (completion"),
    ("inf", 1, "reward() returned -inf for prompt 1 (completion"),
    ("none", 1, "reward() returned None for prompt 1 (completion"),
    ("text", 1, "reward() returned '1.0' for prompt 1 (completion"),
    ("raise", 1, "reward() raised on prompt 1 (completion"),
    ("huge", 1, "reward() returned an integer of 401 digits for prompt 1 (completion"),
    ("nan", 2, "reward() returned nan for prompt 1 (completion"),  # one data-parallel rank's
])
def test_a_reward_that_is_not_a_finite_number_stops_the_run(tmp_path, value, world, want):
    """Exit 2 and one line naming the environment, the prompt and the value (or the cause),
    on every rank alike (with DP=2 only one rank draws the bad prompt: neither hangs)."""
    from test_rl_train import MODEL

    (tmp_path / "bad.py").write_text(BAD_REWARD)
    env = f"{tmp_path / 'bad.py'}:BadReward"
    argv = [*MODEL, "--env", env, "--env-args", f"value={value}", "--prompts-per-step", "2",
            "--group-size", "2", "--max-new-tokens", "3", "--micro-batch-size", "2",
            "--train-iters", "2", "--log-jsonl", str(tmp_path / "log.jsonl")]
    ranks = run_distributed(_main, world, argv, True)
    assert [code for code, _ in ranks] == [2] * world
    lines = ranks[0][1].strip().split("\n")
    assert len(lines) == 1 and lines[0].startswith(f"error: --env {env}: {want}"), lines
    if value == "raise":
        assert lines[0].endswith("): ZeroDivisionError: the checker divided by zero"), lines
    else:
        assert lines[0].endswith("; a reward must be a finite number"), lines
    assert not os.path.exists(tmp_path / "log.jsonl") or not open(tmp_path / "log.jsonl").read()
