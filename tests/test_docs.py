"""What README.md and docs/*.md name exists: every repository path, Python name and flag.

Paths: a path in backticks, in a command or in a link whose first part is an entry of the
repository root (not one .gitignore names: the demo's output folder `demo/` is made by the demo)
must exist; a glob must match; ``file.py::test_name`` must name a test defined in that file; a
link's ``#anchor`` must be a heading of its target. ``megaloop.a.b.name`` must be a module (and a
name defined in it).

Flags: a ``--flag`` must be accepted by the program it is shown with. In a command (a code block
line, or a backtick span that starts with a program) that is the repository script it runs;
flags before the script belong to its launcher (torchrun's are checked against torchrun's parser,
those of sbatch, srun, docker, curl, pip or pytest are not megaloop's and are not checked). A flag
in prose must be accepted by one of megaloop's parsers.

The parsers are the scripts' own: each script runs until its first ``parse_args`` call, which
raises with the parser. Scripts under benchmarks/ import torch and megatron-core at the top
(seconds each), so their flags are read from their ``add_argument`` calls instead; torchrun's
from its source.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fnmatch
import functools
import glob
import importlib.util
import io
import os
import re
import runpy
import shlex
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
# Programs that are not megaloop's: their flags are theirs to define.
FOREIGN = {"sbatch", "srun", "scancel", "squeue", "docker", "curl", "pip", "pytest", "scontrol",
           "git", "export", "tar", "ls", "cd", "cat", "kill"}
FLAG = re.compile(r"(?<![\w\-/.])--[A-Za-z][A-Za-z0-9_\-]*\*?")  # `--moe-*`: a family
# The studies' shared modules (no command line of their own).
STUDY_LIBRARIES = {"study.py", "verdicts.py"}
# Shell scripts that hand their flags to a Python program: a recipe's go to the trainer, a
# study's to every study (examples/studies/run_all.sh passes "$@" to each).
SHELL_TO_PYTHON = {"tools/gpu_check.sh": ["-m megaloop.gpu_check"],
                   **{os.path.relpath(p, ROOT): ["pretrain_looplm.py"] for p in
                      glob.glob(os.path.join(ROOT, "examples/recipes/[!_]*.sh"))
                      if not os.path.basename(p).startswith("make_")},  # data makers
                   "examples/studies/run_all.sh": sorted(
                       os.path.relpath(p, ROOT)
                       for p in glob.glob(os.path.join(ROOT, "examples/studies/*.py"))
                       if os.path.basename(p) not in STUDY_LIBRARIES)}


# ---------------------------------------------------------------------------------- the pages

def _read(page: str) -> list[str]:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read().split("\n")


def _blocks(lines: list[str]):
    """(line number, text, kind) of a page: kind 'code' for a line of a shell code block (its
    backslash-continued lines joined), 'span' for a backtick span, 'link' for a link target."""
    fence, lang, pending = None, "", ""
    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fence = None if fence else n
            lang = line.strip()[3:].strip()
            continue
        if fence:
            if lang in ("", "bash", "sh", "console"):
                pending += line.rstrip("\\ ") + " " if line.rstrip().endswith("\\") else line
                if not line.rstrip().endswith("\\"):
                    yield n, pending, "code"
                    pending = ""
            continue
        for span in re.findall(r"``?([^`]+)``?", line):
            yield n, span, "span"
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            yield n, target, "link"


@functools.lru_cache(maxsize=None)
def _roots() -> frozenset[str]:
    """Entries of the repository root that the repository holds (not ignored outputs)."""
    with open(os.path.join(ROOT, ".gitignore")) as f:
        ignored = [p.strip().strip("/") for p in f if p.strip() and not p.startswith("#")]
    return frozenset(e for e in os.listdir(ROOT) if e != ".git"
                     and not any(fnmatch.fnmatch(e, p) for p in ignored))


def _anchors(page: str, lines: list[str] | None = None) -> frozenset[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out, fence = set(), False
    for line in _read(page) if lines is None else lines:
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return frozenset(out)


# ---------------------------------------------------------------------------------- paths

def _defined(source: str, names: list[str]) -> bool:
    """Whether ``names[0]`` is defined at the top of a module (``names[1]`` in that class)."""
    body = ast.parse(source).body
    for name in names:
        found = None
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                hit = node.name == name
            elif isinstance(node, ast.Assign):
                hit = any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
            elif isinstance(node, ast.AnnAssign):
                hit = isinstance(node.target, ast.Name) and node.target.id == name
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                hit = any((a.asname or a.name) == name for a in node.names)
            else:
                hit = False
            if hit:
                found = node
                break
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


def _missing_python_name(dotted: str) -> str | None:
    """Why ``megaloop.x.y[.name[.member]]`` does not exist, or None."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = os.path.join(ROOT, *parts[:i])
        for module in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(module):
                rest = parts[i:]
                if not rest:
                    return None
                with open(module, encoding="utf-8") as f:
                    if _defined(f.read(), rest[:2]):
                        return None
                return f"{'.'.join(rest)} is not defined in {os.path.relpath(module, ROOT)}"
    return "no such module"


