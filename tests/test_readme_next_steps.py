"""README.md's "What to try next" commands, run as written against a tiny checkpoint.

The commands are read from the README's code block (backslash-continued lines joined, comments
dropped), so a renamed flag or tool there, or in the tool, fails here. Only paths and sizes change:
``demo/checkpoint`` and ``demo/eval`` become this module's tiny checkpoint and a temporary folder;
sizes shrink (fewer depths, tokens, lm-eval documents) while every flag the README shows stays.
Each command runs in a fresh interpreter, as a reader runs it. The two slow lines are checked
without running them (see test_every_command_is_covered).
"""

import os
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from flags import TEST_FLAGS

from distributed import free_port, run_distributed
from run_helpers import load_tool
from test_evaluate import _train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = ".venv/bin/python"
MEGALOOP = ".venv/bin/megaloop"  # the console script tools/setup_venv.sh installs


def readme_commands(section: str = "What to try next") -> list[list[str]]:
    """The argv of every command in the code block of README.md's section ``section``."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split(f"## {section}\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    joined = block.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag``'s value replaced, or the flag appended when it is absent."""
    if flag in argv:
        i = argv.index(flag)
        return argv[:i + 1] + [value] + argv[i + 2:]
    return argv + [flag, value]


def substitute(argv: list[str], paths: dict) -> list[str]:
    """The demo's paths replaced by the test's (inside values too: ``load=demo/checkpoint``)."""
    out = []
    for arg in argv:
        for demo, here in paths.items():
            arg = arg.replace(demo, here)
        out.append(arg)
    return out


