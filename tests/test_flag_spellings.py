"""One output-flag convention across the tools: a tool that writes a folder takes --output-dir
(Hugging Face's name, as tools/evaluate.py), one that writes a file takes --output; a file prefix
keeps Megatron-LM's --output-prefix (tools/preprocess_data.py, tools/merge_datasets.py,
tools/train_tokenizer.py, tools/attention_probes.py) with --output accepted too. The server's model id is vLLM's --served-model-name. Every older spelling
stays an alias of the same argument, so old command lines parse to the same values.

Each tool's parser is its own: the script runs until its first parse_args call (as
tests/test_docs.py reads the scripts' flags), and that parser parses both spellings."""

import argparse
import contextlib
import io
import os
import runpy
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Parser(Exception):
    def __init__(self, parser):
        self.parser = parser


def parser_of(program: str) -> argparse.ArgumentParser:
    """The parser a repository script builds, captured at its first parse_args call (the script
    runs no further)."""
    def capture(self, *args, **kwargs):
        raise _Parser(self)

    saved = sys.argv, argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    path = list(sys.path)
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = capture
    sys.argv = [program]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(os.path.join(ROOT, program), run_name="__main__")
    except _Parser as got:
        return got.parser
    finally:
        sys.argv, argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args \
            = saved
        sys.path[:] = path
    raise AssertionError(f"{program} never parsed its arguments")


# (tool, the other arguments it requires, canonical spelling, old spelling, destination)
SPELLINGS = [
    ("tools/convert_checkpoint.py", ["export-hf", "--load", "ckpt"], "--output-dir", "--out",
     "out"),
    ("tools/merge_datasets.py", ["--input", "shards"], "--output-prefix", "--output",
     "output_prefix"),
    ("tools/serve.py", ["--load", "ckpt"], "--served-model-name", "--model-name", "model_name"),
    ("tools/preprocess_data.py", ["--input", "in.jsonl"], "--output-prefix", "--output",
     "output_prefix"),
    ("tools/train_tokenizer.py", ["--input", "in.jsonl"], "--output-prefix", "--output",
     "output_prefix"),
    ("tools/attention_probes.py", ["--load", "ckpt", "--data-path", "d"], "--output-prefix",
     "--output", "output"),
]


@pytest.mark.parametrize("tool,required,canonical,old,dest", SPELLINGS,
                         ids=[f"{t[0]}:{t[2]}" for t in SPELLINGS])
def test_both_spellings_parse_to_one_destination(tool, required, canonical, old, dest):
    parser = parser_of(tool)
    for flag in (canonical, old):
        args = parser.parse_args([*required, flag, "some/where"])
        assert getattr(args, dest) == "some/where", (tool, flag)
    # One argument with both option strings (not two that would both be listed in --help and
    # could disagree on defaults), the canonical spelling first, so --help and errors show it.
    actions = [a for a in _all_actions(parser) if canonical in a.option_strings]
    assert [a.option_strings[:2] for a in actions] == [[canonical, old]], tool


@pytest.mark.parametrize("tool,required,flag", [
    ("tools/plot_run.py", ["run.jsonl"], "--output"),               # a PNG file
    ("tools/evaluate.py", None, "--output-dir"),                    # a folder of results
])
def test_the_other_tools_already_use_the_convention(tool, required, flag):
    """The tools that already spelled their output flag by the convention keep it."""
    parser = parser_of(tool)
    assert any(flag in a.option_strings for a in _all_actions(parser)), (tool, flag)
    if required is not None:
        assert parser.parse_args([*required, flag, "x"]).output == "x"


def test_a_missing_output_flag_is_named_by_its_canonical_spelling(capsys):
    """argparse's 'required' error names the argument by all its spellings, canonical first."""
    parser = parser_of("tools/convert_checkpoint.py")
    with pytest.raises(SystemExit):
        parser.parse_args(["export-hf", "--load", "ckpt"])
    assert "--output-dir/--out" in capsys.readouterr().err


def _all_actions(parser: argparse.ArgumentParser) -> list:
    out = []
    for action in parser._actions:
        out.append(action)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += _all_actions(sub)
    return out
