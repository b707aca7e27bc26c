"""benchmarks/speculation_bound.py: its --tiny rehearsal runs every measurement, and the bound it
prints is the formula applied to the inputs it prints (recomputed here from the printed figures:
E(j) = (1 - a^(j+1)) / (1 - a), speed-up(j) = E(j) c_plain / (j c_draft + c_verify(j)), the
bound their maximum with 1 for plain decoding); its refusals name the flag."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "speculation_bound.py")
NUMBER = r"([0-9.e+-]+)"


def test_tiny_rehearsal_prints_the_bound_of_its_inputs():
    proc = subprocess.run([sys.executable, SCRIPT, "--tiny", "--speculate", "2:3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    a = float(re.search(rf"inputs: a {NUMBER} \((\d+) of (\d+) drafted", text).group(1))
    kept, positions = map(int, re.search(r"\((\d+) of (\d+) drafted", text).groups())
    assert a == pytest.approx(kept / positions, rel=1e-5) and positions > 0
    c_plain = float(re.search(rf"c_plain {NUMBER} s", text).group(1))
    c_draft = float(re.search(rf"c_draft {NUMBER} s", text).group(1))
    rows = {int(m.group(1)): m.groups()[1:] for m in re.finditer(
        rf"^\s*(\d+) +{NUMBER} +(\S+) +{NUMBER} +{NUMBER}", text, re.M)}
    assert sorted(rows) == [0, 1, 2, 3], text
    assert rows[0][0] == "1.000000" and rows[0][2] == "1.000000", text  # plain decoding
    speedups = {0: 1.0}
    for j in (1, 2, 3):
        e, c_verify, printed = float(rows[j][0]), float(rows[j][1]), float(rows[j][2])
        expected = (1 - a ** (j + 1)) / (1 - a) if a < 1 else j + 1.0
        assert e == pytest.approx(expected, rel=1e-4), (j, text)
        speedups[j] = expected * c_plain / (j * c_draft + c_verify)
        assert printed == pytest.approx(speedups[j], rel=1e-4), (j, text)
        assert c_verify > 0
    best = max(speedups, key=speedups.get)
    line = re.search(rf"best: j = (\d+), speed-up bound {NUMBER}x", text)
    assert int(line.group(1)) == best, text
    assert float(line.group(2)) == pytest.approx(speedups[best], rel=1e-4), text
    assert c_plain > 0 and c_draft > 0


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_speculation_bound", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, line", [
    (["--tiny", "--speculate", "2"], "error: --speculate '2': give d:k"),
    (["--tiny", "--speculate", "2:4", "--max-tokens", "5"],
     "error: --max-tokens 5: a round of 4 drafts needs at least 6 new tokens"),
    (["--tiny", "--batch", "0"], "error: --batch 0: must be >= 1"),
    (["--load", "/nonexistent/ckpt"], "error: --load /nonexistent/ckpt: no checkpoint there"),
])
def test_bad_arguments_exit_2_naming_the_flag(bench, capsys, argv, line):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(line) and "\n" not in err, err
