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
