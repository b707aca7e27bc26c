"""megaloop/rl's modules import one another without a circle: train.py (train_rl.py's sequence)
loads trainer.py lazily once the flags are checked, and trainer.py imports nothing of train.py
(the prompt draw and the rollout seeds live in rollouts.py, the rollout log in telemetry.py).
An AST scan (tests/test_layering.py's), so an import inside a function counts too."""

import os

from test_layering import ROOT, imported_modules

RL = os.path.join(ROOT, "megaloop", "rl")


def rl_imports() -> dict:
    """{module: the megaloop.rl modules it imports}, for every module of megaloop/rl."""
    names = {f[:-3] for f in os.listdir(RL) if f.endswith(".py")}
    graph = {}
    for name in names:
        found = imported_modules(os.path.join(RL, name + ".py"))
        deps = {module.split(".")[2] for _, module in found if module.startswith("megaloop.rl.")}
        graph[name] = deps & names - {name}
    return graph


def find_circle(graph: dict):
    """A list of modules that import one another in a circle, or None."""
    done, path = set(), []

    def visit(name):
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        path.append(name)
        for dep in sorted(graph[name]):
            circle = visit(dep)
            if circle:
                return circle
        path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        circle = visit(name)
        if circle:
            return circle
    return None


def test_rl_modules_import_without_a_circle():
    graph = rl_imports()
    assert "trainer" in graph["train"]  # the scan sees the lazy import inside a function
    assert find_circle(graph) is None, " -> ".join(find_circle(graph))


def test_the_scan_finds_a_circle():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None
