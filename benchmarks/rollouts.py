"""RL rollout throughput of this tree's Generator against another revision's (prints, never
asserts).

    python benchmarks/rollouts.py --rev <git revision> [--groups 8 --group-size 8 --rounds 5]

The RL trainer samples ``groups x G`` completions per step in one ``Generator.generate`` call
(megaloop/rl/rollouts.py): G copies of each prompt, sampled at temperature 0.9 from row streams.
This times that call on a randomly initialised looped model (``--hidden-size``, T = 4, no end of
document, so every configuration decodes the same number of tokens) for this tree and for
``--rev`` (checked out into a temporary git worktree), each in its own process with the same
seed, shape and prompts (prompt lengths spread over 6..24 tokens as the demo tasks' are),
alternating the two trees over ``--rounds`` rounds so that machine drift hits both. Prints the
generated tokens/s of each round, the medians, and this tree's over the other's; with
``--exit q:0.5`` the rollouts also exit early (this tree only: the rule is part of the RL
rollout path since the engine became it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One measurement, run by `python -c` inside a tree (its package first on sys.path).
MEASURE = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from megaloop.runtime import quiet_megatron
quiet_megatron()
import torch
a = json.loads(sys.argv[2])
torch.set_num_threads(a["threads"])
from megaloop.inference.loading import setup_processes
setup_processes()
from megaloop.model.config import LoopConfig, ModelConfig
from megaloop.model.looped_gpt import build_model
from megaloop.inference.generate import Generator, SamplingParams
torch.manual_seed(1234)
cfg = ModelConfig(num_layers=2, hidden_size=a["hidden"], num_attention_heads=4,
                  max_position_embeddings=128, transformer_impl="local", swiglu=True,
                  position_embedding_type="rope", normalization="RMSNorm", hidden_dropout=0.0,
                  attention_dropout=0.0, disable_bias_linear=True)
model = build_model(cfg, LoopConfig(num_loops=4), a["vocab"]).eval()
g = torch.Generator().manual_seed(7)
prompts = [torch.randint(3, a["vocab"] - 8, (6 + (9 * i) % 19,), generator=g).tolist()
           for i in range(a["groups"])]
batch = [p for p in prompts for _ in range(a["group_size"])]
kw = {}
if a["exit"]:
    from megaloop.model.exit_rules import parse_exit
    kw["exit_rule"] = parse_exit(a["exit"])
gen = Generator(model, a["vocab"] - 8, **kw)
params = SamplingParams(temperature=0.9, seed=11)
gen.generate(batch[:4], 4, params)  # warm-up
rates = []
for _ in range(a["repeats"]):
    start = time.perf_counter()
    out = gen.generate(batch, a["max_tokens"], params)
    rates.append(sum(map(len, out)) / (time.perf_counter() - start))
print("RATE", json.dumps(rates))
"""


def measure(tree: str, a, exit_rule: str = "") -> list:
    args = {"hidden": a.hidden_size, "vocab": a.vocab, "groups": a.groups,
            "group_size": a.group_size, "max_tokens": a.max_tokens, "repeats": a.repeats,
            "threads": a.threads, "exit": exit_rule}
    env = dict(os.environ, PYTHONPATH=tree)
    done = subprocess.run([sys.executable, "-c", MEASURE, tree, json.dumps(args)], cwd=tree,
                          env=env, capture_output=True, text=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RATE ")), None)
    if done.returncode or line is None:
        raise SystemExit(f"the measurement in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(line[5:])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rev", required=True, help="the revision to compare with")
    p.add_argument("--groups", type=int, default=8, help="prompts per rollout")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2, help="timed calls per process")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--exit", default="", help="also time this tree's rollouts under this rule")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        before = os.path.join(tmp, "before")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", before, a.rev],
                       check=True, capture_output=True)
        try:
            rates = {"this": [], a.rev: [], "exit": []}
            for i in range(a.rounds):
                order = [("this", ROOT), (a.rev, before)]
                for name, tree in order if i % 2 == 0 else order[::-1]:
                    rates[name] += measure(tree, a)
                if a.exit:
                    rates["exit"] += measure(ROOT, a, a.exit)
                print(f"round {i + 1}: " + ", ".join(
                    f"{k} {v[-1]:.1f}" for k, v in rates.items() if v), flush=True)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", before],
                           capture_output=True)
    print(f"Rollouts of {a.groups} prompts x G = {a.group_size}, {a.max_tokens} tokens each, "
          f"hidden {a.hidden_size}, T = 4, {a.threads} thread(s); generated tokens/s, median "
          f"(min-max) of {a.rounds * a.repeats}:")
    for name, values in rates.items():
        if values:
            print(f"  {name:>12}: {statistics.median(values):8.1f} "
                  f"({min(values):.1f}-{max(values):.1f})")
    ratio = statistics.median(rates["this"]) / statistics.median(rates[a.rev])
    print(f"this tree / {a.rev}: {ratio:.2f}x")
    if rates["exit"]:
        print(f"this tree with --exit {a.exit} / {a.rev}: "
              f"{statistics.median(rates['exit']) / statistics.median(rates[a.rev]):.2f}x")


if __name__ == "__main__":
    main()
