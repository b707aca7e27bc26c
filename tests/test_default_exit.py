"""A model's own exit rule (an Ouro folder's early_exit_threshold) is the default of generate,
serve and lm-eval (one function, loading.check_generation_flags, decides for all three):
decoding with it equals decoding with the same --exit given, differs from --exit none (the
gate is set so that tokens really exit early), is announced once, reaches a checkpoint
converted from the folder, and every later save of a run trained from it."""

import os
import subprocess
import sys

import pytest

from distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from ouro_reference import make_ouro_folder

    base = tmp_path_factory.mktemp("default_exit")
    folder, plain = str(base / "ouro"), str(base / "ouro_full")
    make_ouro_folder(folder, seed=4, early_exit_threshold=0.5)
    make_ouro_folder(plain, seed=4)  # the same weights, threshold 1.0
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"),
                          "import-hf", "--hf-dir", folder, "--save", str(base / "ckpt"),
                          "--no-progress"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return {"folder": folder, "plain": plain, "checkpoint": str(base / "ckpt")}


def _generate(load, *flags):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "generate.py"), "--load",
                          load, "--prompt-ids", "5,9,17,4", "--prompt-ids", "30,12",
                          "--max-tokens", "6", "--no-stop-at-eod", *flags],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout, out.stderr


@pytest.mark.parametrize("source", ["folder", "checkpoint"])
def test_the_models_rule_is_the_default(models, source):
    default, err = _generate(models[source])
    explicit, explicit_err = _generate(models[source], "--exit", "q:0.5")
    full, full_err = _generate(models[source], "--exit", "none")
    announce = [line for line in err.splitlines() if line.startswith("early exit")]
    assert announce == ["early exit q:0.5 from the model (config.json early_exit_threshold 0.5); "
                        "--exit none for full depth, or --exit RULE for another"], err
    assert default == explicit
    assert not any(line.startswith("early exit")
                   for line in explicit_err.splitlines() + full_err.splitlines())
    depth = [line for line in err.splitlines() if line.startswith("mean executed depth")]
    assert depth and not depth[0].startswith("mean executed depth 4.00"), err
    assert default != full  # the threshold changes decoding
    # Full depth is the folder with threshold 1.0, decoded without a rule.
    assert full == _generate(models["plain"])[0]


def test_serve_and_lm_eval_take_the_same_default(models, capsys):
    """The shared check, as serve (flag spelling) and the lm-eval adapter (model_args
    spelling) call it: the rule, announced in their own words; ``none`` overrides it."""
    from megaloop.inference.loading import check_generation_flags

    rule = check_generation_flags(models["checkpoint"], "full", None)
    assert rule.text == "q:0.5" and "--exit none for full depth" in capsys.readouterr().err
    rule = check_generation_flags(models["folder"], "full", None, spell=str)
    assert rule.text == "q:0.5" and "exit none for full depth" in capsys.readouterr().err
    assert check_generation_flags(models["folder"], "full", "none") is None
    assert check_generation_flags(models["plain"], "full", None) is None
    assert capsys.readouterr().err == ""


def _train(rank, world, argv):
    from run_helpers import train

    code, _ = train(argv)
    assert code == 0, code


def test_later_saves_keep_the_models_rule(models, tmp_path):
    """A fine-tuning run from the imported checkpoint saves the rule and where it came from
    (the run config's ``generation`` section, which no flag sets), and so does a run resumed
    from that run's save: the default of each save is the folder's, as read from the folder."""
    from megaloop.checkpoint.config import read_run_config
    from megaloop.inference.loading import default_exit_rule

    imported = models["checkpoint"]
    common = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
              os.path.join(imported, "tokenizer"), "--mock-data", "--seq-length", "16",
              "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-4",
              "--num-workers", "0", "--eval-iters", "0", "--save-interval", "1"]
    tuned, resumed = str(tmp_path / "tuned"), str(tmp_path / "resumed")
    run_distributed(_train, 1, ["--use-checkpoint-args", "--load", imported, "--finetune",
                                "--save", tuned, "--train-iters", "1", *common])
    run_distributed(_train, 1, ["--use-checkpoint-args", "--load", tuned, "--save", resumed,
                                "--train-iters", "2", "--use-checkpoint-opt_param-scheduler",
                                *common])
    want = default_exit_rule(models["folder"])
    assert want == ("q:0.5", "config.json early_exit_threshold 0.5")
    for save in (tuned, resumed):
        assert default_exit_rule(save) == want, save
    assert read_run_config(resumed)["generation"] == read_run_config(imported)["generation"]
    assert read_run_config(resumed)["training"]["train_iters"] == 2  # (a later save indeed)
