"""megaloop.rl.environments against hand cases: exact-answer demo tasks, GSM8K's '#### N'
extractor, countdown's safe parser and reward, and a user's environment loaded from its file.
Countdown's generated problems are checked solvable by a brute-force solver written here."""

import itertools
import json
from fractions import Fraction

import pytest

from megaloop.rl.environments import (Countdown, GSM8K, Prompt, evaluate_expression,
                                      final_answer, load_environment)
from test_data_demo_corpus import load_tool


def test_demo_tasks_reward_the_exact_first_word(tmp_path):
    tool = load_tool()
    path = tmp_path / "tasks.jsonl"
    tool.main(["--output", str(tmp_path / "c.jsonl"), "--num-docs", "1", "--tasks-output",
               str(path), "--num-tasks", "20", "--seed", "5"])
    rows = [json.loads(line) for line in open(path)]
    env = load_environment("demo-tasks", path=str(path))
    prompts = env.prompts()
    assert [p.text for p in prompts] == [r["question"] for r in rows]
    for p, row in zip(prompts, rows):
        assert p.text.endswith("answer:") and p.meta == {"family": row["family"], "k": row["k"]}
        assert env.reward(p, f" {row['answer']}.") == 1.0
        assert env.reward(p, f" {row['answer']}.\nmore text") == 1.0
        assert env.reward(p, f" {row['answer']}0.") == 0.0  # a longer number is wrong
    hand = Prompt("a=3; b=a+4; b=? answer:", "7")
    for completion, reward in ((" 7.", 1.0), ("7", 1.0), (" 8.", 0.0), ("", 0.0),
                               (" answer 7", 0.0)):
        assert env.reward(hand, completion) == reward, completion


def test_gsm8k_extracts_the_last_hash_answer(tmp_path):
    assert final_answer("so 3 + 4 = 7\n#### 7") == "7"
    assert final_answer("#### 1,234") == "1234"
    assert final_answer("#### $18.") == "18"
    assert final_answer("#### 5 then #### -6") == "-6"
    assert final_answer("the answer is 7") is None
    assert final_answer("#### none") is None
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"question": "Tom has 3 apples and buys 4. How many?",
                                "answer": "3 + 4 = <<3+4=7>>7\n#### 7"}) + "\n")
    env = GSM8K(str(path))
    prompt, = env.prompts()
    assert prompt.text == "Question: Tom has 3 apples and buys 4. How many?\nAnswer:"
    assert prompt.answer == "7"
    for completion, reward in ((" 3+4=7\n#### 7", 1.0), (" #### 7.0", 1.0), ("#### 7,", 1.0),
                               (" 7", 0.0), ("#### 8", 0.0), ("#### 7 no, #### 8", 0.0),
                               ("#### -7", 0.0)):
        assert env.reward(prompt, completion) == reward, completion
    path.write_text(json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    with pytest.raises(ValueError, match=r"gsm.jsonl:1: .*####"):
        GSM8K(str(path))


def test_countdown_parser_refuses_everything_but_arithmetic():
    assert evaluate_expression("(3+5)*2") == (Fraction(16), [3, 5, 2])
    assert evaluate_expression(" 7 / 2 ") == (Fraction(7, 2), [7, 2])
    for text in ("2**3", "__import__('os').system('true')", "3/0", "-3+5", "3.5*2", "x+1",
                 "(1, 2)", "True+1", "3 +", "abs(-3)"):
        with pytest.raises(ValueError):
            evaluate_expression(text)


def test_countdown_reward_needs_each_number_once_and_the_target():
    env = Countdown(size=1)
    prompt = Prompt("numbers 3 5 2. reach 16 ...", "16", {"numbers": [3, 5, 2]})
    for completion, reward in ((" (3+5)*2", 1.0), ("(5+3)*2 = 16\nbecause", 1.0),
                               ("3*5+2", 0.0),        # 17
                               ("8*2", 0.0),          # not the given numbers
                               ("(3+5)*2*1", 0.0),    # a number that is not given
                               ("(3+3)*2+4", 0.0),    # 3 twice
                               ("import os", 0.0), ("", 0.0), ("(3+5)*2/0", 0.0)):
        assert env.reward(prompt, completion) == reward, completion


def _solvable(numbers, target) -> bool:
    """Brute force: every order of the numbers, every operator and every bracketing."""
    def values(nums):
        if len(nums) == 1:
            yield Fraction(nums[0])
            return
        for cut in range(1, len(nums)):
            for a in values(nums[:cut]):
                for b in values(nums[cut:]):
                    yield from (a + b, a - b, a * b)
                    if b != 0:
                        yield a / b
    return any(v == target for order in itertools.permutations(numbers) for v in values(order))


def test_countdown_problems_are_solvable_and_seeded():
    env = Countdown(size=30, count=3, max_number=12, seed=3)
    assert [p.text for p in env.prompts()] == [p.text for p in Countdown(30, 3, 12, 3).prompts()]
    assert [p.text for p in env.prompts()] != [p.text for p in Countdown(30, 3, 12, 4).prompts()]
    for p in env.prompts():
        numbers = p.meta["numbers"]
        assert len(numbers) == 3 and all(1 <= n <= 12 for n in numbers)
        assert p.text.startswith("numbers " + " ".join(map(str, numbers)))
        assert _solvable(numbers, int(p.answer)), p.text


def test_a_user_environment_in_one_file(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(
        "from megaloop.rl.environments import Environment, Prompt\n"
        "class Parity(Environment):\n"
        "    def __init__(self, size=4):\n"
        "        self.items = [Prompt(f'{n} parity:', str(n % 2)) for n in range(size)]\n"
        "    def prompts(self):\n"
        "        return self.items\n"
        "    def reward(self, prompt, completion):\n"
        "        return float(completion.strip()[:1] == prompt.answer)\n")
    env = load_environment(f"{path}:Parity", size=3)
    assert [p.answer for p in env.prompts()] == ["0", "1", "0"]
    assert env.reward(env.prompts()[1], " 1") == 1.0 and env.reward(env.prompts()[1], "0") == 0.0
    with pytest.raises(ValueError, match="no Environment subclass Nope"):
        load_environment(f"{path}:Nope")
    with pytest.raises(ValueError, match="not one of countdown, demo-tasks, gsm8k"):
        load_environment("mathx")
