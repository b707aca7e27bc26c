"""train_rl.py's one-line refusals of a bad environment: a reward() that never returns (stopped
by --reward-timeout on the rank that drew its prompt, every rank leaving with the same line), a
reward beyond a float's range, a prompts() that returns the wrong type, and a prompt with no
tokens (a user's environment, and demo-tasks with an empty question). The flag-level refusals of
--reward-timeout are in tests/test_rl_train_cli.py's REFUSALS."""

import json
import math
import signal
import time
from fractions import Fraction

import pytest

from distributed import run_distributed
from test_rl_train import MODEL
from test_rl_train_cli import BAD_REWARD, _main, _refusals


def test_a_reward_that_never_returns_is_stopped_on_every_rank(tmp_path):
    """DP=2: only rank 1 draws the hanging prompt; rank 0 waits in the step's gather of reward
    errors until rank 1's timeout, then both exit 2 with the same line. The hanging call
    unwound (its finally ran): nothing of it is left running."""
    (tmp_path / "bad.py").write_text(BAD_REWARD)
    env = f"{tmp_path / 'bad.py'}:BadReward"
    unwound = tmp_path / "unwound"
    argv = [*MODEL, "--env", env, "--env-args", "value=hang", f"unwound={unwound}",
            "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "3",
            "--micro-batch-size", "2", "--train-iters", "2", "--reward-timeout", "1.5",
            "--log-jsonl", str(tmp_path / "log.jsonl")]
    start = time.time()
    ranks = run_distributed(_main, 2, argv, True)
    assert time.time() - start < 60
    assert [code for code, _ in ranks] == [2, 2]
    lines = ranks[0][1].strip().split("\n")
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: --env {env}: reward() did not return within "
                               f"--reward-timeout 1.5 s on prompt 1 (completion "), lines
    assert lines[0].endswith("; fix it, or raise --reward-timeout if it is only slow"), lines
    assert unwound.exists()
    assert not (tmp_path / "log.jsonl").exists() or not (tmp_path / "log.jsonl").read_text()


def test_checked_reward_against_float_conversion():
    """What float() refuses or turns into inf is refused; what it converts is the reward."""
    from megaloop.rl.environments import Environment, Prompt
    from megaloop.rl.rollouts import RewardError, checked_reward

    class Returns(Environment):
        def __init__(self, value):
            self.value = value

        def reward(self, prompt, completion):
            return self.value

    prompt = Prompt("1 2", "")
    for value in (Fraction(1, 3), 10 ** 300, True, -2):  # within a float's range
        assert checked_reward(Returns(value), "e", prompt, 0, " 3", timeout=5) == float(value)
    for value, shown in ((10 ** 400, "an integer of 401 digits"),
                         (-10 ** 400, "an integer of 401 digits"),
                         (10 ** 5000, "an integer of over 4000 digits"),  # repr refuses it
                         (Fraction(10 ** 400, 3), "Fraction(1" + "0" * 50),
                         (Fraction(10 ** 309), "Fraction(1" + "0" * 50)):
        with pytest.raises(RewardError) as info:
            checked_reward(Returns(value), "e", prompt, 4, " 3", timeout=5)
        message = str(info.value)
        assert message.startswith(f"--env e: reward() returned {shown}"), message
        assert message.endswith("for prompt 4 (completion ' 3'); it is beyond a float's "
                                "range; a reward must be a finite number"), message
        assert "\n" not in message and len(message) < 300


def test_reward_deadline_leaves_the_alarm_as_it_found_it():
    """Around each reward() call only: the previous SIGALRM handler is back and no timer is
    left running, whether the call returned, raised or timed out."""
    from megaloop.rl.rollouts import RewardTimeout, reward_deadline

    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGALRM, mine)
    try:
        with reward_deadline(5):
            pass
        with pytest.raises(KeyError):
            with reward_deadline(5):
                raise KeyError("x")
        start = time.time()
        with pytest.raises(RewardTimeout):
            with reward_deadline(0.2):
                while True:
                    time.sleep(0.01)
        assert 0.2 <= time.time() - start < 5
        assert signal.getsignal(signal.SIGALRM) is mine
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    finally:
        signal.signal(signal.SIGALRM, previous)


