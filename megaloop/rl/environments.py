"""Environments: a prompt set and a verifiable reward for each completion.

An environment is a class with two methods, ``prompts()`` (the ``Prompt`` items a rollout
samples from) and ``reward(prompt, completion) -> float`` (the completion is the text the policy
wrote after ``prompt.text``). Shipped:

- ``demo-tasks``: the demo corpus' exact-answer problems (arithmetic chains, k-hop variable
  binding, pointer chasing, 8-node hops) from a ``tools/make_demo_corpus.py --tasks-output``
  file; reward 1 when the completion's first word is the answer.
- ``gsm8k``: GSM8K-style problems (``question``, and ``answer`` ending in ``#### 42``); reward 1
  when the number after the completion's last ``####`` equals the gold one.
- ``countdown``: numbers and a target, generated from a seed; reward 1 when the completion's
  expression uses each number exactly once with + - * / and parentheses and evaluates to the
  target (parsed by ``ast`` into an allow-list of nodes and evaluated on fractions: no eval()).

Adding one takes one file: subclass ``Environment``, register it, and name it (or the file)::

    # my_env.py
    from megaloop.rl.environments import Environment, Prompt, register

    @register("parity")
    class Parity(Environment):
        def __init__(self, size: int = 100):
            self.items = [Prompt(f"{a} {b} parity:", str((a + b) % 2))
                          for a in range(10) for b in range(10)][:size]
        def prompts(self):
            return self.items
        def reward(self, prompt, completion):
            return float(completion.strip()[:1] == prompt.answer)

    load_environment("my_env.py:Parity", size=50)   # or "parity" once my_env is imported

Rewards are plain floats; a group's advantage is computed from them by
megaloop.rl.objectives.group_advantages. train_rl.py checks what ``prompts()`` returns
(``checked_prompts``) and that no prompt tokenizes to nothing before any process group starts.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import operator
import random
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Optional


@dataclass(frozen=True)
class Prompt:
    """One item of an environment's prompt set."""

    text: str
    """What the policy is given (it continues this text)."""
    answer: str
    """What the reward checks the completion against (its meaning is the environment's)."""
    meta: dict = field(default_factory=dict, hash=False, compare=False)
    """Anything else the environment or a report needs (e.g. family and k of a demo task)."""


class Environment:
    """The interface: a prompt set and a reward. Subclasses override both methods."""

    def prompts(self) -> list[Prompt]:
        raise NotImplementedError

    def reward(self, prompt: Prompt, completion: str) -> float:
        raise NotImplementedError


ENVIRONMENTS: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make ``cls`` loadable by ``name``."""
    def add(cls: type) -> type:
        if name in ENVIRONMENTS and ENVIRONMENTS[name] is not cls:
            raise ValueError(f"environment {name!r} is registered twice ({ENVIRONMENTS[name]} "
                             f"and {cls})")
        ENVIRONMENTS[name] = cls
        return cls
    return add


def load_environment(spec: str, **kwargs) -> Environment:
    """A registered name (``countdown``), or ``path/to/file.py:ClassName`` (a user's file,
    imported here); ``kwargs`` go to the class. ValueError names what is wrong."""
    if spec in ENVIRONMENTS:
        return ENVIRONMENTS[spec](**kwargs)
    if ":" in spec and spec.split(":", 1)[0].endswith(".py"):
        path, name = spec.rsplit(":", 1)
        module_spec = importlib.util.spec_from_file_location(f"megaloop_user_env_{name}", path)
        if module_spec is None:
            raise ValueError(f"environment {spec}: cannot import {path}")
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except FileNotFoundError:
            raise ValueError(f"environment {spec}: {path} not found") from None
        cls = getattr(module, name, None)
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise ValueError(f"environment {spec}: {path} has no Environment subclass {name}")
        return cls(**kwargs)
    raise ValueError(f"environment {spec!r}: not one of {', '.join(sorted(ENVIRONMENTS))}, nor "
                     f"a FILE.py:CLASS of your own")


def checked_prompts(env: Environment, name: str) -> list[Prompt]:
    """``env.prompts()``, checked: a non-empty list (or tuple) of Prompt whose texts are str;
    else ValueError, one line naming ``--env name`` and what prompts() returned (a wrong type
    would otherwise fail far from it, in the tokenizer or the sampler)."""
    try:
        items = env.prompts()
    except Exception as exc:  # the user's code: name where it failed, keep its own message
        cause = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise ValueError(f"--env {name}: prompts() raised {cause}") from None
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"--env {name}: prompts() returned {_shown(items)}; it must return a "
                         f"list of Prompt (megaloop.rl.environments.Prompt)")
    if not items:
        raise ValueError(f"--env {name}: prompts() returned no prompts")
    for i, item in enumerate(items):
        if not isinstance(item, Prompt):
            raise ValueError(f"--env {name}: item {i} of the list prompts() returned is "
                             f"{_shown(item)}; every item must be a Prompt(text, answer) "
                             f"(megaloop.rl.environments.Prompt)")
        if not isinstance(item.text, str):
            raise ValueError(f"--env {name}: prompt {i}'s text is {_shown(item.text)}; it must "
                             f"be a str (the text the policy continues)")
    return list(items)


def _shown(value) -> str:
    """A value in a one-line message: its type and a short repr."""
    text = " ".join(repr(value).split())
    text = text if len(text) <= 60 else text[:60] + "..."
    return f"a {type(value).__name__} ({text})"


# --- demo tasks --------------------------------------------------------------------------------
def first_word(completion: str) -> str:
    """The completion's first word, without a trailing full stop: ' 14.' -> '14'."""
    words = completion.split()
    return words[0].rstrip(".") if words else ""


