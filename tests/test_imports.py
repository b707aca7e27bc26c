"""Modules that once imported each other stay in one direction.

Three pairs were cycles, each half hidden by an import inside a function (the cycle works at run
time, so nothing failed, but neither module could be read or loaded without the other):

- ``megaloop.convert.hf_export`` <-> ``megaloop.convert.hf_looped``: the export writes the looped
  config.json form that hf_looped reads and defines, so hf_export imports hf_looped;
- ``megaloop.inference.engine`` <-> ``megaloop.inference.generate``: generate is a thin face of
  the engine, so generate imports the engine;
- ``megaloop.parallel.balance`` -> ``megaloop.training``: the pipeline balancer sits below
  training (the trainer uses it), so it imports nothing of training.

The check is static, an ``ast`` scan of the modules' source (imports at the top and inside
functions alike, relative ones resolved, ``importlib.import_module("...")`` with a literal name
too), and follows the imports transitively through megaloop's own modules: a cycle through a
third module is a cycle as well.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (lower, upper): nothing the lower module imports, directly or through other megaloop modules,
# is the upper module or inside it (a package name covers its submodules).
DOWNWARD = [
    ("megaloop.convert.hf_looped", "megaloop.convert.hf_export"),
    ("megaloop.inference.engine", "megaloop.inference.generate"),
    ("megaloop.parallel.balance", "megaloop.training"),
]


def module_path(module: str, root: str = ROOT):
    """The source file of a module under ``root`` (a package's __init__.py), or None when it is
    not a file there (a third-party or standard-library module)."""
    base = os.path.join(root, *module.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def imported_names(source: str, module: str, is_package: bool = False) -> list:
    """(line, module name) of every import in ``source``, the code of ``module``, wherever it
    stands. ``from a import b`` yields both ``a`` and ``a.b`` (b may be a submodule; a name that
    is not a module is dropped by the caller, which finds no file for it)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from . import x`, `from ..model import y`
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                origin = f"{base}.{node.module}" if node.module else base
            else:
                origin = node.module
            found.append((node.lineno, origin))
            found += [(node.lineno, f"{origin}.{alias.name}") for alias in node.names
                      if alias.name != "*"]
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module"
                   or getattr(node.func, "id", None) in ("import_module", "__import__"))):
            found.append((node.lineno, node.args[0].value))
    return found


def _parents(module: str) -> list:
    """Importing a.b.c runs a/__init__.py and a/b/__init__.py first."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_chain(start: str, upper: str, root: str = ROOT):
    """The chain of imports (``["a:12 imports b", ...]``) by which ``start`` reaches ``upper`` or a
    module inside it, following megaloop's own modules (under ``root``); None if it does not."""
    seen, todo = {start}, [(start, [])]
    while todo:
        module, chain = todo.pop()
        path = module_path(module, root)
        with open(path) as f:
            names = imported_names(f.read(), module, path.endswith("__init__.py"))
        for line, name in names:
            for target in [*_parents(name), name]:
                if target == module or module_path(target, root) is None:
                    continue
                step = chain + [f"{module}:{line} imports {name}"]
                if target == upper or target.startswith(upper + "."):
                    return step
                if target not in seen:
                    seen.add(target)
                    todo.append((target, step))
    return None


@pytest.mark.parametrize("lower,upper", DOWNWARD, ids=[f"{a}-{b}" for a, b in DOWNWARD])
def test_imports_go_one_way(lower, upper):
    assert module_path(lower) and module_path(upper), (lower, upper)  # the names still exist
    chain = import_chain(lower, upper)
    assert chain is None, f"{lower} imports {upper} again:\n  " + "\n  ".join(chain)


def _tree(tmp_path, files: dict):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("form", [
    "import pkg.up\n",
    "def f():\n    from pkg.up import g\n",  # inside a function
    "def f():\n    from pkg import up\n",  # the submodule as a name
    "from . import up\n",  # relative
    "from .up import g\n",
    "import importlib\nM = importlib.import_module('pkg.up')\n",
    "from pkg.middle import h\n",  # through a third module
])
def test_scan_finds_each_form_of_import(tmp_path, form):
    """The check itself fails on an upward import in any of these spellings."""
    _tree(tmp_path, {"pkg/__init__.py": "", "pkg/up.py": "def g(): pass\n", "pkg/low.py": form,
                     "pkg/middle.py": "def h():\n    import pkg.up\n"})
    assert import_chain("pkg.low", "pkg.up", str(tmp_path)) is not None


def test_scan_passes_what_is_not_an_upward_import(tmp_path):
    """A name that only starts like the upper module, a string that is not an import, and the
    upper module importing the lower one (the allowed direction) pass."""
    _tree(tmp_path, {"pkg/__init__.py": "", "pkg/up.py": "import pkg.low\n",
                     "pkg/upper.py": "", "pkg/low.py":
                     "import os\nimport pkg.upper\nX = 'pkg.up'\nprint('import_module')\n"})
    assert import_chain("pkg.low", "pkg.up", str(tmp_path)) is None
