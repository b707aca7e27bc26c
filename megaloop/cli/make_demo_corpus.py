"""Write a small synthetic JSONL corpus on which recurrent depth matters.

Every document mixes templated prose (so a tokenizer has words to learn) with problems whose
answer needs k sequential steps: arithmetic chains, variable binding over k hops, and pointer
chasing in a table. A model must compose k operations, which a looped model can do by running
more loop steps. All text is generated here; the output is a pure function of --seed.

    python tools/make_demo_corpus.py --output demo.jsonl --num-docs 20000 \\
        --sft-output demo_sft.jsonl --seed 1

The alphabet is small (lowercase words, digits, a few symbols): a 512-1024 piece sentencepiece
vocabulary covers it.
"""

from __future__ import annotations

import json
import random
import string

from megaloop.arguments import ArgumentParser


NOUNS = ["river", "garden", "robot", "teacher", "window", "market", "letter", "forest",
         "engine", "island", "painter", "bridge", "kitchen", "student", "lantern", "castle",
         "farmer", "doctor", "sailor", "mountain", "village", "machine", "basket", "mirror",
         "ladder", "blanket", "tower", "orchard", "harvest", "compass", "journal", "pocket",
         "shadow", "candle", "wagon", "meadow", "pilot", "singer", "kettle", "puzzle",
         "giraffe", "thunder", "pebble", "feather", "violin", "quarry", "glacier", "umbrella"]
ADJECTIVES = ["quiet", "bright", "old", "small", "busy", "green", "cold", "patient", "heavy",
              "curious", "gentle", "narrow", "ancient", "careful", "silver", "hungry", "lazy",
              "clever", "wooden", "distant", "frozen", "golden", "noisy", "tiny", "brave",
              "sleepy", "strange", "honest", "crooked", "polished"]
VERBS = ["watches", "builds", "finds", "carries", "follows", "paints", "opens", "remembers",
         "counts", "visits", "repairs", "collects", "measures", "describes", "protects",
         "ignores", "borrows", "imagines", "pushes", "examines", "celebrates", "questions",
         "forgets", "delivers", "explores"]
PLACES = ["the hill", "the harbor", "the old road", "the library", "the station", "the field",
          "the workshop", "the lighthouse", "the museum", "the square", "the valley", "the pier"]
TIMES = ["in the morning", "at night", "after the rain", "every day", "before winter",
         "during the festival", "at noon", "on sunday", "since last autumn"]
VARS = list("abcdefghjkmnpqrstuvwxyz")


def prose(rng: random.Random) -> str:
    a, b = rng.sample(NOUNS, 2)
    templates = [
        f"the {rng.choice(ADJECTIVES)} {a} {rng.choice(VERBS)} the {b} near {rng.choice(PLACES)}.",
        f"{rng.choice(TIMES)}, the {rng.choice(ADJECTIVES)} {a} {rng.choice(VERBS)} the {b}.",
        f"nobody knows why the {a} {rng.choice(VERBS)} the {rng.choice(ADJECTIVES)} {b}.",
        f"the {a} and the {b} meet at {rng.choice(PLACES)} {rng.choice(TIMES)}.",
    ]
    return rng.choice(templates)


def arithmetic(rng: random.Random, steps: int) -> tuple[str, str]:
    """``a=3; b=a+4; c=b*2; c=?`` -> ``14``; values stay in 0..99."""
    names = rng.sample(VARS, steps + 1)
    value = rng.randint(0, 9)
    parts = [f"{names[0]}={value}"]
    for prev, name in zip(names, names[1:]):
        op = rng.choice("+-*") if value <= 49 else rng.choice("+-")
        if op == "+":
            n = rng.randint(1, min(9, 99 - value)) if value < 99 else 0
            value, text = value + n, f"{name}={prev}+{n}"
        elif op == "-":
            n = rng.randint(0, min(9, value))
            value, text = value - n, f"{name}={prev}-{n}"
        else:
            value, text = value * 2, f"{name}={prev}*2"
        parts.append(text)
    return "; ".join(parts) + f"; {names[-1]}=?", str(value)


def binding(rng: random.Random, hops: int) -> tuple[str, str]:
    """``x=7. y=x. z=y. what is z?`` -> ``7``, with distractor bindings shuffled in."""
    names = rng.sample(VARS, hops + 3)
    chain, distractors = names[: hops + 1], names[hops + 1:]
    value = rng.randint(0, 99)
    facts = [f"{chain[0]}={value}"] + [f"{b}={a}" for a, b in zip(chain, chain[1:])]
    facts += [f"{d}={rng.randint(0, 99)}" for d in distractors]
    rng.shuffle(facts)
    return ". ".join(facts) + f". what is {chain[-1]}?", str(value)


