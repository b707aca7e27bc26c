"""tools/generate.py refuses what it cannot do with one line and exit code 2 (a depth below 1, a
top-p of 0, a prompt past the model's context), keeps a prompt's last tokens only when asked,
loads the checkpoint step it is asked for, and prints text as the tokenizer decodes it."""

import contextlib
import glob
import importlib.util
import io
import os
import shutil

import pytest

from distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTEXT = 32  # test_training.BASE: --max-position-embeddings 32


def _tool_io(rank, world, name, argv):
    """tools/<name>.py's main in this rank: (exit code, stdout, stderr)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = tool.main(argv)
    return code, out.getvalue(), err.getvalue()


def _generate(argv, world=1):
    return run_distributed(_tool_io, world, "generate", argv)[0]


def _train(rank, world, save):
    from megaloop.parallel.initialize import initialize
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer
    from test_training import BASE

    cfg = parse_args(BASE + ["--micro-batch-size", "2", "--save", save, "--save-interval", "1"])
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    Trainer(cfg).train()
    return True


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint directory holding iterations 1 and 2 (the latest)."""
    path = str(tmp_path_factory.mktemp("tools_reliability") / "ckpt")
    run_distributed(_train, 1, path)
    return path


@pytest.mark.parametrize("flags, named", [
    (["--num-loops", "0"], "--num-loops 0"),
    (["--num-loops", "-3"], "--num-loops -3"),
    (["--top-p", "0"], "--top-p 0.0"),
    (["--temperature", "-1"], "--temperature -1.0"),
    (["--top-k", "-2"], "--top-k -2"),
])
def test_generate_refuses_out_of_range_values(ckpt, flags, named):
    code, out, err = _generate(["--load", ckpt, "--prompt-ids", "5,6,7", "--max-tokens", "2",
                                "--temperature", "1", *flags])
    assert code == 2 and out == "", (code, out, err)
    lines = err.strip().split("\n")
    assert len(lines) == 1 and lines[0].startswith(f"error: {named}:"), err


def test_prompt_past_the_context_is_refused_or_keeps_its_tail(ckpt):
    prompt = [(7 * i) % 190 + 5 for i in range(30)]
    argv = ["--load", ckpt, "--max-tokens", "6", "--no-stop-at-eod"]
    code, out, err = _generate(argv + ["--prompt-ids", ",".join(map(str, prompt))])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "36 tokens exceed the model's context of 32" in err, err
    assert "--keep-prompt-tail to keep its last 26 tokens" in err, err
    code, kept, err = _generate(argv + ["--prompt-ids", ",".join(map(str, prompt)),
                                        "--keep-prompt-tail"])
    assert code == 0, err
    # Independent: the last CONTEXT - max_tokens ids given as the prompt themselves.
    code, tail, _ = _generate(argv + ["--prompt-ids",
                                      ",".join(map(str, prompt[-(CONTEXT - 6):]))])
    assert code == 0 and kept == tail and len(kept.split(",")) == 6
    code, _, err = _generate(argv[:2] + ["--prompt-ids", "5", "--max-tokens", "32"])
    assert code == 2 and "--max-tokens 32" in err and "at most 31" in err, err


def test_a_damaged_checkpoint_names_ckpt_step_and_generate_takes_it(ckpt, tmp_path):
    damaged = str(tmp_path / "damaged")
    shutil.copytree(ckpt, damaged)
    shard = sorted(glob.glob(os.path.join(damaged, "iter_0000002", "*.distcp")))[0]
    with open(shard, "r+b") as f:  # one byte changed: the manifest check names the file
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    argv = ["--prompt-ids", "5,6,7", "--max-tokens", "8", "--no-stop-at-eod"]
    code, out, err = _generate(["--load", damaged, *argv])
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "--ckpt-step 1" in err and shard in err, err
    code, out, err = _generate(["--load", damaged, "--ckpt-step", "1", *argv])
    assert code == 0, err
    # Independent of --ckpt-step: a copy whose tracker file names iteration 1.
    older = str(tmp_path / "older")
    shutil.copytree(ckpt, older)
    shutil.rmtree(os.path.join(older, "iter_0000002"))
    with open(os.path.join(older, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")
    assert _generate(["--load", older, *argv])[:2] == (0, out)
    code, _, err = _generate(["--load", damaged, "--ckpt-step", "7", *argv])
    assert code == 2 and "iter_0000007 does not exist" in err and "available in" in err, err


@pytest.mark.parametrize("tool, argv", [
    ("generate", []), ("serve", []), ("evaluate", []), ("attention_probes", []),
    ("convert_checkpoint", ["export-hf"])])
def test_every_tool_that_loads_takes_the_trainers_ckpt_step(tool, argv):
    """One definition (CheckpointConfig.ckpt_step): each tool's --help shows the trainer's own
    help text for it."""
    from megaloop.arguments import field_docs
    from megaloop.training.config import CheckpointConfig

    spec = importlib.util.spec_from_file_location(tool, os.path.join(ROOT, "tools", f"{tool}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        module.main(argv + ["--help"])
    text = " ".join(out.getvalue().split())
    assert "--ckpt-step CKPT_STEP " + field_docs(CheckpointConfig)["ckpt_step"] in text, text
