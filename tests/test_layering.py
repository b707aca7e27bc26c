"""The package layering: checkpoints, conversion, inference and evaluation sit below training.

An AST scan of every module (imports at the top and inside functions alike), so a lazy
``from megaloop.training... import`` inside a function counts as much as one at the top.
"""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BELOW_TRAINING = ("megaloop/checkpoint", "megaloop/convert", "megaloop/inference", "megaloop/eval")
# Standard library only at import: flag parsing and --help of the tools read these before torch.
LIGHT = ("megaloop/checkpoint/errors.py", "megaloop/checkpoint/tracker.py",
         "megaloop/checkpoint/config.py", "megaloop/inference/flags.py",
         "megaloop/inference/engine_config.py")


def imported_modules(path: str) -> list:
    """(line, module) of every import in the file, wherever it stands."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            if node.module == "megaloop":  # `from megaloop import training`: the alias names it
                found += [(node.lineno, f"megaloop.{alias.name}") for alias in node.names]
    return found


def python_files(folder: str) -> list:
    out = []
    for dirpath, _, names in os.walk(os.path.join(ROOT, folder)):
        out += [os.path.join(dirpath, n) for n in names if n.endswith(".py")]
    return sorted(out)


def test_scan_sees_lazy_imports(tmp_path):
    """The scan itself: an import inside a function is found, a name that merely starts like
    the package is not."""
    path = tmp_path / "m.py"
    path.write_text("import os\n\ndef f():\n    from megaloop.training.run_config import x\n"
                    "    from megaloop import training\n    import megaloop.trainingx\n")
    mods = [m for _, m in imported_modules(str(path))]
    assert "megaloop.training.run_config" in mods and "megaloop.training" in mods
    assert _is_training("megaloop.training.run_config") and _is_training("megaloop.training")
    assert not _is_training("megaloop.trainingx")


def _is_training(module: str) -> bool:
    return module == "megaloop.training" or module.startswith("megaloop.training.")


@pytest.mark.parametrize("folder", BELOW_TRAINING)
def test_nothing_below_training_imports_training(folder):
    files = python_files(folder)
    assert files, folder
    upward = [f"{os.path.relpath(path, ROOT)}:{line} imports {module}"
              for path in files for line, module in imported_modules(path)
              if _is_training(module)]
    assert not upward, "\n".join(upward)


def test_light_modules_import_no_torch():
    modules = [p[:-3].replace("/", ".") for p in LIGHT]
    code = (f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'megatron', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