def pointers(rng: random.Random, hops: int) -> tuple[str, str]:
    """A table ``A->D, B->A, ...``; start somewhere and follow ``hops`` arrows."""
    letters = list(string.ascii_uppercase[:10])
    targets = letters[:]
    rng.shuffle(targets)
    table = ", ".join(f"{s}->{t}" for s, t in zip(letters, targets))
    node = start = rng.choice(letters)
    for _ in range(hops):
        node = targets[letters.index(node)]
    return f"{table}. start at {start}, follow {hops} arrows. where are you?", node


HOP_NODES = list(string.ascii_uppercase[:8])


def hops(rng: random.Random, k: int) -> tuple[str, str]:
    """``EB AF ... . go 3 from C`` -> the node 3 arrows on (``EB``: an arrow from E to B):
    pointer chasing sized for small models (8 nodes, about 20 tokens with a tokenizer that makes
    each arrow one piece, so that a hop is one attention look-up). The arrows form one cycle
    through all 8 nodes, so the k nodes visited are distinct (k < 8: no shortcut through a short
    cycle or a fixed point), and they are listed in shuffled order, so no hop can be read off a
    position: the k-hop task of "Reasoning with Latent Thoughts: On the Power of Looped
    Transformers" (Saunshi et al., 2025) in the short contexts a CPU run trains on. The question
    ends with the start node and the answer follows it with no cue in between (``ANSWER_CUE``):
    the answer is predicted at the start's own position, so one hop is one look-up; with a cue
    after the start, even k = 1 first needs a layer that carries the start forward, and at CPU
    size a looped 2 x 4 (1000 iterations) and dense 2 and dense 8 (up to 4000, k uniform) stayed
    at chance on it (2026-12-02)."""
    cycle = HOP_NODES[:]
    rng.shuffle(cycle)
    pairs = list(zip(cycle, cycle[1:] + cycle[:1]))
    rng.shuffle(pairs)
    node = start = rng.choice(HOP_NODES)
    table = dict(pairs)
    for _ in range(k):
        node = table[node]
    return " ".join(f"{s}{t}" for s, t in pairs) + f". go {k} from {start}", node


AUTOMATON_CELLS = 16
CELL = "ox"  # the two cell states, one piece each: cells are written apart, as "x o o x"


def automaton_step(row: list[int]) -> list[int]:
    """One step of rule 30 seen from a frame that moves one cell to the right per step:
    new x[i] = x[i-2] XOR (x[i-1] OR x[i]), cells left of the row being 0. Each cell depends
    only on itself and the two cells on its left, which is what a causal model sees. Rule 30 is
    chaotic: k steps are a function of 2k + 1 cells with no simpler form known."""
    pad = [0, 0] + row
    return [pad[i] ^ (pad[i + 1] | pad[i + 2]) for i in range(len(row))]


def automaton(rng: random.Random, k: int) -> tuple[str, str]:
    """``x o o x ... after 3`` -> the row of 16 cells after 3 steps of ``automaton_step``.
    Every step is the same local rule, applied to every cell at once: a model can do one step
    per layer (or per loop step), while a shallow model has to pack k steps into its few
    layers. Cells near the left edge depend on fewer cells (cell 0 never changes), so a row is
    learned from the left; it is scored whole."""
    row = [rng.randint(0, 1) for _ in range(AUTOMATON_CELLS)]
    out = row
    for _ in range(k):
        out = automaton_step(out)
    return f"{' '.join(CELL[c] for c in row)} after {k}", " ".join(CELL[c] for c in out)


TASKS = [arithmetic, binding, pointers]
FAMILIES = {f.__name__: f for f in TASKS + [hops, automaton]}
# What comes between a question and its answer: " answer:" (the word is part of the trained
# response in --sft-output), none for hops (see its docstring) and automaton (its answer is
# read cell by cell at fixed offsets from the row).
ANSWER_CUE = {"hops": "", "automaton": ""}


def cue(family: str) -> str:
    return ANSWER_CUE.get(family, " answer:")


def problem(rng: random.Random, max_steps: int, tasks: list = TASKS,
            one_step_share: float = 0.0) -> tuple[str, str, str]:
    """A training problem (family, question, answer): k uniform over 1..max_steps, except that
    a share ``one_step_share`` of the problems has k = 1. Small models learn the single step
    (one look-up) only when it is common enough, and a model that cannot do one step cannot
    learn to chain k of them. The extra draw is made only when the share is positive, so the
    default output is unchanged."""
    family = rng.choice(tasks)
    if one_step_share > 0 and rng.random() < one_step_share:
        return (family.__name__, *family(rng, 1))
    return (family.__name__, *family(rng, rng.randint(1, max_steps)))