@register("demo-tasks")
class DemoTasks(Environment):
    """Held-out demo problems (``make_demo_corpus.py --tasks-output``); the prompt is the
    question as the corpus writes it (ending in ``answer:``), the policy writes `` 14.``."""

    def __init__(self, path: str, limit: int = 0):
        from megaloop.eval.tasks import read_tasks

        self.items = [Prompt(t["question"], str(t["answer"]),
                             {"family": t["family"], "k": t["k"]})
                      for t in read_tasks(path, limit)]

    def prompts(self) -> list[Prompt]:
        return self.items

    def reward(self, prompt: Prompt, completion: str) -> float:
        return float(first_word(completion) == prompt.answer)


# --- GSM8K -------------------------------------------------------------------------------------
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def final_answer(text: str) -> Optional[str]:
    """The number after the last ``####`` of ``text`` (commas, ``$`` and a trailing full stop
    dropped), or None when there is no ``####`` followed by a number."""
    if "####" not in text:
        return None
    match = _NUMBER.search(text.rsplit("####", 1)[1].replace("$", ""))
    return match.group(0).replace(",", "") if match else None


def same_number(a: str, b: str) -> bool:
    """``a`` and ``b`` are the same number (``72`` == ``72.0``), else equal as strings."""
    try:
        return Fraction(a) == Fraction(b)
    except (ValueError, ZeroDivisionError):
        return a == b


@register("gsm8k")
class GSM8K(Environment):
    """GSM8K-style JSONL (``question``; ``answer`` whose ``#### N`` is the gold number). The
    prompt is ``Question: ... Answer:``; a completion scores when its last ``####`` is N."""

    def __init__(self, path: str, limit: int = 0, template: str = "Question: {question}\nAnswer:"):
        self.items = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    question, solution = row["question"], row["answer"]
                except (ValueError, KeyError, TypeError):
                    raise ValueError(f"{path}:{lineno}: expected a JSON object with 'question' "
                                     f"and 'answer' (GSM8K's format)") from None
                gold = final_answer(solution)
                if gold is None:
                    raise ValueError(f"{path}:{lineno}: the answer has no '#### N' final line")
                self.items.append(Prompt(template.format(question=question), gold))
                if limit and len(self.items) == limit:
                    break
        if not self.items:
            raise ValueError(f"{path}: no problems")

    def prompts(self) -> list[Prompt]:
        return self.items

    def reward(self, prompt: Prompt, completion: str) -> float:
        answer = final_answer(completion)
        return float(answer is not None and same_number(answer, prompt.answer))


# --- countdown ---------------------------------------------------------------------------------
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}


def evaluate_expression(text: str) -> tuple[Fraction, list[int]]:
    """(value, the integer literals in order) of an arithmetic expression of non-negative
    integers, + - * / and parentheses; ValueError for anything else (names, calls, powers,
    unary minus, floats) or a division by zero. Exact: evaluated on fractions."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an expression: {text!r}") from None
    numbers: list[int] = []

    def value(node) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
            numbers.append(node.value)
            return Fraction(node.value)
        raise ValueError(f"{ast.dump(node)[:40]}: only integers, + - * / and parentheses")

    return value(tree.body), numbers


def countdown_expression(completion: str) -> str:
    """The expression of a completion: its first line, up to an ``=`` if it writes one."""
    line = completion.strip().split("\n", 1)[0]
    return line.split("=", 1)[0]


@register("countdown")
class Countdown(Environment):
    """Reach ``target`` from ``numbers`` (each used exactly once) with + - * /. Problems are
    drawn from ``seed``: ``count`` numbers in 1..``max_number``, and a target that a random
    expression over all of them reaches (a positive integer), so every problem is solvable."""

    def __init__(self, size: int = 1000, count: int = 3, max_number: int = 20, seed: int = 0):
        if count < 2:
            raise ValueError(f"countdown count {count}: needs at least 2 numbers")
        rng = random.Random(seed)
        self.items = []
        while len(self.items) < size:
            numbers = [rng.randint(1, max_number) for _ in range(count)]
            order = rng.sample(numbers, count)
            text = str(order[0])
            for n in order[1:]:
                text = f"({text}{rng.choice('+-*/')}{n})"
            try:
                target, _ = evaluate_expression(text)
            except ValueError:  # a division by zero: draw again
                continue
            if target.denominator != 1 or target <= 0:
                continue
            listed = " ".join(map(str, numbers))
            self.items.append(Prompt(
                f"numbers {listed}. reach {target.numerator} using each number once with + - "
                f"* /. expression:", str(target.numerator), {"numbers": numbers}))

    def prompts(self) -> list[Prompt]:
        return self.items

    def reward(self, prompt: Prompt, completion: str) -> float:
        try:
            value, used = evaluate_expression(countdown_expression(completion))
        except ValueError:
            return 0.0
        uses_each_once = sorted(used) == sorted(prompt.meta["numbers"])
        return float(uses_each_once and value == Fraction(int(prompt.answer)))
