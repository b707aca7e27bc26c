"""tools/gpu_check.sh on CPU: the table of skipped GPU rows, and the check's own machinery.

The GPU rows need a GPU (they have not run where this suite runs). What CPU can check is checked
here: the script runs and prints the "no GPU: skipped" table with the refusal row passing, the
gradient comparison finds local vs local equal in every variant (so a TE/local difference on a
GPU is the backend's, not the harness's), the throughput worker's accounting runs end to end, and
TE's fused norm names map to the local spec's.
"""

import os
import subprocess
import sys

import pytest

from distributed import gpu_count, run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import gpu_checks  # noqa: E402


@pytest.mark.skipif(gpu_count() > 0, reason="on a GPU the script runs the full 10-minute check")
def test_gpu_check_without_gpu_prints_the_skipped_table():
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh")], cwd=ROOT,
                          env=dict(os.environ, PYTHON=sys.executable), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "megaloop GPU check: no GPU: skipped" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0] == "| check | status | detail | s |"
    status = {r.split(" | ")[0][2:]: r.split(" | ")[1] for r in rows[1:]}
    assert status["reset-attention-mask with TE refused"] == "PASS"
    for name in gpu_checks.VARIANTS:
        assert status[f"TE vs local grads, T=3: {name}"] == "SKIP"
    assert status["pytest -m gpu tests"] == "SKIP"
    assert "FAIL" not in status.values()
    assert out.count("no GPU: skipped") >= 10


def test_te_fused_norm_names_map_to_local():
    assert gpu_checks.local_name("core.layers.1.self_attention.linear_qkv.layer_norm_weight") \
        == "core.layers.1.input_layernorm.weight"
    assert gpu_checks.local_name("coda.layers.0.mlp.linear_fc1.layer_norm_weight") \
        == "coda.layers.0.pre_mlp_layernorm.weight"
    assert gpu_checks.local_name("core.layers.0.mlp.linear_fc1.weight") \
        == "core.layers.0.mlp.linear_fc1.weight"


def _grads_local_vs_local(rank, world):
    from megaloop.parallel.initialize import initialize
    from megaloop.parallel.config import ParallelConfig

    initialize(ParallelConfig(), 1234)
    return gpu_checks.grads_compare("local", "local")


def test_grads_harness_local_vs_local_is_exact_in_every_variant():
    results = run_distributed(_grads_local_vs_local, 1, timeout=300)[0]
    assert set(results) == set(gpu_checks.VARIANTS)
    for name, r in results.items():
        assert "error" not in r, (name, r.get("error"))
        assert r["ok"] and r["init_max_diff"] == 0, (name, r)
        assert r["grad_rel_err"] == 0 and r["loss_rel_err"] == 0, (name, r)


def _throughput_tiny(rank, world):
    from megaloop.parallel.initialize import initialize
    from megaloop.parallel.config import ParallelConfig

    initialize(ParallelConfig(), 1234)
    base = [a for a in gpu_checks.TINY] + ["--eval-iters", "0"]
    shapes = {"looped": ["--num-layers", "1", "--num-loops", "2", "--exit-loss", "last"],
              "dense": ["--num-layers", "2", "--num-loops", "1"]}
    return gpu_checks.throughput("", base=base, shapes=shapes, warmup=1, iters=1)


def test_throughput_worker_accounts_both_models():
    results = run_distributed(_throughput_tiny, 1, timeout=300)[0]
    assert set(results) == {"looped-bf16", "dense-bf16"}  # no FP8 rows without FP8 flags
    for key, r in results.items():
        assert "error" not in r, (key, r.get("error"))
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["mfu"] is None, r
    assert results["looped-bf16"]["layout"] == "1 x 2 = depth 2"
    assert results["dense-bf16"]["layout"] == "2 x 1 = depth 2"


def test_gpu_rows_flags_pass_validation(monkeypatch):
    """The flag lists of the GPU-only rows pass megaloop's validation as it runs on a GPU
    (validation told a GPU exists; nothing is built), with the BF16 and FP8 settings the table
    claims."""
    import shlex

    import torch

    from megaloop.training.run_config import parse_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # ... and Transformer Engine installed, as in the GPU image the rows run in
    monkeypatch.setattr("megaloop.training.run_config._te_installed", lambda: True)
    for layout in (gpu_checks.LOOPED, gpu_checks.DENSE):
        for fp8 in ("", gpu_checks.DEFAULT_FP8_ARGS):
            cfg = parse_args([*gpu_checks.BIG, *layout, *shlex.split(fp8)])
            cfg.validate(world_size=1)
            assert cfg.training.bf16 and cfg.model.transformer_impl == "transformer_engine"
            assert cfg.loop.effective_depth(cfg.model.num_layers) == 24
    for variant in gpu_checks.VARIANTS.values():
        for impl in ("local", "transformer_engine"):
            parse_args([*gpu_checks.TINY, *variant, "--train-iters", "2",
                        "--transformer-impl", impl]).validate(world_size=1)