def task_item(rng: random.Random, max_steps: int, tasks: list = TASKS) -> dict:
    """A held-out problem for evaluation: its family, its k (steps or hops), the prompt as the
    corpus writes it (ending in its family's cue, ``... answer:``), the answer, and four
    choices (the answer and three distractors of the same kind) with the answer's index."""
    family = rng.choice(tasks)
    k = rng.randint(1, max_steps)
    question, answer = family(rng, k)
    if family is automaton:  # three rows that differ from the answer in one to three cells
        choices = [answer]
        while len(choices) < 4:
            cells = answer.split()
            for i in rng.sample(range(len(cells)), rng.randint(1, 3)):
                cells[i] = CELL[1 - CELL.index(cells[i])]
            if " ".join(cells) not in choices:
                choices.append(" ".join(cells))
    else:
        pool = list(string.ascii_uppercase[:10]) if family is pointers else HOP_NODES \
            if family is hops else [str(v) for v in range(100)]
        choices = [answer] + rng.sample([c for c in pool if c != answer], 3)
    rng.shuffle(choices)
    return {"family": family.__name__, "k": k, "question": question + cue(family.__name__),
            "answer": answer, "choices": choices, "gold": choices.index(answer)}


def document(rng: random.Random, max_steps: int, tasks: list = TASKS,
             prose_fraction: float = 0.4, one_step_share: float = 0.0) -> str:
    parts = []
    for _ in range(rng.randint(2, 6)):
        if rng.random() < prose_fraction:
            parts.append(prose(rng))
        else:
            family, question, answer = problem(rng, max_steps, tasks, one_step_share)
            parts.append(f"{question}{cue(family)} {answer}.")
    return "\n".join(parts)


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", required=True, help="pretraining JSONL ({'text': ...} per line)")
    p.add_argument("--num-docs", type=int, default=10000)
    p.add_argument("--size-mb", type=float, default=None,
                   help="stop when the pretraining file reaches this size (overrides --num-docs)")
    p.add_argument("--sft-output", default=None,
                   help="also write prompt/response pairs of the same tasks")
    p.add_argument("--num-sft", type=int, default=None, help="default: --num-docs")
    p.add_argument("--tasks-output", default=None,
                   help="also write held-out problems with answers and choices (JSONL; "
                        "family, k, question, answer, choices, gold) for evaluation")
    p.add_argument("--num-tasks", type=int, default=300)
    p.add_argument("--max-steps", type=int, default=6, help="largest number of hops/steps")
    p.add_argument("--families", default="arithmetic,binding,pointers",
                   help=f"comma-separated problem families, of {', '.join(FAMILIES)} (hops: "
                        f"8-node pointer chasing, short enough for CPU-sized models)")
    p.add_argument("--prose-fraction", type=float, default=0.4,
                   help="probability that a document part is prose rather than a problem")
    p.add_argument("--one-step-share", type=float, default=0.0,
                   help="share of the training problems (corpus and --sft-output) drawn with "
                        "k = 1, the rest uniform over 1..--max-steps; held-out problems stay "
                        "uniform over k")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if not 0 <= args.one_step_share <= 1:
        p.error(f"--one-step-share {args.one_step_share} is not in [0, 1]")
    unknown = [f for f in args.families.split(",") if f not in FAMILIES]
    if unknown:
        p.error(f"--families {args.families}: unknown {', '.join(unknown)}; choose from "
                f"{', '.join(FAMILIES)}")
    if not 0 <= args.prose_fraction < 1:
        p.error(f"--prose-fraction {args.prose_fraction} is not in [0, 1)")
    tasks = [FAMILIES[f] for f in args.families.split(",")]

    rng = random.Random(args.seed)
    written = size = 0
    with open(args.output, "w") as f:
        while (size < args.size_mb * 2**20) if args.size_mb else (written < args.num_docs):
            line = json.dumps({"text": document(rng, args.max_steps, tasks,
                                                args.prose_fraction,
                                                args.one_step_share)}) + "\n"
            f.write(line)
            written, size = written + 1, size + len(line)
    print(f"wrote {written} documents ({size / 2**20:.1f} MiB) to {args.output}")
    if args.sft_output:
        # A separate stream, so the SFT file does not change the pretraining file.
        sft_rng = random.Random(args.seed + 1)
        n = args.num_sft if args.num_sft is not None else written
        with open(args.sft_output, "w") as f:
            for _ in range(n):
                family, question, answer = problem(sft_rng, args.max_steps, tasks,
                                                   args.one_step_share)
                f.write(json.dumps({"prompt": question,
                                    "response": f"{cue(family).strip()} {answer}.".lstrip()})
                        + "\n")
        print(f"wrote {n} prompt/response pairs to {args.sft_output}")
    if args.tasks_output:
        # Its own stream too: use another --seed than the training corpus' for held-out items.
        task_rng = random.Random(args.seed + 2)
        with open(args.tasks_output, "w") as f:
            for _ in range(args.num_tasks):
                f.write(json.dumps(task_item(task_rng, args.max_steps, tasks)) + "\n")
        print(f"wrote {args.num_tasks} held-out problems to {args.tasks_output}")


if __name__ == "__main__":
    main()
