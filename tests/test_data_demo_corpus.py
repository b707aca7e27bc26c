"""tools/make_demo_corpus.py: deterministic by seed, and every stated answer is right (checked by
solving each problem here with an independent little interpreter)."""

import importlib.util
import json
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_tool():
    spec = importlib.util.spec_from_file_location(
        "make_demo_corpus", os.path.join(REPO, "megaloop", "cli", "make_demo_corpus.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def solve(question: str) -> str:
    if m := re.match(r"(.*)\. start at (\w), follow (\d+) arrows", question):
        table = dict(pair.split("->") for pair in m.group(1).split(", "))
        node = m.group(2)
        for _ in range(int(m.group(3))):
            node = table[node]
        return node
    if m := re.match(r"(.*)\. what is (\w)\?", question):
        env = dict(fact.split("=") for fact in m.group(1).split(". "))
        name = m.group(2)
        while not env[name].isdigit():
            name = env[name]
        return env[name]
    *assignments, target = question.split("; ")
    env: dict[str, int] = {}
    for a in assignments:
        name, expr = a.split("=")
        tokens = re.match(r"(\w+)(?:([+\-*])(\d+))?$", expr).groups()
        value = int(tokens[0]) if tokens[0].isdigit() else env[tokens[0]]
        if tokens[1]:
            n = int(tokens[2])
            value = value + n if tokens[1] == "+" else value - n if tokens[1] == "-" else value * n
        env[name] = value
    return str(env[target.rstrip("=?")])


def test_demo_corpus_is_deterministic_and_correct(tmp_path):
    tool = load_tool()
    for run in ("a", "b"):
        tool.main(["--output", str(tmp_path / f"{run}.jsonl"), "--num-docs", "200",
                   "--sft-output", str(tmp_path / f"{run}_sft.jsonl"), "--seed", "7"])
    for name in ("a.jsonl", "a_sft.jsonl"):
        assert (tmp_path / name).read_bytes() == (tmp_path / name.replace("a", "b", 1)
                                                  ).read_bytes()
    checked = 0
    for line in open(tmp_path / "a_sft.jsonl"):
        row = json.loads(line)
        assert row["response"] == f"answer: {solve(row['prompt'])}."
        checked += 1
    for line in open(tmp_path / "a.jsonl"):
        for part in json.loads(line)["text"].split("\n"):
            if m := re.match(r"(.*\?) answer: (\w+)\.$", part):
                assert m.group(2) == solve(m.group(1)), part
                checked += 1
    assert checked > 400


def test_hops_family_answers_follow_one_cycle(tmp_path):
    """--families hops: each table is one cycle through the 8 nodes (so the k <= 6 nodes
    visited are distinct and the answer is never the start), and every answer is k arrows on;
    the default families' output does not change when the flag is spelled out."""
    tool = load_tool()
    tool.main(["--output", str(tmp_path / "h.jsonl"), "--num-docs", "50", "--families", "hops",
               "--prose-fraction", "0", "--sft-output", str(tmp_path / "h_sft.jsonl"),
               "--seed", "3"])
    checked = 0
    for line in open(tmp_path / "h_sft.jsonl"):
        row = json.loads(line)
        m = re.match(r"((?:[A-H]{2} ){7}[A-H]{2})\. go (\d) from ([A-H])$", row["prompt"])
        table = dict(arrow for arrow in m.group(1).split())
        node, k = m.group(3), int(m.group(2))
        seen = {node}
        for _ in range(k):
            node = table[node]
            seen.add(node)
        walk, n = m.group(3), 0
        while True:  # the cycle through every node
            walk, n = table[walk], n + 1
            if walk == m.group(3):
                break
        assert n == 8 and len(seen) == k + 1, row
        assert row["response"] == f"{node}."  # right after the start: no cue (see hops)
        checked += 1
    assert checked == 50
    for name, flags in (("a", []), ("b", ["--families", "arithmetic,binding,pointers",
                                          "--prose-fraction", "0.4"])):
        tool.main(["--output", str(tmp_path / f"{name}.jsonl"), "--num-docs", "100",
                   "--seed", "9", *flags])
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


def test_one_step_share_skews_training_k_only(tmp_path):
    """--one-step-share P: a training problem has k = 1 with probability P + (1 - P) / max_steps
    (the share, then the uniform draw), answers still follow the table, and the held-out problems
    are the same bytes as without the flag (their k stays uniform)."""
    tool = load_tool()
    common = ["--num-docs", "20", "--families", "hops", "--prose-fraction", "0", "--num-sft",
              "1200", "--seed", "5", "--max-steps", "6"]
    for name, share in (("skew", "0.4"), ("flat", "0")):
        tool.main(["--output", str(tmp_path / f"{name}.jsonl"), *common,
                   "--sft-output", str(tmp_path / f"{name}_sft.jsonl"),
                   "--tasks-output", str(tmp_path / f"{name}_tasks.jsonl"),
                   "--one-step-share", share])
    ks = {}
    for name in ("skew", "flat"):
        rows = [json.loads(line) for line in open(tmp_path / f"{name}_sft.jsonl")]
        for row in rows:
            m = re.match(r"((?:[A-H]{2} ){7}[A-H]{2})\. go (\d) from ([A-H])$", row["prompt"])
            table, node = dict(arrow for arrow in m.group(1).split()), m.group(3)
            for _ in range(int(m.group(2))):
                node = table[node]
            assert row["response"] == f"{node}."
        ks[name] = sum(" go 1 from " in row["prompt"] for row in rows) / len(rows)
    # expected shares 0.4 + 0.6 / 6 = 0.5 and 1 / 6; binomial sd over 1200 draws <= 0.015
    assert abs(ks["skew"] - 0.5) < 0.05 and abs(ks["flat"] - 1 / 6) < 0.05, ks
    assert (tmp_path / "skew_tasks.jsonl").read_bytes() == \
        (tmp_path / "flat_tasks.jsonl").read_bytes()
    with pytest.raises(SystemExit):
        tool.main(["--output", str(tmp_path / "x.jsonl"), "--one-step-share", "1.5"])


def rule30_moving_frame(cells: list[int], k: int) -> list[int]:
    """Wolfram's rule 30 (the new cell is bit 4l + 2c + r of the number 30) on the row with zeros
    to its left, run k steps in the fixed frame; cell i of the moving frame after k steps is
    cell i - k of the fixed one. Cells right of the row never reach the answer (the moving
    frame's cells depend on their left only), so zeros there are as good as anything."""
    pad = k + 2
    row = [0] * pad + cells + [0] * pad
    for _ in range(k):
        row = [0] + [(30 >> (4 * row[j - 1] + 2 * row[j] + row[j + 1])) & 1
                     for j in range(1, len(row) - 1)] + [0]
    return [row[pad + i - k] for i in range(len(cells))]


def test_automaton_answers_are_rule_30(tmp_path):
    """--families automaton: every answer, in the corpus, the SFT pairs and the held-out
    problems, is the row after k steps of rule 30 (computed here from the rule's number in the
    fixed frame), k covers 1..max-steps, and each held-out problem's choices are four distinct
    rows with the answer at ``gold``."""
    tool = load_tool()
    tool.main(["--output", str(tmp_path / "c.jsonl"), "--num-docs", "40", "--families",
               "automaton", "--prose-fraction", "0", "--sft-output", str(tmp_path / "s.jsonl"),
               "--num-sft", "200", "--tasks-output", str(tmp_path / "t.jsonl"),
               "--num-tasks", "60", "--seed", "4", "--max-steps", "6"])
    pattern = re.compile(r"((?:[ox] ){15}[ox]) after (\d)")

    def expected(question):
        m = pattern.fullmatch(question)
        cells = [int(c == "x") for c in m.group(1).split()]
        return " ".join("ox"[c] for c in rule30_moving_frame(cells, int(m.group(2)))), \
            int(m.group(2))

    ks, checked = set(), 0
    for row in map(json.loads, open(tmp_path / "s.jsonl")):
        answer, k = expected(row["prompt"])
        assert row["response"] == f"{answer}.", row
        ks.add(k)
        checked += 1
    for line in open(tmp_path / "c.jsonl"):
        for part in json.loads(line)["text"].split("\n"):
            m = re.fullmatch(r"(.* after \d) ((?:[ox] ){15}[ox])\.", part)
            assert m.group(2) == expected(m.group(1))[0], part
            checked += 1
    for item in map(json.loads, open(tmp_path / "t.jsonl")):
        assert (item["answer"], item["k"]) == expected(item["question"])
        assert item["choices"][item["gold"]] == item["answer"]
        assert len(set(item["choices"])) == 4
        checked += 1
    assert ks == set(range(1, 7)) and checked > 300
