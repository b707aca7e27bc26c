"""Every caller decodes through the batching engine: a second decode loop fails this test.

A decode loop samples a token from the model's logits and feeds it back. The pieces one needs
are named here, and each may be called only where the engine uses it (the source is parsed,
nothing is imported):

- ``sample_rows`` (drawing the next tokens): the engine alone;
- ``draw`` / ``probabilities`` (drawing from a distribution): the sampler and the engine's
  self-speculation round;
- ``decode_step`` (a one-token early-exit forward over a cache) and ``LoopKVCache`` (a decode
  cache): the engine and its paged cache; besides them only benchmarks/decode.py, which scores
  held-out text teacher-forced through them and samples nothing;
- ``torch.multinomial``: nowhere (the engine's streams are counter-based).

``Generator`` is the engine's synchronous face: its module never calls the model itself.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("megaloop", "tools", "benchmarks", "examples", "pretrain_looplm.py")

ALLOWED = {
    "sample_rows": {"megaloop/inference/engine.py"},
    "draw": {"megaloop/inference/speculation.py"},
    "probabilities": {"megaloop/inference/speculation.py", "megaloop/inference/engine.py"},
    "decode_step": {"megaloop/inference/engine.py", "benchmarks/decode.py"},
    "LoopKVCache": {"megaloop/inference/engine.py", "megaloop/inference/paged_kv.py",
                    "benchmarks/decode.py"},
    "multinomial": set(),
}
DEFINED_IN = {"sample_rows": "megaloop/inference/sampling.py",
              "draw": "megaloop/inference/sampling.py",
              "probabilities": "megaloop/inference/sampling.py",
              "decode_step": "megaloop/inference/early_exit.py",
              "LoopKVCache": "megaloop/inference/kv_cache.py"}


def _files():
    for top in SOURCES:
        path = os.path.join(ROOT, top)
        if os.path.isfile(path):
            yield top
            continue
        for folder, _, names in os.walk(path):
            for name in names:
                if name.endswith(".py"):
                    yield os.path.relpath(os.path.join(folder, name), ROOT)


def _called(tree) -> set:
    """Names of the functions and classes a module calls (``f(...)`` and ``x.f(...)``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else getattr(f, "attr", None))
    return names


def _callers() -> dict:
    found = {name: set() for name in ALLOWED}
    for rel in _files():
        with open(os.path.join(ROOT, rel)) as f:
            tree = ast.parse(f.read(), rel)
        for name in _called(tree) & set(ALLOWED):
            if DEFINED_IN.get(name) != rel:  # (a module's own uses of what it defines)
                found[name].add(rel)
    return found


def test_only_the_engine_decodes():
    found = _callers()
    for name, allowed in ALLOWED.items():
        assert found[name] <= allowed, (
            f"{name} is called in {sorted(found[name] - allowed)}: decode through "
            f"InferenceEngine (or Generator, its synchronous face), not a loop of your own")
    # the engine really is where they are called (else this test could pass on a renamed API)
    assert "megaloop/inference/engine.py" in found["sample_rows"]
    assert "megaloop/inference/engine.py" in found["decode_step"]


def test_generator_never_calls_the_model():
    with open(os.path.join(ROOT, "megaloop/inference/generate.py")) as f:
        tree = ast.parse(f.read())
    calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert not {c for c in calls if c.startswith("self.model")}, calls
    assert "InferenceEngine" in calls and "engine.step" in calls


def test_a_second_loop_is_caught(tmp_path, monkeypatch):
    """The scan finds a sampling call planted in another module."""
    planted = tmp_path / "megaloop" / "inference"
    planted.mkdir(parents=True)
    (planted / "my_loop.py").write_text(
        "from megaloop.inference.sampling import sample_rows\n"
        "def loop(model, ids):\n    return sample_rows(model(ids), [0], [0], [1], [0], [0], [0])\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", str(tmp_path))
    with pytest.raises(AssertionError, match="sample_rows is called in"):
        test_only_the_engine_decodes()
