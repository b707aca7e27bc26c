"""A model's own exit rule (an Ouro folder's early_exit_threshold) is the default of generate,
serve and lm-eval (one function, loading.check_generation_flags, decides for all three):
decoding with it equals decoding with the same --exit given, differs from --exit none (the
gate is set so that tokens really exit early), is announced once, and reaches a checkpoint
converted from the folder."""

import os
import subprocess
import sys

import pytest

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
