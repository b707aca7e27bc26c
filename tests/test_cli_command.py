"""The ``megaloop`` console command (megaloop/cli/main.py): its list imports nothing heavy, each
subcommand is exactly the tool script of the same module (same help, same flags, same exit
codes), a mistyped command names the one meant, and setup.py installs the command."""

import contextlib
import importlib.util
import io
import os
import subprocess
import sys

import pytest

from megaloop.cli.main import COMMANDS, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(fn, argv, monkeypatch):
    """(exit code, stdout, stderr) of ``fn()`` run with ``argv`` as sys.argv."""
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "argv", list(argv))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = fn()
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def test_the_command_list_imports_neither_torch_nor_megatron():
    probe = ("import sys; from megaloop.cli.main import main; code = main(['--help']); "
             "heavy = {n.split('.')[0] for n in sys.modules} & {'torch', 'megatron', 'numpy'}; "
             "print('HEAVY:' + ','.join(sorted(heavy))); sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rsplit("HEAVY:", 1)[1].strip() == ""
    for name, cmd in COMMANDS.items():  # every command listed with its summary
        assert f"  {name}" in proc.stdout and cmd.summary in " ".join(proc.stdout.split())


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_is_its_tool_script(name, monkeypatch):
    """`megaloop NAME --help` prints the help of the script over the same module (tools/*.py, or
    for gpu-check the module tools/gpu_check.sh runs), with only the program's name changed."""
    monkeypatch.setenv("COLUMNS", "1000")  # one usage line: the names' lengths wrap nothing
    code, out, err = _run(lambda: main([name, "--help"]), ["megaloop"], monkeypatch)
    assert code == 0, err
    assert out.startswith(f"usage: megaloop {name} ") or name == "lm-eval", out[:300]
    module = COMMANDS[name].module
    if module == "megaloop.gpu_check.main":
        script, prog = None, "tools/gpu_check.sh"
    else:
        script = os.path.join(ROOT, "tools", module.rsplit(".", 1)[1] + ".py")
        prog = os.path.basename(script)
        # the script is a thin wrapper: it runs this very function of this very module
        text = open(script).read()
        assert f"from {module} import {COMMANDS[name].entry}" in text
    if script is None:
        fn = lambda: importlib.import_module(module).main()  # noqa: E731
    else:
        def fn():
            spec = importlib.util.spec_from_file_location("__tool__", script)
            tool = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(tool)  # (not as __main__: its guard keeps it from running)
            return getattr(tool, COMMANDS[name].entry)()
    code, script_out, err = _run(fn, [prog, "--help"], monkeypatch)
    assert code in (0, None), err
    assert script_out.replace(f"usage: {prog} ", f"usage: megaloop {name} ", 1) == out


def test_flags_and_exit_codes_pass_through(tmp_path, monkeypatch):
    """A refusal of the command itself comes back unchanged: merge of a folder with no datasets
    exits 2 naming the flag, as tools/merge_datasets.py does."""
    (tmp_path / "empty").mkdir()
    argv = ["--input", str(tmp_path / "empty"), "--output-prefix", str(tmp_path / "out")]
    code, _, err = _run(lambda: main(["merge", *argv]), ["megaloop"], monkeypatch)
    script = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "merge_datasets.py"),
                             *argv], capture_output=True, text=True, timeout=120)
    assert code == script.returncode == 2
    assert err.strip() and err == script.stderr.replace("merge_datasets.py", "megaloop merge")


@pytest.mark.parametrize("argv, says", [
    (["genrate", "--load", "x"], "did you mean `megaloop generate`?"),
    (["--load", "x"], "the command comes first, its flags after it"),
    (["train"], "megaloop --help lists them"),
])
def test_an_unknown_command_says_what_was_meant(argv, says, monkeypatch):
    code, out, err = _run(lambda: main(argv), ["megaloop"], monkeypatch)
    assert code == 2 and out == ""
    assert f"unknown command {argv[0]!r}" in err and says in err


def test_no_command_prints_the_list_and_fails():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([]) == 2
    assert "commands:" in out.getvalue()


def test_setup_installs_the_console_command():
    """The venv's `megaloop` (setup.py's console_scripts, installed by tools/setup_venv.sh) runs
    main(); `python -m megaloop` is the same."""
    exe = os.path.join(os.path.dirname(sys.executable), "megaloop")
    assert os.access(exe, os.X_OK), f"{exe} missing: run bash tools/setup_venv.sh"
    for cmd in ([exe, "--help"], [sys.executable, "-m", "megaloop", "--help"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd="/")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == _help_text()


def _help_text():
    from megaloop.cli.main import help_text

    return help_text()


def test_help_of_a_command_is_that_commands_help(monkeypatch):
    """`megaloop help merge` is `megaloop merge --help` (the name is not taken and dropped)."""
    monkeypatch.setenv("COLUMNS", "1000")
    code, out, _ = _run(lambda: main(["help", "merge"]), ["megaloop"], monkeypatch)
    code2, out2, _ = _run(lambda: main(["merge", "--help"]), ["megaloop"], monkeypatch)
    assert code == code2 == 0 and out == out2 and out.startswith("usage: megaloop merge ")

