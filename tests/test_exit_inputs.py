"""The exit rule's inputs are refused in one line where they cannot mean what they say: an Ouro
config.json's early_exit_threshold outside [0, 1] (a negative one read as "every token after step
1"), at import-hf and at generate --load of the folder; ``--exit fixed:N`` past the steps the
model runs (it read as full depth), in generate and serve, naming the model's step count."""

import os
import subprocess
import sys

import pytest

from distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("threshold", [-1.0, -1e-9, 1.5])
def test_a_threshold_outside_0_1_is_refused_by_name(threshold, tmp_path):
    from ouro_reference import make_ouro_folder

    from megaloop.inference.loading import check_generation_flags

    folder = str(tmp_path / "ouro")
    make_ouro_folder(folder, seed=2, early_exit_threshold=threshold)
    with pytest.raises(ValueError, match=rf"^config.json early_exit_threshold {threshold:g}: "
                                         rf".* in \[0, 1\]"):
        check_generation_flags(folder, "full", None)
    assert check_generation_flags(folder, "full", "none") is None  # the user's rule stands
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"),
                          "import-hf", "--hf-dir", folder, "--save", str(tmp_path / "ckpt"),
                          "--no-progress"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"early_exit_threshold {threshold:g}" in out.stderr, out.stderr


def test_threshold_0_is_ouros_exit_after_the_first_step(tmp_path):
    """Ouro's rule leaves at the first step whose cumulative exit probability reaches the
    threshold; every probability reaches 0, so 0 is fixed:1, and stays accepted."""
    from ouro_reference import make_ouro_folder

    from megaloop.inference.loading import check_generation_flags

    folder = str(tmp_path / "ouro")
    make_ouro_folder(folder, seed=2, early_exit_threshold=0.0)
    assert check_generation_flags(folder, "full", None).text == "fixed:1"


def test_supports_refuses_a_fixed_exit_past_the_depth():
    from megaloop.model.config import LoopConfig
    from megaloop.model.exit_rules import parse_exit

    loop = LoopConfig(num_loops=4)
    reason = loop.supports(exit=parse_exit("fixed:99"), kv_policy="full")
    assert reason.startswith("--exit fixed:99: this model runs 4 loop steps (--num-loops 4)")
    assert "fixed:1 to fixed:4" in reason
    assert loop.supports(depth=2, exit=parse_exit("fixed:3")).startswith(
        "--exit fixed:3: this model runs 2 loop steps")
    assert loop.supports(depth=6, exit=parse_exit("fixed:5")) is None  # (more loops than T)
    for n in (1, 4):
        assert loop.supports(exit=parse_exit(f"fixed:{n}"), kv_policy="full") is None
    assert loop.supports(exit=parse_exit("fixed:9"), spell=str).startswith("exit fixed:9")


def test_generate_and_serve_refuse_fixed_past_the_models_steps(tmp_path):
    """The checkpoint of tests/test_tools_reliability.py (test_training.BASE: 3 loop steps)."""
    from test_tools_reliability import _generate, _train

    ckpt = str(tmp_path / "ckpt")
    run_distributed(_train, 1, ckpt)
    code, out, err = _generate(["--load", ckpt, "--prompt-ids", "5,6", "--max-tokens", "2",
                                "--exit", "fixed:99"])
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("error: --exit fixed:99: this model runs 3 loop steps"), err
    assert _generate(["--load", ckpt, "--prompt-ids", "5,6", "--max-tokens", "2", "--exit",
                      "fixed:3"])[0] == 0
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "serve.py"), "--load", ckpt,
                          "--exit", "fixed:4", "--port", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert lines == [lines[0]] and lines[0].startswith(
        "error: --exit fixed:4: this model runs 3 loop steps"), out.stderr