def _path_problem(page: str, lines: list[str], token: str, link: bool) -> str | None:
    """Why a path-like token names nothing in the repository, or None (also when it is not a
    repository path at all)."""
    if not link:
        token = token.strip(".,;:()'\"")
    if re.fullmatch(r"megaloop(\.\w+)+", token.split("(")[0]):
        return _missing_python_name(token.split("(")[0])
    if link:
        if re.match(r"[a-z]+://|mailto:", token):
            return None
        target, _, anchor = token.partition("#")
        path = os.path.normpath(os.path.join(os.path.dirname(page), target)) if target else page
        if not os.path.exists(os.path.join(ROOT, path)):
            return "no such file"
        if anchor and path.endswith(".md") and anchor not in _anchors(
                path, lines if path == page else None):
            return f"no heading #{anchor} in {path}"
        return None
    path, _, test = token.partition("::")
    first = path.split("/")[0]
    if first not in _roots() or re.search(r"[<>{}$]|XXX", path):
        return None  # not a repository path (an output, a placeholder)
    matches = glob.glob(os.path.join(ROOT, path))
    if not matches:
        return "no such file or directory"
    if test:
        with open(matches[0], encoding="utf-8") as f:
            if not _defined(f.read(), [test.split("[")[0]]):
                return f"no test {test} in {path}"
    return None


def _path_tokens(text: str) -> list[str]:
    return [t for t in re.split(r"[\s,;=]+", text) if "/" in t or "." in t or "::" in t]


def path_problems(page: str, lines: list[str]) -> list[str]:
    wrong = []
    for n, text, kind in _blocks(lines):
        for token in [text] if kind == "link" else _path_tokens(text):
            why = _path_problem(page, lines, token, kind == "link")
            if why:
                wrong.append(f"{page}:{n}: {token}: {why}")
    return wrong


@pytest.mark.parametrize("page", PAGES)
def test_named_paths_exist(page):
    wrong = path_problems(page, _read(page))
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------------------------- parsers

class _Parser(Exception):
    def __init__(self, parser):
        self.parser = parser


def _option_strings(parser: argparse.ArgumentParser) -> frozenset[str]:
    out = set()
    for action in parser._actions:
        out.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _option_strings(sub)
    return frozenset(out)


