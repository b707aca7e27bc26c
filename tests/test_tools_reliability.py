"""tools/generate.py refuses what it cannot do with one line and exit code 2 (a depth below 1, a
top-p of 0, a seed outside 64 bits, a prompt past the model's context), samples with any 64-bit
seed, keeps a prompt's last tokens only when asked, loads the checkpoint step it is asked for,
and prints text as the tokenizer decodes it."""

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
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(ROOT, "megaloop", "cli", f"{name}.py"))
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
    (["--seed", str(2 ** 64)], f"--seed {2 ** 64}"),
    (["--seed", str(-2 ** 63 - 1)], f"--seed {-2 ** 63 - 1}"),
])
def test_generate_refuses_out_of_range_values(ckpt, flags, named):
    code, out, err = _generate(["--load", ckpt, "--prompt-ids", "5,6,7", "--max-tokens", "2",
                                "--temperature", "1", *flags])
    assert code == 2 and out == "", (code, out, err)
    lines = err.strip().split("\n")
    assert len(lines) == 1 and lines[0].startswith(f"error: {named}:"), err


def test_a_seed_is_any_64_bit_integer_signed_or_unsigned(ckpt):
    """--seed takes the server's range of a request's seed (flags.SEED_RANGE), not numpy's
    0 .. 2**32 - 1: a negative seed s is the 64-bit pattern 2**64 + s, so -1 samples what
    2**64 - 1 samples, and a seed past 2**32 samples too (and differs from another)."""
    argv = ["--load", ckpt, "--prompt-ids", "5,6,7", "--max-tokens", "8", "--no-stop-at-eod",
            "--temperature", "1"]
    results = {}
    for seed in (-1, 2 ** 64 - 1, 2 ** 32, 2 ** 32 + 1):
        code, out, err = _generate(argv + ["--seed", str(seed)])
        assert code == 0, err
        results[seed] = out
    assert results[-1] == results[2 ** 64 - 1]
    assert len({results[-1], results[2 ** 32], results[2 ** 32 + 1]}) == 3, results


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

    spec = importlib.util.spec_from_file_location(
        tool, os.path.join(ROOT, "megaloop", "cli", f"{tool}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        module.main(argv + ["--help"])
    text = " ".join(out.getvalue().split())
    assert "--ckpt-step CKPT_STEP " + field_docs(CheckpointConfig)["ckpt_step"] in text, text


# --- what the tools print ---------------------------------------------------------------------
def _warnings_of_tool(rank, world, name, argv):
    """(exit code, the messages of the warnings the tool let through the filters it sets)."""
    import warnings

    from megaloop import runtime

    with warnings.catch_warnings(record=True) as caught:
        # pytest's own "always" filters come first in the test process: the tool's filters go
        # in front of them again, as in a run of the tool (quiet_megatron runs once otherwise).
        runtime._quieted = False
        runtime.quiet_megatron()
        code = _tool_io(rank, world, name, argv)[0]
    return code, [f"{w.category.__name__}: {w.message}" for w in caught]


def test_generate_at_tp2_prints_no_warning(ckpt):
    for code, caught in run_distributed(_warnings_of_tool, 2, "generate",
                                        ["--load", ckpt, "--prompt-ids", "5,6,7",
                                         "--max-tokens", "3"]):
        assert code == 0 and caught == [], caught


def test_evaluate_help_states_each_default_once():
    import re

    spec = importlib.util.spec_from_file_location(
        "evaluate", os.path.join(ROOT, "megaloop", "cli", "evaluate.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for action in tool.build_parser()._actions:
        said = re.findall(r"\(default\b|\bdefault:", action.help or "")
        assert len(said) <= 1, (action.option_strings, action.help)


@pytest.fixture(scope="module")
def sp_ckpt(tmp_path_factory):
    """(checkpoint, sentencepiece model) of a tiny model whose tokenizer has punctuation pieces."""
    import random

    from megaloop.data.tokenizers import train_sentencepiece

    tmp = tmp_path_factory.mktemp("sp_generate")
    spec = importlib.util.spec_from_file_location(
        "make_demo_corpus", os.path.join(ROOT, "megaloop", "cli", "make_demo_corpus.py"))
    corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus)
    rng = random.Random(0)
    model = train_sentencepiece([corpus.document(rng, 6) for _ in range(300)], str(tmp / "sp"),
                                vocab_size=400)
    from test_training import BASE

    flags = BASE[:BASE.index("--tokenizer-type")] + BASE[BASE.index("--vocab-size") + 2:]
    path = str(tmp / "ckpt")
    run_distributed(_train_sp, 1, flags + ["--tokenizer-type", "SentencePieceTokenizer",
                                           "--tokenizer-model", model, "--save", path])
    return path, model


def _train_sp(rank, world, argv):
    from megaloop.parallel.initialize import initialize
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer

    cfg = parse_args(argv + ["--micro-batch-size", "2"])
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    Trainer(cfg).train()
    return True


def test_generated_text_is_sentencepieces_own_decoding(sp_ckpt):
    """--prompt prints the prompt and the continuation decoded as sentencepiece decodes their
    ids (no space added before a piece that carries none, e.g. punctuation)."""
    import sentencepiece

    ckpt, model = sp_ckpt
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    prompts = ["the quiet robot", "x=7. y=x. what is y", "the bridge near the har"]
    argv = ["--load", ckpt, "--max-tokens", "6", "--no-stop-at-eod"]
    code, text, err = _generate(argv + [a for p in prompts for a in ("--prompt", p)])
    assert code == 0, err
    ids = [sp.encode(p) for p in prompts]
    code, out, err = _generate(argv + [a for p in ids for a in ("--prompt-ids",
                                                                 ",".join(map(str, p)))])
    assert code == 0, err
    generated = [[int(t) for t in line.split(",")] for line in out.split("\n")[:-1]]
    # split("\n"), not strip() / splitlines(): byte-fallback pieces such as \x1c are
    # whitespace and line breaks to Python.
    assert text.split("\n")[:-1] == [sp.decode(p + g) for p, g in zip(ids, generated)], \
        [sp.id_to_piece(g) for g in generated]


def test_readme_setup_names_every_extra():
    import ast

    with open(os.path.join(ROOT, "setup.py")) as f:
        call = next(n for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.Call)
                    and getattr(n.func, "id", "") == "setup")
    extras = next(k.value for k in call.keywords if k.arg == "extras_require")
    names = [key.value for key in extras.keys]
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    setup = readme.split("\n## Setup\n", 1)[1].split("\n## ", 1)[0]
    assert "serve" in names and [n for n in names if f"`{n}`" not in setup] == [], names
