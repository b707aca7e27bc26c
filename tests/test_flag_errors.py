"""A command line with several independent mistakes gets all of them in one run, one `error:`
line each (megaloop.arguments.FlagCheck), and the trainer's size flags are refused before torch
and megatron-core load."""

import contextlib
import io
import os
import subprocess
import sys

import pytest

from megaloop.arguments import FlagCheck, FlagErrors, check_ranges
from run_helpers import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_flag_check_keeps_every_refusal_and_skips_what_depends_on_them():
    flags = FlagCheck()
    with flags.check():
        raise ValueError("--a 0: must be >= 1")
    with flags.check():
        pass
    with flags.check():
        raise FlagErrors(["--b x", "--c y"])
    assert not flags.ok
    with pytest.raises(FlagErrors) as exc:
        flags.raise_any()
    assert exc.value.messages == ["--a 0: must be >= 1", "--b x", "--c y"]
    # every command prints `error: {exc}`: one error line per message
    assert f"error: {exc.value}".splitlines() == ["error: --a 0: must be >= 1", "error: --b x",
                                                  "error: --c y"]
    one = FlagCheck()
    with one.check():
        raise ValueError("--d")
    with pytest.raises(ValueError) as single:
        one.raise_any()
    assert type(single.value) is ValueError and str(single.value) == "--d"
    FlagCheck().raise_any()  # nothing refused: nothing raised


def test_ranges_report_every_flag_out_of_range():
    from megaloop.training.run_config import SIZE_LIMITS, TrainingConfig

    cfg = TrainingConfig(seq_length=0, micro_batch_size=0, global_batch_size=4)
    with pytest.raises(FlagErrors) as exc:
        check_ranges(cfg, SIZE_LIMITS["training"])
    assert exc.value.messages == ["--seq-length 0 must be >= 1",
                                  "--micro-batch-size 0 must be >= 1"]


# The trainer's entry in a fresh interpreter: its exit code and refusals, and whether torch or
# megatron-core were imported by the time it refused.
_PROBE = """
import sys
from megaloop.training import run
code = run({argv!r})
heavy = sorted({{n.split(".")[0] for n in sys.modules}} & {{"torch", "megatron"}})
print("HEAVY:" + ",".join(heavy))
sys.exit(code)
"""


def test_the_trainer_refuses_all_bad_sizes_before_importing_torch():
    argv = ["--num-layers", "0", "--micro-batch-size", "0", "--log-interval", "0",
            "--mock-data"]
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(argv=argv)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == ["error: --num-layers 0 must be >= 1",
                                        "error: --micro-batch-size 0 must be >= 1",
                                        "error: --log-interval 0 must be >= 1"]
    assert proc.stdout.rsplit("HEAVY:", 1)[1].strip() == ""


def test_the_trainer_reports_independent_concerns_together_before_importing_torch():
    """A model mistake, a loop mistake and a parallel one: three lines, still before torch."""
    argv = ["--num-layers", "2", "--hidden-size", "30", "--num-attention-heads", "4",
            "--num-loops", "2", "--num-prelude-layers", "3", "--tensor-model-parallel-size", "3",
            "--mock-data"]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "SLURM_NTASKS")}
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(argv=argv)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines), lines
    assert "--hidden-size 30 is not divisible by --num-attention-heads 4" in lines[0]
    assert "--num-prelude-layers 3" in lines[1]
    assert "world size 1 is not divisible by --tensor-model-parallel-size 3" in lines[2]
    assert proc.stdout.rsplit("HEAVY:", 1)[1].strip() == ""


def test_validate_still_refuses_what_the_early_check_skipped():
    """--use-checkpoint-args defers the early check (the checkpoint may replace the value):
    validate() refuses the same flags, all together, when it runs."""
    from megaloop.training.run_config import parse_args

    cfg = parse_args(["--num-layers", "2", "--hidden-size", "30", "--num-attention-heads", "4",
                      "--num-loops", "2", "--num-prelude-layers", "3", "--mock-data"])
    with pytest.raises(FlagErrors) as exc:
        cfg.validate(world_size=1)
    assert len(exc.value.messages) == 2


def _main(tool, argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = load_tool(tool).main(argv)
    return code, err.getvalue().splitlines()


def test_generate_reports_its_independent_mistakes_together(tmp_path):
    code, lines = _main("generate", ["--load", str(tmp_path / "missing"), "--prompt", "a",
                                     "--max-tokens", "0", "--temperature", "-1", "--seed",
                                     str(2 ** 64)])
    assert code == 2
    assert [line.split(":")[1].split()[0] for line in lines] == [
        "--max-tokens", "--temperature", "--seed", "--load"], lines


def test_serve_reports_its_independent_mistakes_together(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, lines = _main("serve", ["--load", str(tmp_path / "missing"), "--port", "0",
                                  "--api-key", " ", "--tensor-model-parallel-size", "2"])
    assert code == 2
    assert [line.split(":")[1].split()[0] for line in lines] == [
        "--port", "--api-key", "--tensor-model-parallel-size", "--load"], lines


def test_evaluate_reports_its_independent_mistakes_together(tmp_path):
    code, lines = _main("evaluate", ["--load", str(tmp_path / "missing"), "--output-dir",
                                     str(tmp_path / "out"), "--num-loops", "0",
                                     "--seq-length", "0", "--exit-rules", "fixed:2"])
    assert code == 2
    assert [line.split(":")[1].split()[0] for line in lines] == [
        "--load", "--num-loops", "--exit-rules", "--seq-length"], lines


def test_preprocess_reports_its_mistakes_together_without_importing_numpy(tmp_path):
    """Before any import beyond the standard library (its start-up stays a fraction of a
    second): every range, the input file and the tokenizer flags, one line each."""
    probe = ("import sys, runpy; sys.argv = {argv!r}\n"
             "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
             "except SystemExit as exc:\n    code = exc.code\n"
             "heavy = {{n.split('.')[0] for n in sys.modules}} & {{'numpy', 'torch'}}\n"
             "print('HEAVY:' + ','.join(sorted(heavy))); sys.exit(code)")
    argv = [os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", str(tmp_path / "no"),
            "--output-prefix", str(tmp_path / "out"), "--workers", "-1", "--partitions", "0",
            "--tokenizer-type", "SentencePieceTokenizer"]
    proc = subprocess.run([sys.executable, "-c", probe.format(argv=argv)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert [line.split("error: ")[1].split()[0] for line in proc.stderr.splitlines()] == [
        "--partitions", "--workers", "--input", "--tokenizer-type"], proc.stderr
    assert proc.stdout.rsplit("HEAVY:", 1)[1].strip() == ""
    assert not os.listdir(tmp_path)  # nothing written


def test_train_rl_refuses_its_flags_together_before_importing_torch():
    """RL's own refusals (pipeline stages, dropout, FP8) and the pretraining checks, at once."""
    probe = _PROBE.replace("from megaloop.training import run", "from megaloop.rl.train import run")
    argv = ["--num-layers", "0", "--pipeline-model-parallel-size", "2", "--hidden-dropout",
            "0.1", "--attention-dropout", "0", "--fp8-format", "hybrid", "--env", "arithmetic"]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "SLURM_NTASKS")}
    proc = subprocess.run([sys.executable, "-c", probe.format(argv=argv)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert [line.split("error: ")[1].split()[0] for line in lines] == [
        "--num-layers", "--pipeline-model-parallel-size", "--hidden-dropout", "--fp8-format"], lines
    assert proc.stdout.rsplit("HEAVY:", 1)[1].strip() == ""
