"""A --load that finds no megaloop checkpoint stops the run before any process group, in one line
with exit code 2, in every training entry point (pretrain_looplm.py, train_rl.py, with or without
--finetune or --use-checkpoint-args): before, a Hugging Face folder or a mistyped path trained a
randomly initialised model under the name of a resume. The one folder without a checkpoint that
is accepted is Megatron-LM's resubmittable job's: --load equal to --save, nothing saved yet.
"""

import os
import sys

import pytest
import torch

from test_rl_train import ENV, MODEL
from test_training import BASE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def folders(tmp_path):
    """A Hugging Face folder (config.json + a safetensors shard), an empty folder, a missing one,
    and train_rl.py's flags for a tiny environment."""
    hf = tmp_path / "Qwen3-0.6B"
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    (hf / "model.safetensors").write_bytes(b"\0" * 64)
    (tmp_path / "empty").mkdir()
    (tmp_path / "even_sum.py").write_text(ENV)
    rl = MODEL + ["--env", f"{tmp_path / 'even_sum.py'}:EvenSum", "--env-args", "size=12",
                  "--prompts-per-step", "4", "--group-size", "2", "--micro-batch-size", "2"]
    return {"hf": str(hf), "empty": str(tmp_path / "empty"),
            "missing": str(tmp_path / "nope"), "rl": rl}


def _entry(script):
    sys.path.insert(0, ROOT)
    if script == "pretrain":
        import pretrain_looplm

        return pretrain_looplm.main
    import train_rl

    return train_rl.main


def _run(script, argv, capsys):
    """The entry point's main in this process (it must answer before starting a process group,
    so nothing here is distributed); returns (exit code, stderr lines)."""
    env = dict(os.environ)
    try:
        code = _entry(script)(argv)
    finally:  # the world-of-one variables validation sets for a launch without torchrun
        os.environ.clear()
        os.environ.update(env)
    assert not torch.distributed.is_initialized()
    return code, capsys.readouterr().err.strip().splitlines()


def _flags(script, folders):
    return BASE if script == "pretrain" else folders["rl"]


@pytest.mark.parametrize("script", ["pretrain", "rl"])
@pytest.mark.parametrize("extra", [[], ["--finetune"], ["--use-checkpoint-args"]],
                         ids=["resume", "finetune", "checkpoint-args"])
def test_a_hugging_face_folder_names_the_conversion(script, extra, folders, capsys, tmp_path):
    code, err = _run(script, _flags(script, folders) + ["--load", folders["hf"],
                                                        "--save", str(tmp_path / "out")] + extra,
                     capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: ") and "Hugging Face model folder" in err[0], err
    assert f"python tools/convert_checkpoint.py import-hf --hf-dir {folders['hf']} --save" \
        in err[0], err


@pytest.mark.parametrize("script", ["pretrain", "rl"])
@pytest.mark.parametrize("which", ["empty", "missing"])
def test_a_folder_without_a_checkpoint_is_refused_unless_it_is_save(script, which, folders,
                                                                     capsys, tmp_path):
    flags = _flags(script, folders) + ["--load", folders[which]]
    code, err = _run(script, flags + ["--save", str(tmp_path / "out")], capsys)
    assert code == 2 and len(err) == 1, err
    assert f"--load {folders[which]}: no checkpoint there" in err[0] and \
        "--save and --load" in err[0], err
    code, err = _run(script, flags + ["--finetune"], capsys)
    assert code == 2 and len(err) == 1 and "no checkpoint there" in err[0], err
    # A resubmittable job's first launch (--load == --save, nothing saved yet) is a fresh run.
    if script == "pretrain":
        from megaloop.training.run import configure
    else:
        from megaloop.rl.train import configure
    env = dict(os.environ)
    try:
        cfg = configure(flags + ["--save", folders[which] + os.sep])
    finally:
        os.environ.clear()
        os.environ.update(env)
    assert cfg.checkpoint.load == folders[which] and not cfg.checkpoint.finetune


def test_checkpoint_folders_without_a_tracker_name_ckpt_step(tmp_path):
    from megaloop.training.run_config import parse_args

    os.makedirs(tmp_path / "iter_0000004")
    os.makedirs(tmp_path / "iter_0000007.tmp")  # a save that never finished: not a checkpoint
    with pytest.raises(ValueError, match="iterations 4: pick one with --ckpt-step 4"):
        parse_args(BASE + ["--load", str(tmp_path), "--save", str(tmp_path)]).validate(
            world_size=1)
