"""The six studies of examples/studies at --size tiny, end to end: each script trains its arms,
evaluates them and writes its Markdown table (every column, a row per arm) and its PNG. Whether a
finding holds is for the README's cpu-size results, not for this test."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUDIES = {
    "loop_vs_dense": (["final validation loss", "per-step loss at T", "task accuracy at T",
                       "| depth | regime | loss | accuracy | k=1 |"],
                      ["looped 1 x 2", "dense 1 (same parameters)", "dense 2 (same compute)"]),
    "gate_collapse": (["final p0", "max p0", "longest run above threshold", "alarm fired",
                       "per-step validation loss", "exit distribution"],
                      ["no warmup, beta 0.05", "no warmup, beta 0.1", "no warmup, beta 0.5",
                       "warmup, beta 0.15"]),
    "norm_placement": (["final validation objective", "drop, second half", "plateau",
                        "at loop step 1", "layer 1 / layer 2 at step 2"],
                       ["| ouro |", "| pre |", "| magic |", "| post |", "| sandwich |"]),
    "dense_to_loop": (["per-step loss after conversion",
                       "per-step loss after continued training", "final loss"],
                      ["looped as it is", "input mixing + smoothed exit loss",
                       "input mixing + smoothed + stepwise LoRA", "dense, continued"]),
    "multi_resolution": (["FLOPs / iteration", "vs full", "training FLOPs",
                          "final validation loss"],
                         ["full resolution (plain loop)", "Anchor", "MeSH"]),
    "extrapolation": (["| arm | depth | regime | loss | accuracy | accuracy by k |",
                       "training horizon", "extrapolation"],
                      ["BaseLoop 3 x 3", "CoreLoop 1 + 1 x 3 + 1",
                       "CoreLoop + history injection + loop gating"]),
}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("studies")


@pytest.mark.parametrize("name", list(STUDIES))
def test_study_runs_and_writes_every_column(name, out):
    spec = importlib.util.spec_from_file_location(
        f"study_{name}", os.path.join(ROOT, "examples", "studies", f"{name}.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--size", "tiny", "--output-dir", str(out)]) == 0
    md = (out / "studies" / f"{name}.md").read_text()
    columns, arms = STUDIES[name]
    for needle in columns + arms:
        assert needle in md, f"{name}.md lacks {needle!r}:\n{md}"
    assert "nan" not in md.replace("nans", "")
    with open(out / "studies" / f"{name}.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
