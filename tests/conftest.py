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

import pytest  # noqa: E402


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