def _add_argument_flags(path: str) -> frozenset[str]:
    """The option strings of every ``add_argument`` call in a file's source."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return frozenset(
        arg.value for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"
        for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
        and arg.value.startswith("-"))


@functools.lru_cache(maxsize=None)
def flags_of(program: str) -> frozenset[str]:
    """The flags a program accepts: a repository script's path, ``-m module`` or ``torchrun``."""
    if program == "torchrun":  # torch.distributed.run, read without importing torch
        spec = importlib.util.find_spec("torch")
        return _add_argument_flags(os.path.join(os.path.dirname(spec.origin),
                                                "distributed", "run.py"))
    if program in SHELL_TO_PYTHON:
        sets = [flags_of(p) for p in SHELL_TO_PYTHON[program]]
        return frozenset.intersection(*sets)
    if program.startswith("benchmarks/"):
        return _add_argument_flags(os.path.join(ROOT, program))
    if program == "tools/run_lm_eval.py":  # lm-eval's own command line (see the tool)
        from lm_eval._cli.harness import HarnessCLI
        return _option_strings(HarnessCLI()._parser)
    if not program.endswith(".py") and not program.startswith("-m "):
        return frozenset()  # a shell script: takes no flags of its own

    def capture(self, *args, **kwargs):
        raise _Parser(self)

    saved = sys.argv, argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    path = list(sys.path)  # the scripts put their folders first; later tests must not see them
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = capture
    sys.argv = [program]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            if program.startswith("-m "):
                runpy.run_module(program[3:], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(os.path.join(ROOT, program), run_name="__main__")
    except _Parser as got:
        return _option_strings(got.parser)
    finally:
        sys.argv, argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args \
            = saved
        sys.path[:] = path
    raise AssertionError(f"{program} never parsed its arguments")


@functools.lru_cache(maxsize=None)
def _all_flags() -> frozenset[str]:
    programs = (["pretrain_looplm.py", "train_rl.py", "torchrun", "-m megaloop.gpu_check"]
                + sorted(os.path.relpath(p, ROOT) for pattern in
                         ("tools/*.py", "examples/studies/*.py", "benchmarks/*.py")
                         for p in glob.glob(os.path.join(ROOT, pattern))
                         if os.path.basename(p) not in STUDY_LIBRARIES))
    return frozenset().union(*(flags_of(p) for p in programs))


# ---------------------------------------------------------------------------------- commands

def _words(command: str) -> list[str]:
    try:
        return shlex.split(command, comments=True)
    except ValueError:  # an unbalanced quote in a fragment of prose
        return command.split()


def _script(word: str) -> str | None:
    """The repository script a word runs (``./tools/x.py`` -> ``tools/x.py``), or None."""
    path = os.path.normpath(word)
    if path.split("/")[0] in _roots() and re.search(r"\.(py|sh|sbatch)$", path):
        return path
    return None


def _commands(text: str):
    """(program, launcher, flags after it, flags before it) per simple command of a line;
    program None when the command runs no repository script."""
    for command in re.split(r"\|\||&&|[|;&]", text):
        words = _words(command)
        while words and re.fullmatch(r"[A-Za-z_]\w*=\S*", words[0]):
            words = words[1:]  # environment assignments
        if not words:
            continue
        program, at = None, len(words)
        for i, word in enumerate(words):
            if _script(word):
                program, at = _script(word), i
                break
            if word == "-m" and i + 1 < len(words):
                if words[i + 1] == "torch.distributed.run":
                    continue
                program, at = f"-m {words[i + 1]}", i + 1
                break
        launcher = os.path.basename(words[0])
        if launcher not in FOREIGN and ("torchrun" in words[:at]
                                        or "torch.distributed.run" in words[:at]
                                        or launcher == "torchrun"):
            launcher = "torchrun"
        before = [f for w in words[:at] for f in FLAG.findall(w)]
        after = [f for w in words[at + 1:] for f in FLAG.findall(w)]
        yield program, launcher, after, before


def _accepts(accepted: frozenset[str], flag: str) -> bool:
    return any(fnmatch.fnmatchcase(a, flag) for a in accepted) if "*" in flag else flag in accepted


def _flag_problems(text: str, kind: str) -> list[str]:
    wrong = []
    words = _words(text)
    is_command = kind == "code" or (words and (_script(words[0]) or os.path.basename(words[0])
                                               in FOREIGN | {"python", "torchrun", "bash"}))
    if not is_command:
        return [f"{f}: accepted by no megaloop parser" for f in FLAG.findall(text)
                if not _accepts(_all_flags(), f)]
    for program, launcher, after, before in _commands(text):
        if launcher in FOREIGN or program in ("-m pytest",):
            continue
        if launcher == "torchrun":
            wrong += [f"{f}: not a torchrun flag" for f in before if not _accepts(flags_of("torchrun"), f)]
        if program is None or not after:
            continue
        if program.endswith(".sbatch"):  # run with bash, it submits itself: sbatch's options
            continue
        accepted = flags_of(program)
        wrong += [f"{f}: not a flag of {program}" for f in after if not _accepts(accepted, f)]
    return wrong


def flag_problems(page: str, lines: list[str]) -> list[str]:
    return [f"{page}:{n}: {why}" for n, text, kind in _blocks(lines) if kind != "link"
            for why in _flag_problems(text, kind)]


@pytest.mark.parametrize("page", PAGES)
def test_named_flags_are_accepted(page):
    wrong = flag_problems(page, _read(page))
    assert not wrong, "\n".join(wrong)


def test_the_checks_catch_misspellings():
    """Each line of this page names one thing wrongly (the line number is the expectation)."""
    page = [
        "Run `tools/generat.py` or see [the checks](#checks).",  # 1: path, 1: anchor
        "```bash",
        "python tools/generate.py --load CKPT --max-token 3",  # 3: generate has --max-tokens
        "python tools/generate.py --load CKPT --hidden-size 4",  # 4: a trainer flag
        "torchrun --nproc_per_nodes 2 pretrain_looplm.py --num-loops 2",  # 5: torchrun's
        "```",
        "With `--num-loop 4` and `tests/test_docs.py::test_nothing`.",  # 7: flag, 7: test
        "`megaloop.model.config.no_such_name` and `megaloop.no_such_module`.",  # 8, 8
        "## Paths",
        "Right: `tools/generate.py --max-tokens 3`, `--num-loops`, `sbatch --nodes 2`,",
        "`megaloop.model.config.LoopConfig`, `tests/test_docs.py::test_the_checks_catch_"
        "misspellings`, [the paths](#paths), `demo/checkpoint`, `tests/test_data_*.py`.",
        "```bash",
        "torchrun --nproc_per_node 2 pretrain_looplm.py --num-loops 2 --hidden-size 4",
        "```",
    ]
    wrong = path_problems("README.md", page) + flag_problems("README.md", page)
    lines = sorted(int(w.split(":")[1]) for w in wrong)
    assert lines == [1, 1, 3, 4, 5, 7, 7, 8, 8], "\n".join(wrong)


def test_readme_first_screen():
    """The README stays at most 200 lines, and its first screen (before the first section) gives
    the two commands (.ci/run's test command among them), says what the demo will not do, and
    says plainly that no GPU has run it; dated figures live in docs/benchmarks.md."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert readme.count("\n") <= 200
    first = readme.split("\n## ", 1)[0]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        test_command = re.search(r"^bash tools/setup_venv.sh && (.*pytest tests -q)$", f.read(),
                                 re.M).group(1)
    assert "bash examples/demo_cpu.sh" in first and test_command in first
    assert "No GPU has ever run it" in first and "tools/gpu_check.sh" in first
    assert "not of its content" in first  # what to expect of the toy model
    assert not re.search(r"20\d\d-\d\d-\d\d", first), "dated figures belong to docs/benchmarks.md"


def _bullets(text: str):
    """A page's list items, each with its continuation lines joined."""
    item = None
    for line in text.splitlines() + [""]:
        if line.startswith("- "):
            if item is not None:
                yield item
            item = line
        elif item is not None and line.startswith("  "):
            item += " " + line.strip()
        else:
            if item is not None:
                yield item
            item = None


@pytest.mark.parametrize("page", [p for p in PAGES if p.startswith("docs/")])
def test_every_verified_claim_names_its_evidence(page):
    """A docs page's "*Verified:*" claim names the test, benchmark or example that shows it (whose
    existence test_named_paths_exist checks), so a claim cannot go stale without a file to blame."""
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    bare = [item[:120] for item in _bullets(text) if "*Verified:*" in item
            and not re.search(r"`(tests|benchmarks|examples)/", item.split("*Verified:*", 1)[1])]
    assert not bare, bare
