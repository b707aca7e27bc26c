"""benchmarks/serve.py's arithmetic on hand numbers and its refusals (no server is started).

The figures the benchmark prints come from these functions: a cell's tokens/s, time to first
token and inter-token gaps from the arrival times of its streamed chunks; a figure's mean and
range over repeats; a ratio's range (lowest over highest, highest over lowest); and a goal's
verdict, met only when the whole range clears it."""

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "bench_serve", os.path.join(ROOT, "benchmarks", "serve.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_cell_from_arrival_times(bench):
    # Request A sent at 0 s, tokens at 0.1, 0.3, 0.6 (3 tokens in its usage chunk); request B
    # sent at 0.05 s, tokens at 0.2, 0.25, closed before its usage chunk (its 2 chunks count).
    cell = bench.Cell.of(1.0, [(0.0, [0.1, 0.3, 0.6], 3), (0.05, [0.2, 0.25], None)])
    assert cell.tokens == [3, 2]
    assert cell.ttft_s == pytest.approx([0.1, 0.15])
    assert cell.itl_s == pytest.approx([0.25, 0.05])  # (0.6 - 0.1) / 2, (0.25 - 0.2) / 1
    assert cell.chunks == 5
    assert cell.tokens_per_s == pytest.approx(5.0)  # 5 tokens in 1 s
    # 4 tokens in 2 chunks (a server sending two tokens' text at once): 0.3 s over 3 gaps
    assert bench.Cell.of(1.0, [(0.0, [0.1, 0.4], 4)]).itl_s == pytest.approx([0.1])


def test_percentile_interpolates(bench):
    assert bench.percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)  # between 2 and 3
    assert bench.percentile(list(range(1, 102)), 99) == pytest.approx(100.0)  # rank 99 of 0..100
    assert bench.percentile([7.0], 99) == 7.0


def test_spread_ratio_and_verdict(bench):
    s = bench.Spread.of([1.0, 2.0, 6.0])
    assert (s.mean, s.lo, s.hi) == (3.0, 1.0, 6.0)
    assert s.fmt() == "3.0 (1.0-6.0)"
    r = bench.ratio([10.0, 12.0, 9.0], [2.0, 4.0, 3.0])  # within each repeat: 5, 3, 3
    assert (r.mean, r.lo, r.hi) == (pytest.approx(11 / 3), 3.0, 5.0)
    with pytest.raises(ValueError, match="pairs repeats"):
        bench.ratio([1.0], [1.0, 2.0])
    assert bench.verdict(bench.Spread(7.0, 6.0, 8.0), 6.0) == "met"  # the range starts at 6
    assert bench.verdict(bench.Spread(5.0, 4.0, 5.9), 6.0) == "not met"
    assert bench.verdict(bench.Spread(6.5, 5.5, 7.5), 6.0).startswith("not decided")
    with pytest.raises(ValueError, match="at least one"):
        bench.Spread.of([])


def test_verdicts_on_hand_numbers(bench):
    tps = {(None, 1): [10.0, 20.0], (None, 16): [70.0, 100.0], ("kl:0.3", 16): [105.0, 150.0]}
    hf = {16: [20.0, 40.0]}
    lines = bench.verdicts(tps, hf, "kl:0.3", -0.005, "freed at once")
    # 70/10 = 7, 100/20 = 5: the range 5-7 holds the goal 6
    assert lines[0] == ("concurrency 16 vs 1 (full depth): 6.00 (5.00-7.00)x, goal >= 6x: not "
                        "decided (the goal lies within the spread)")
    assert lines[1].endswith("1.50 (1.50-1.50)x at -0.50% held-out loss, goal >= 1.4x at <= 1%: "
                             "met")
    assert lines[2].endswith("3.00 (2.50-3.50)x, goal >= 3x: not decided (the goal lies within "
                             "the spread)")  # 70/20, 100/40
    assert lines[3].endswith("freed at once")
    over = bench.verdicts(tps, hf, "kl:0.3", 0.02, None)
    assert over[1].endswith("not met (held-out loss +2.00% > +1%)") and len(over) == 3


def test_speculation_and_single_stream_verdicts_on_hand_numbers(bench):
    tps = {(None, 1): [10.0, 20.0], ("speculate 2:4", 1): [16.0, 34.0]}
    hf = {1: [10.0, 10.0]}
    lines = bench.verdicts(tps, hf, "kl:0.3", 0.0, None, "2:4", (8, 8), 0.625)
    # 10/10 and 20/10; 16/10 and 34/20
    assert lines[0].endswith("1.50 (1.00-2.00)x, goal >= 1x: met")
    assert lines[1] == ("self-speculation (2:4) vs full depth at concurrency 1: 1.65 "
                        "(1.60-1.70)x, greedy text identical in 8 of 8 answers, acceptance "
                        "0.62, goal >= 1.5x with identical text: met")
    differs = bench.verdicts(tps, hf, "kl:0.3", 0.0, None, "2:4", (7, 8), None)
    assert differs[1].endswith("not met (the text differs from full depth's)")


def test_summary_and_table(bench):
    cells = [bench.Cell.of(2.0, [(0.0, [0.1, 0.2], 4)]), bench.Cell.of(1.0, [(0.0, [0.3, 0.5], 4)])]
    s = bench.summarize(cells)
    assert (s["tok/s"].lo, s["tok/s"].hi) == (2.0, 4.0)  # 4 tokens in 2 s and in 1 s
    assert (s["ttft50"].lo, s["ttft50"].hi) == pytest.approx((100.0, 300.0))  # ms
    assert (s["itl50"].lo, s["itl50"].hi) == pytest.approx((100 / 3, 200 / 3))  # 3 gaps
    text = bench.table([("this tree", "off", 16, 16, s)])
    assert text.splitlines()[2] == ("| this tree | off | 16 | 16 | 4.0 | 3.0 (2.0-4.0) | "
                                    "200 (100-300) | 200 (100-300) | 50.0 (33.3-66.7) | "
                                    "50.0 (33.3-66.7) |")


def test_disconnect_log_line(bench):
    # The request log note of a stream whose client left (megaloop/inference/server.py).
    line = ("INFO megaloop.serve: POST /v1/completions 200 0.412s stream cancelled: the client "
            "left; prompts=1 n=1 prompt_tokens=32 completion_tokens=5")
    assert bench._CANCELLED.findall(line) == ["5"]


@pytest.mark.parametrize("argv, words", [
    (["--concurrency", "1,x"], "--concurrency '1,x': comma-separated integers"),
    (["--concurrency", "4,0"], "--concurrency '4,0': every value must be at least 1"),
    (["--concurrency", ""], "--concurrency '': name at least one"),
    (["--repeats", "0"], "--repeats 0: must be at least 1"),
    (["--max-tokens", "3", "--disconnect-after", "3"], "--disconnect-after 3: must be below"),
    (["--load", "/nonexistent/ckpt"], "--load /nonexistent/ckpt: no checkpoint there"),
    (["--load", ROOT, "--before-tree", "/nonexistent"], "--before-tree /nonexistent: no tools/"),
    (["--load", ROOT, "--exit", "q:2"], "q:2"),
])
def test_bad_arguments_exit_2(bench, capsys, argv, words):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and words in err and "\n" not in err, err
