"""The six studies of examples/studies at --size tiny, end to end: each script trains its arms,
evaluates them and writes its Markdown table (every column, a row per arm, the verdict rule) and
its PNG. Whether a finding holds is for the README's cpu-size results, not for this test. The
spread statistics and the verdict rule the tables use are checked on numbers worked out by hand."""

import importlib.util
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "studies"))
STUDIES = {
    "loop_vs_dense": (["final validation loss", "| arm | final validation loss | accuracy | k=1 |",
                       "## Differences in accuracy", "| comparison | accuracy | k=1 |",
                       "| depth | regime | held-out loss | accuracy | k=1 |",
                       "Every arm pre-norm", "k uniform over 1..3 in training", "Machine: "],
                      ["looped 1 x 2", "dense 1 (same parameters)", "dense 2 (same compute)",
                       "dense 2 (same compute) - dense 1 (same parameters)"]),
    "gate_collapse": (["final p0", "max p0", "longest run above threshold", "alarm fired",
                       "per-step validation loss",
                       "final p0 vs warmup + cosine at the same peak LR", "pre-norm"],
                      ["constant LR, no warmup, beta 0.05", "constant LR x3, no warmup, beta 0.05",
                       "constant LR x3, no warmup, beta 0.5", "warmup + cosine, LR x3, beta 0.05",
                       "constant LR, no warmup, beta 0.5",
                       "warmup + cosine, beta 0.05"]),
    "norm_placement": (["final validation objective", "drop, second half", "plateau",
                        "objective vs pre", "at loop step 1", "layer 1 / layer 2 at step 2",
                        "Machine: "],
                       ["| ouro |", "| pre |", "| magic |", "| post |", "| sandwich |"]),
    "dense_to_loop": (["per-step loss after conversion",
                       "per-step loss after continued training", "final loss",
                       "final loss vs dense, continued", "left the plateau",
                       "left the initial plateau", "Machine: "],
                      ["looped as it is", "input mixing + smoothed exit loss",
                       "input mixing + smoothed + stepwise LoRA", "dense, continued"]),
    "multi_resolution": (["FLOPs / iteration", "vs full", "training FLOPs",
                          "final validation loss", "loss vs full resolution", "pre-norm",
                          "left the plateau", "unigram entropy", "Machine: "],
                         ["full resolution (plain loop)", "Anchor", "MeSH"]),
    "extrapolation": (["| arm | depth | regime | loss | accuracy | accuracy vs depth 3 |",
                       "training horizon", "extrapolation", "rule-30 automaton"],
                      ["BaseLoop 3 x 3", "CoreLoop 1 + 1 x 3 + 1",
                       "CoreLoop + history injection + loop gating"]),
}


def test_spread_and_verdict_rule_on_hand_computed_numbers():
    from study import compare, mean_sd, spread, verdict_cell

    # [1.0, 1.2, 1.1]: mean 1.1, deviations -0.1, 0.1, 0, sample variance 0.02 / 2 = 0.01
    mean, sd = mean_sd([1.0, 1.2, 1.1])
    assert math.isclose(mean, 1.1) and math.isclose(sd, 0.1)
    assert spread([1.0, 1.2, 1.1]) == "1.100 ± 0.100 (1.000 / 1.200 / 1.100)"
    # against [1.5, 1.7, 1.6] (sd 0.1): pooled sd 0.1, |diff| 0.5 > 0.2
    diff, word = compare([1.0, 1.2, 1.1], [1.5, 1.7, 1.6])
    assert math.isclose(diff, -0.5) and word == "beyond spread"
    # against [1.2, 1.4, 1.0] (mean 1.2, sd 0.2): pooled sqrt((0.01 + 0.04) / 2) = 0.158,
    # |diff| 0.1 < 0.316: no difference shown, and no equality either
    assert compare([1.0, 1.2, 1.1], [1.2, 1.4, 1.0])[1] == "not distinguishable at 3 seeds"
    # the boundary: sd 0.1 each, |diff| 0.19 within, 0.21 beyond (2 x pooled = 0.2)
    assert compare([0.9, 1.0, 1.1], [1.09, 1.19, 1.29])[1] == "not distinguishable at 3 seeds"
    assert compare([0.9, 1.0, 1.1], [1.11, 1.21, 1.31])[1] == "beyond spread"
    assert compare([0.9, 1.0, 1.1], [1.0, 1.1])[1] == "not distinguishable at 3 and 2 seeds"
    # one seed: no sd, no verdict
    assert math.isnan(mean_sd([2.0])[1]) and spread([2.0]) == "2.000"
    assert verdict_cell([2.0], [1.0]) == "+1.000, one seed: no verdict"


