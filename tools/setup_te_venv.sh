#!/usr/bin/env bash
# Create .venv-te in the repo root (idempotent): a second venv with Transformer Engine 2.11.0 for the
# TE-structure tests (pytest -m te_structure), which build, shard, save and load the looped model
# with the TE layer spec on a CPU machine with no GPU and no NVIDIA driver. No TE kernel runs there.
#
# Pins (one set that works together, none may move on its own):
#   torch==2.14.1                     the CUDA 13.0 build; the binding below is ABI-tied to it
#   transformer-engine-cu13==2.11.0   TE's common library (binary only)
#   transformer-engine==2.11.0        the metapackage (--no-deps: it would pull the binding's sdist)
#   transformer_engine_torch-2.11.0   TE's PyTorch binding. PyPI ships it only as an sdist that
#                                     needs a CUDA toolkit to build, so a wheel prebuilt against
#                                     torch 2.14.1+cu130 is used: $MEGALOOP_TE_TORCH_WHEEL if set,
#                                     else ../shared/te/<wheel> next to the repo root.
#   megatron-core==0.16.1             megaloop's pin (it tests TE >= 2.9, < 2.12)
#
# Exit status: 0 ready; 3 unavailable here (the binding wheel, torch 2.14.1 or TE's binary is not
# reachable, Python is not 3.11, or the disk is short) with one line saying what is missing, so CI
# can skip; 4 the binding wheel's sha256 is wrong; anything else is a real failure.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEEL_NAME=transformer_engine_torch-2.11.0-cp311-cp311-linux_x86_64.whl
WHEEL_SHA256=c976acc6fb7d39d813b85031c946a3c9d947722181699ad67723d7a771dc2e46
NEED_GB=8   # the venv is about 6 GB (torch and the nvidia-* runtime wheels) plus pip's unpacking
UNAVAILABLE=3

unavailable() { echo "setup_te_venv: unavailable: $*" >&2; exit "$UNAVAILABLE"; }

ready() {
  [ -x .venv-te/bin/python ] && .venv-te/bin/python - <<'EOF' 2>/dev/null
import torch, transformer_engine.pytorch, megatron.core, megaloop, pytest, einops, onnxscript
assert torch.__version__.startswith("2.14.1"), torch.__version__
EOF
}
if ready; then
  exit 0
fi

wheel=${MEGALOOP_TE_TORCH_WHEEL:-../shared/te/$WHEEL_NAME}
[ -f "$wheel" ] || unavailable "TE PyTorch binding wheel not found at $wheel (set MEGALOOP_TE_TORCH_WHEEL)"
sha=$(sha256sum "$wheel" | cut -d' ' -f1)
if [ "$sha" != "$WHEEL_SHA256" ]; then
  echo "setup_te_venv: $wheel has sha256 $sha, expected $WHEEL_SHA256" >&2
  exit 4
fi
python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || unavailable "python3 is $(python3 -V 2>&1), the binding wheel is for CPython 3.11"
if [ ! -d .venv-te ]; then
  free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
  [ "$free_kb" -ge $((NEED_GB * 1024 * 1024)) ] \
    || unavailable "$((free_kb / 1024 / 1024)) GB free here, the TE venv needs about $NEED_GB GB"
  python3 -m venv .venv-te
fi
pip=(.venv-te/bin/pip install -q)
# Later installs may not move torch (the binding would fail to load with an undefined symbol).
echo "torch==2.14.1" > .venv-te/constraints.txt

# install WHAT ARGS...: pip install, its output kept unless it fails. A requirement pip cannot
# find (no such file on this machine's disk or index) means "unavailable here"; any other pip
# failure is a real one and keeps its status. (This machine's pip config names local index
# folders that do not all exist; pip warns about each, which says nothing here, so not shown.)
install() {
  local what=$1 log rc=0
  shift
  log=$(mktemp)
  "${pip[@]}" "$@" >"$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    if grep -q -E "No matching distribution found|Could not find a version that satisfies" "$log"; then
      rm -f "$log"
      unavailable "$what is not reachable by pip here"
    fi
    grep -v "^WARNING: Location .* is ignored" "$log" >&2 || true
    rm -f "$log"
    exit "$rc"
  fi
  rm -f "$log"
}

install "torch==2.14.1 (the CUDA 13.0 build)" torch==2.14.1
install "transformer-engine-cu13==2.11.0 (binary)" -c .venv-te/constraints.txt \
  --only-binary :all: transformer-engine-cu13==2.11.0
install "transformer-engine==2.11.0 (binary)" --no-deps --only-binary :all: transformer-engine==2.11.0
install "the TE PyTorch binding wheel" --no-deps "$wheel"
install "the test dependencies" -c .venv-te/constraints.txt onnx onnxscript megatron-core==0.16.1 \
  einops numpy sentencepiece psutil tqdm pytest safetensors transformers
install "megaloop" --no-deps -e .
ready || { echo "setup_te_venv: installed, but the import check failed:" >&2;
           .venv-te/bin/python -c "import torch, transformer_engine.pytorch, megatron.core, megaloop" >&2;
           exit 1; }