def tool(argv: list[str]) -> str:
    """What a command runs: ``megaloop evaluate``, ``examples/spiral_cpu.sh``, ..."""
    if argv[0] == MEGALOOP:
        return f"megaloop {argv[1]}"
    return next(a for a in argv if a.endswith((".py", ".sh")))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A tiny looped model (with an exit gate) trained like the demo: a sentencepiece tokenizer
    and an indexed dataset of make_demo_corpus documents, with a validation split."""
    import random

    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megaloop.data.tokenizers import SentencePieceTokenizer, train_sentencepiece

    tmp = tmp_path_factory.mktemp("readme")
    corpus = load_tool("make_demo_corpus")
    rng = random.Random(0)
    texts = [corpus.document(rng, 6) for _ in range(300)]
    sp = train_sentencepiece(texts, str(tmp / "sp"), vocab_size=512)
    tok = SentencePieceTokenizer(sp)
    prefix = str(tmp / "corpus_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for text in texts:
        ids = np.array(tok.tokenize(text) + [tok.eod], dtype=np.int32)
        builder.add_document(torch.from_numpy(ids), [len(ids)])
    builder.finalize(prefix + ".idx")
    ckpt = str(tmp / "checkpoint")
    run_distributed(_train, 1, [
        *TEST_FLAGS, "--num-layers", "2", "--num-loops", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
        "--lr", "1e-2", "--data-path", prefix, "--split", "90,10,0",
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp,
        "--eval-iters", "1", "--eval-interval", "2", "--log-interval", "1", "--save", ckpt])
    return {"ckpt": ckpt, "data": prefix, "tmp": tmp}


def _env(tmp) -> dict:
    # lm-eval reads only the repository's local tasks: no network, a private HF cache.
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    if tmp is not None:
        env["HF_HOME"] = str(tmp / "hf_home")
    return env


def _run(argv, tmp, timeout=120) -> str:
    proc = subprocess.run(argv, cwd=ROOT, env=_env(tmp), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{shlex.join(argv)}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc.stdout


def _command(script: str) -> list[str]:
    (argv,) = [a for a in readme_commands() if tool(a) == script]
    # the README runs the checkout's venv, as setup_venv.sh makes it; its `megaloop` is
    # `python -m megaloop` (tests/test_cli_command.py checks that the two are the same)
    assert argv[0] in (PY, MEGALOOP), argv
    return [sys.executable] + (["-m", "megaloop"] if argv[0] == MEGALOOP else []) + argv[1:]


def _paths(demo, out="eval") -> dict:
    return {"demo/checkpoint": demo["ckpt"], "demo/eval": str(demo["tmp"] / out)}


# What each README command is shrunk to (flags the README shows keep their names; values of
# sizes are replaced, other sizes are added).
RUN = ("megaloop generate", "megaloop evaluate", "megaloop lm-eval", "benchmarks/decode.py",
       "megaloop serve", "pretrain_looplm.py")
NOT_RUN = {
    # Trains a SpiralFormer for minutes (ITERS=20 is a 4-minute look); tests/test_examples.py
    # runs it small. Here: the script exists and reads the ITERS the README sets.
    "examples/spiral_cpu.sh": "ITERS",
}


def test_every_command_is_covered():
    """A command added to the README must be added here too, not skipped unnoticed."""
    commands = readme_commands()
    assert sorted(map(tool, commands)) == sorted(RUN + tuple(NOT_RUN))
    for argv in commands:
        script = tool(argv)
        if script.startswith("megaloop "):
            from megaloop.cli.main import COMMANDS

            assert script.split()[1] in COMMANDS, script
            continue
        assert os.path.isfile(os.path.join(ROOT, script)), script
        if script in NOT_RUN:
            env = [a.split("=")[0] for a in argv[:argv.index("bash")]]
            assert env == [NOT_RUN[script]], argv
            assert f"{env[0]}=${{{env[0]}:-" in open(os.path.join(ROOT, script)).read()


def test_generate(demo):
    argv = set_flag(substitute(_command("megaloop generate"), _paths(demo)), "--max-tokens", "4")
    assert demo["ckpt"] in argv
    assert _run(argv, demo["tmp"]).strip()


def test_evaluate(demo):
    argv = substitute(_command("megaloop evaluate"), _paths(demo))
    argv = set_flag(set_flag(argv, "--num-loops", "1,2"), "--eval-iters", "1")
    _run(argv + ["--no-progress"], demo["tmp"])
    assert os.path.isfile(demo["tmp"] / "eval" / "depth_sweep.json")


def test_run_lm_eval(demo):
    argv = substitute(_command("megaloop lm-eval"), _paths(demo))
    out = _run(set_flag(argv, "--limit", "2"), demo["tmp"], timeout=240)
    assert "megaloop_demo_mc" in out and "megaloop_demo_gen" in out  # lm-eval's results table


def test_benchmark_decode(demo):
    # The README runs it on the demo's default paths: given here, with its smallest sizes.
    argv = _command("benchmarks/decode.py") + [
        "--load", demo["ckpt"], "--data-path", demo["data"], "--windows", "1",
        "--window-length", "8", "--prompts", "2", "--prompt-length", "4", "--max-tokens", "2"]
    assert "decode speed-up over full-T" in _run(argv, demo["tmp"])


def test_serve(demo):
    argv = substitute(_command("megaloop serve"), _paths(demo))
    _serve_and_ask(argv, demo["tmp"])


def _serve_and_ask(argv, tmp):
    """Start the server command on a free port, wait for /health, ask one completion, Ctrl-C."""
    import httpx

    argv = set_flag(argv, "--port", str(free_port()))
    port = argv[argv.index("--port") + 1]
    log = open(tmp / "serve.log", "w+")
    proc = subprocess.Popen(argv, cwd=ROOT, env=_env(tmp), stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, open(tmp / "serve.log").read()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, open(tmp / "serve.log").read()[-3000:]
            time.sleep(0.3)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"prompt": "the quiet robot", "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] is not None
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C, as a reader stops it
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_pretrain_help():
    out = _run(_command("pretrain_looplm.py"), None)
    assert "--num-loops" in out


def test_own_corpus_to_a_server(tmp_path):
    """README's "Your own corpus" block, in order, on a JSONL of demo documents: the tokenizer
    (a vocabulary that fits the small corpus), preprocessing, the recipe at CPU size (2
    iterations), then the server answers a completion from the checkpoint the recipe saved."""
    import json
    import random

    corpus = load_tool("make_demo_corpus")
    rng = random.Random(1)
    with open(tmp_path / "my.jsonl", "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": corpus.document(rng, 6)}) + "\n")
    (tmp_path / "my").mkdir()
    paths = {"my.jsonl": str(tmp_path / "my.jsonl"), "my/": str(tmp_path / "my") + "/"}
    commands = [substitute(argv, paths) for argv in readme_commands("Your own corpus")]
    assert [argv[0] for argv in commands] == [MEGALOOP, MEGALOOP, "SIZE=cpu", MEGALOOP]
    tokenizer, preprocess, recipe, serve = commands
    megaloop = [sys.executable, "-m", "megaloop"]
    _run(megaloop + set_flag(tokenizer, "--vocab-size", "512")[1:], tmp_path)
    _run(megaloop + preprocess[1:], tmp_path)
    split = recipe.index("bash")
    env = dict(_env(tmp_path), PYTHON=sys.executable, **dict(a.split("=", 1)
                                                               for a in recipe[:split]))
    proc = subprocess.run(recipe[split:] + ["--train-iters", "2", "--lr-warmup-iters", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _serve_and_ask(megaloop + serve[1:], tmp_path)
