"""The bound tools/generate.py suggests for --max-tokens counts the prompt: the value a refusal
names is accepted when given back and one more is refused; a prompt that alone fills the
context is refused naming both lengths. The numbers come from the checkpoint's context and the
prompt's length, not from the message. (The server's 400 for a request: tests/test_serve.py.)"""

import pytest

from distributed import run_distributed
from test_tools_reliability import _generate, _train


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("generate_bounds") / "ckpt")
    run_distributed(_train, 1, path)
    return path


def _context(load: str) -> int:
    from megaloop.checkpoint.config import read_run_config
    from megaloop.inference.loading import context_length

    return context_length(read_run_config(load))


def test_the_suggested_max_tokens_counts_the_prompt(ckpt):
    context = _context(ckpt)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    bound = context - len(prompt)  # what the prompt leaves of the context
    argv = ["--load", ckpt, "--prompt-ids", ",".join(map(str, prompt)), "--no-stop-at-eod"]
    # --max-tokens past the whole context (the newcomer's 200 on a 128-token model): the bound
    # named is the one left beside the prompt, not context - 1.
    code, out, err = _generate(argv + ["--max-tokens", str(context + 8)])
    assert code == 2 and out == "", err
    assert f"lower --max-tokens {context + 8} to at most {bound} " in err, err
    assert f"has {len(prompt)} tokens" in err and f"context of {context}" in err, err
    code, out, err = _generate(argv + ["--max-tokens", str(bound)])
    assert code == 0, err
    assert len(out.strip().split(",")) == bound  # (no EOD stop: every token generated)
    code, out, err = _generate(argv + ["--max-tokens", str(bound + 1)])
    assert code == 2 and f"at most {bound} " in err, err


def test_a_prompt_that_fills_the_context_is_refused_naming_both_lengths(ckpt):
    context = _context(ckpt)
    prompt = [(3 * i) % 190 + 5 for i in range(context)]
    code, out, err = _generate(["--load", ckpt, "--prompt-ids", ",".join(map(str, prompt)),
                                "--max-tokens", "1"])
    assert code == 2 and out == "", err
    assert err.count("\n") == 1, err
    assert f"has {context} tokens and --max-tokens is 1" in err, err
    assert f"the prompt alone ({context} tokens) fills the context" in err, err
    assert f"shorten it to at most {context - 1} tokens" in err, err
    assert f"--keep-prompt-tail to keep its last {context - 1} tokens" in err, err
