"""One pytest process imports megatron-core once; distributed tests fork ranks from it."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from megaloop import runtime  # noqa: E402

runtime.quiet_megatron()  # the entry points' filter, so tests see what a run prints

# torch.cuda.is_available() asks NVML instead of the CUDA driver: this process never initialises
# CUDA, which its forked or spawned ranks need (see distributed.py).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: E402

from megaloop import cpu_shim  # noqa: E402

cpu_shim.enable()
torch.set_num_threads(1)

import megatron.core  # noqa: E402,F401  (import once, before any fork)
# What a trainer imports lazily (model specs, checkpoint strategies, the data helpers): here once,
# instead of afresh in every forked rank of every test.
import megaloop.training.run  # noqa: E402,F401
import megaloop.training.trainer  # noqa: E402,F401
import megatron.core.dist_checkpointing.strategies.fully_parallel  # noqa: E402,F401
import megatron.core.dist_checkpointing.strategies.torch  # noqa: E402,F401
import megatron.core.models.gpt.gpt_layer_specs  # noqa: E402,F401

import pytest  # noqa: E402

from shuffle_memo import memoize_shuffle_index  # noqa: E402


def _te_import_error():
    """None where Transformer Engine's PyTorch modules import (the TE venv: bash
    tools/setup_te_venv.sh), else why not. Imported here once, before any rank is forked."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        return "Transformer Engine is not installed (bash tools/setup_te_venv.sh makes .venv-te)"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # a half-installed TE raises anything from OSError to RuntimeError
        return f"transformer_engine.pytorch does not import: {exc}"
    return None


def pytest_collection_modifyitems(config, items):
    """te_structure tests build TE's modules: skipped (with the reason) where TE does not
    import, i.e. in the main venv, which never installs it. slurm tests submit jobs to a real
    cluster: skipped unless MEGALOOP_SLURM_CLUSTER=1 says one is up (.ci/run's stage starts it
    with tools/slurm_test_cluster.sh)."""
    if os.environ.get("MEGALOOP_SLURM_CLUSTER") != "1":
        no_cluster = pytest.mark.skip(reason="slurm: no test cluster (MEGALOOP_SLURM_CLUSTER=1 "
                                             "after sudo bash tools/slurm_test_cluster.sh up)")
        for item in items:
            if item.get_closest_marker("slurm"):
                item.add_marker(no_cluster)
    if not any(item.get_closest_marker("te_structure") for item in items):
        return
    reason = _te_import_error()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"te_structure: {reason}")
    for item in items:
        if item.get_closest_marker("te_structure"):
            item.add_marker(skip)

memoize_shuffle_index()  # ~0.5 s per split of every --mock-data trainer, bit for bit the same


@pytest.fixture(autouse=True)
def _restore_te_attention_env():
    """Validation sets Transformer Engine's NVTE_* attention switches for --attention-backend
    (and megatron-core's LanguageModule sets them for `auto` when a model is built); it asserts
    that they agree with its backend, so one test's choice must not reach the next test."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("NVTE_")}
    yield
    for name in [k for k in os.environ if k.startswith("NVTE_")]:
        del os.environ[name]
    os.environ.update(saved)


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """``uninterrupted(flags, world)``: the JSONL records of ``flags`` trained start to end on
    ``world`` forked ranks (run_helpers.trained_records), trained once per session for each
    distinct (flags, world): resume tests in several files compare with the same straight run
    (tests/test_checkpoint.py, tests/test_scale_async_save.py). Each call gets its own copy."""
    import copy

    from distributed import run_distributed
    from run_helpers import trained_records

    runs = {}

    def records(flags, world):
        key = (tuple(flags), world)
        if key not in runs:
            log = tmp_path_factory.mktemp("uninterrupted") / "run.jsonl"
            runs[key] = run_distributed(trained_records, world,
                                        [*flags, "--log-jsonl", str(log)])[0]
        return copy.deepcopy(runs[key])

    return records


PLAIN_ITERS = 3


@pytest.fixture(scope="session")
def plain_launch(tmp_path_factory):
    """``python pretrain_looplm.py`` as a user starts it without a launcher (no RANK,
    WORLD_SIZE, MASTER_* or SLURM_NTASKS): a tiny run of PLAIN_ITERS iterations with --save and
    --load, timed from this process (launch, and the moment its first JSONL record appears).
    One interpreter start shared by the tests that check what such a run does
    (tests/test_scale_timing.py, tests/test_reliability.py); returns a dict: proc (stdout,
    stderr, returncode), log, launched, seen, iters."""
    import subprocess
    import sys
    import time

    from flags import TEST_FLAGS

    tmp = tmp_path_factory.mktemp("plain_launch")
    log = tmp / "run.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_looplm.py"), *TEST_FLAGS,
           "--num-layers", "2", "--num-loops", "2", "--hidden-size", "32",
           "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
           "--micro-batch-size", "2", "--global-batch-size", "2",
           "--train-iters", str(PLAIN_ITERS), "--lr", "1e-3", "--mock-data",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--log-interval", "1",
           "--eval-iters", "0", "--save", str(tmp / "ckpt"), "--load", str(tmp / "ckpt"),
           "--log-jsonl", str(log)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "SLURM_NTASKS")}
    env["OMP_NUM_THREADS"] = "1"
    launched = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = None
    while proc.poll() is None and seen is None:  # when the first record lands, seen from here
        if log.exists() and log.read_text().endswith("\n"):
            seen = time.time()
        time.sleep(0.01)
    out, err = proc.communicate(timeout=300)
    return {"proc": subprocess.CompletedProcess(cmd, proc.returncode, out, err), "log": log,
            "launched": launched, "seen": seen, "iters": PLAIN_ITERS}