def test_equivalence_needs_a_margin_and_a_narrow_interval():
    """Two one-sided tests at 5% as a 90% Welch interval inside (-m, m), on numbers worked out
    by hand: a = [0.50, 0.51, 0.49] (mean 0.5, sd 0.01), b = [0.50, 0.52, 0.50] (mean 0.50667,
    sd 0.011547). Variances of the means 3.333e-5 and 4.444e-5, se = 0.0088192; Welch df =
    (7.778e-5)^2 / ((3.333e-5)^2 / 2 + (4.444e-5)^2 / 2) = 3.92, so t(0.95, 3) = 2.353 and the
    interval is -0.006667 ± 0.020752 = (-0.027419, 0.014085)."""
    from verdicts import difference_interval, t95

    from study import compare, verdict_cell

    a, b = [0.50, 0.51, 0.49], [0.50, 0.52, 0.50]
    low, high = difference_interval(a, b)
    assert math.isclose(low, -0.027419, abs_tol=2e-6) and math.isclose(high, 0.014085,
                                                                      abs_tol=2e-6)
    assert t95(3.92) == 2.353 and t95(0.5) == 6.314 and t95(100) == 1.697
    assert compare(a, b, margin=0.05)[1] == "equivalent within ±0.05"
    assert compare(a, b, margin=0.02)[1] == "not distinguishable at 3 seeds"  # 0.0274 > 0.02
    assert compare(a, b)[1] == "not distinguishable at 3 seeds"  # no margin: no equivalence
    assert verdict_cell(a, b, margin=0.05) == "-0.007, equivalent within ±0.05"
    # A wide spread never reads as the same: loop vs dense 8 at k = 4 (seeds 1234 / 1235 / 1236
    # of the published table); the difference -0.21 is within spread and far from equivalent.
    loop, dense = [0.99, 0.14, 0.24], [0.33, 1.00, 0.67]
    assert compare(loop, dense, margin=0.1)[1] == "not distinguishable at 3 seeds"
    low, high = difference_interval(loop, dense)
    assert low < -0.5 and high > 0.1


def test_split_seeds_are_flagged():
    from study import spread

    # sorted 0.14 / 0.24 / 0.99 leave a gap of 0.75 > 0.5: one seed learned, two did not
    assert spread([0.99, 0.14, 0.24]).endswith("(0.990 / 0.140 / 0.240, split)")
    # 0.33 / 0.67 / 1.00: gaps of 0.34 and 0.33, no split
    assert "split" not in spread([0.33, 1.00, 0.67])
    # not accuracy-like (a loss of 1.5 and 0.2): never flagged
    assert "split" not in spread([1.5, 0.2, 0.25])


def test_t_table_equals_scipy():
    stats = pytest.importorskip("scipy.stats")
    from verdicts import T95

    for df, value in enumerate(T95, start=1):
        assert math.isclose(value, stats.t.ppf(0.95, df), abs_tol=6e-4), df


def test_unigram_entropy_of_a_hand_made_corpus(tmp_path):
    """The plateau level the loss studies compare against: the entropy of the token
    frequencies over every document of the .bin/.idx."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from study import unigram_entropy

    prefix = str(tmp_path / "toy")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in ([5, 5, 7], [5, 9, 5, 7, 5, 5]):  # 9 tokens: 5 six times, 7 twice, 9 once
        builder.add_item(torch.tensor(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    expected = -(6 / 9 * math.log(6 / 9) + 2 / 9 * math.log(2 / 9) + 1 / 9 * math.log(1 / 9))
    assert math.isclose(unigram_entropy(prefix), expected, rel_tol=1e-12)


def test_whole_problems_windows_start_at_a_problem(tmp_path):
    """The reasoning studies' sequence length (study.whole_problems): with it, every training
    window megatron-core's SFT dataset cuts from equal-length problems starts at a problem's
    first token; with one token more, windows start inside problems (what the check guards);
    problems of unequal length are refused."""
    import json

    from megaloop.data.config import DataConfig, TokenizerConfig
    from megaloop.data.datasets import build_train_valid_test_datasets
    from megaloop.data.preprocess import preprocess
    from megaloop.data.tokenizers import build_tokenizer
    from study import whole_problems

    vocab = 100
    src = tmp_path / "p.jsonl"
    with open(src, "w") as f:  # 7 starts every problem of 6 prompt and 5 response tokens
        for i in range(300):
            f.write(json.dumps({"prompt": f"7 {' '.join(str(10 + (i + j) % 50) for j in range(5))}",
                                "response": " ".join(str(60 + (i * j) % 30) for j in range(5))})
                    + "\n")
    tok_cfg = TokenizerConfig(vocab_size=vocab)
    preprocess(str(src), str(tmp_path / "p"), tok_cfg, data_format="sft", workers=0,
               progress=False)
    prefix = str(tmp_path / "p_text_document")
    length = 6 + 5 + 1  # and the end-of-document token the SFT format closes a problem with
    seq = whole_problems(prefix, 40)
    assert seq % length == 0 and seq <= 40 < seq + length

    def first_tokens(seq_length):
        cfg = DataConfig(data_path=[prefix], split="100,0,0", data_format="sft")
        train, _, _ = build_train_valid_test_datasets(cfg, build_tokenizer(tok_cfg), seq_length,
                                                      1, (200, 0, 0))
        return {int(train[i]["tokens"][0]) for i in range(len(train))}

    assert first_tokens(seq) == {7}
    assert first_tokens(seq + 1) != {7}
    with open(src, "a") as f:
        f.write(json.dumps({"prompt": "7 1 2", "response": "3"}) + "\n")
    preprocess(str(src), str(tmp_path / "p"), tok_cfg, data_format="sft", workers=0,
               progress=False)
    with pytest.raises(ValueError, match="one length"):
        whole_problems(prefix, 40)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("studies")


@pytest.mark.parametrize("name", list(STUDIES))
def test_study_runs_and_writes_every_column(name, out):
    spec = importlib.util.spec_from_file_location(
        f"study_{name}", os.path.join(ROOT, "examples", "studies", f"{name}.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--size", "tiny", "--output-dir", str(out)]) == 0
    md = (out / "studies" / f"{name}.md").read_text()
    columns, arms = STUDIES[name]
    for needle in columns + arms:
        assert needle in md, f"{name}.md lacks {needle!r}:\n{md}"
    assert "Verdicts: a difference is *beyond spread* when" in md
    assert "nan" not in md.replace("nans", "")
    with open(out / "studies" / f"{name}.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