PROMPTS = '''
from megaloop.rl.environments import Environment, Prompt


class Returns(Environment):
    """prompts() returns what ``kind`` names."""

    def __init__(self, kind):
        self.kind = kind

    def prompts(self):
        good = [Prompt(f"{i} {i + 1}", "") for i in range(4)]
        if self.kind == "raise":
            raise OSError("the problem file is gone")
        return {"dict": {"a": good[0]}, "generator": (p for p in good), "none": None,
                "strings": ["1 2", "3 4", "5 6", "7 8"], "empty": [],
                "int_text": good[:2] + [Prompt(7, "")] + good[2:],
                "empty_text": good[:3] + [Prompt("", "")], "blank_text": [Prompt("  ", "")] + good,
                "tuple": tuple(good)}[self.kind]

    def reward(self, prompt, completion):
        return 1.0
'''

PROMPT_REFUSALS = [
    ("dict", "prompts() returned a dict ({'a': Prompt(text='0 1', answer='', meta={})}); it "
             "must return a list of Prompt (megaloop.rl.environments.Prompt)"),
    ("generator", "prompts() returned a generator (<generator object"),
    ("none", "prompts() returned a NoneType (None); it must return a list of Prompt"),
    ("strings", "item 0 of the list prompts() returned is a str ('1 2'); every item must be a "
                "Prompt(text, answer) (megaloop.rl.environments.Prompt)"),
    ("empty", "prompts() returned no prompts"),
    ("int_text", "prompt 2's text is a int (7); it must be a str (the text the policy "
                 "continues)"),
    ("raise", "prompts() raised OSError: the problem file is gone"),
    ("empty_text", "prompt 3 (counting from 0) has no tokens (its text is ''); every prompt "
                   "needs at least one token for the policy to continue: give it text, or "
                   "leave it out"),
    ("blank_text", "prompt 0 (counting from 0) has no tokens (its text is '  ')"),
]


def test_a_bad_prompt_set_is_refused_in_one_line(tmp_path):
    (tmp_path / "returns.py").write_text(PROMPTS)
    env = f"{tmp_path / 'returns.py'}:Returns"
    base = [*MODEL, "--env", env, "--prompts-per-step", "2", "--group-size", "2",
            "--micro-batch-size", "2"]
    cases = [base + ["--env-args", "kind=tuple"]]
    cases += [base + ["--env-args", f"kind={kind}"] for kind, _ in PROMPT_REFUSALS]
    messages = run_distributed(_refusals, 1, cases)[0]
    assert messages[0] is None  # a tuple of Prompt is a prompt set
    for (kind, want), got in zip(PROMPT_REFUSALS, messages[1:]):
        assert got is not None and got.startswith(f"--env {env}: {want}"), (kind, got)
        assert "\n" not in got


def test_demo_tasks_with_an_empty_question_names_it_and_its_file(tmp_path):
    """demo-tasks reads its questions from --env-path: an empty one is named by its index and
    the file, through train_rl.py as a user runs it (exit 2, one line)."""
    path = tmp_path / "tasks.jsonl"
    questions = ["1 2 3", "4 5", "", "6 7"]
    path.write_text("".join(json.dumps({"family": "arith", "k": 1, "question": q,
                                        "answer": 3}) + "\n" for q in questions))
    argv = [*MODEL, "--env", "demo-tasks", "--env-path", str(path), "--prompts-per-step", "2",
            "--group-size", "2", "--micro-batch-size", "2", "--train-iters", "1"]
    code, err = run_distributed(_main, 1, argv, True)[0]
    assert code == 2
    assert err.strip().split("\n") == [
        f"error: --env demo-tasks: prompt 2 (counting from 0) (read from --env-path {path}) has "
        f"no tokens (its text is ''); every prompt needs at least one token for the policy to "
        f"continue: give it text, or leave it out"]


def test_the_shipped_default_reward_timeout_is_in_range():
    """The default must pass the check it imposes on the user's value (below the default
    collective timeout), and be a number: the CLI derives --reward-timeout from the field."""
    from megaloop.parallel.config import ParallelConfig
    from megaloop.rl.config import RLConfig, build_parser

    default = RLConfig().reward_timeout
    assert 0 < default < ParallelConfig().distributed_timeout_minutes * 60
    assert math.isfinite(default)
    help_text = build_parser().format_help()
    assert "--reward-timeout" in help_text
