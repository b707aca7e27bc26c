#!/usr/bin/env bash
# Create .venv-mc19 in the repo root (idempotent): megaloop on megatron-core 0.19.x, the release
# line current GPU images ship, next to the main venv's 0.16.1.
#
# megatron-core 0.17 and later declare Requires-Python >= 3.12, so pip on Python 3.11 never offers
# them; their wheels are pure Python apart from the tag, and megaloop's tests pass on them under
# 3.11, so this venv installs one with --ignore-requires-python. On Python 3.12 a plain
# `pip install -e .` takes the newest release the range admits without that flag.
#
# Exit status: 0 ready; 3 unavailable here (megatron-core 0.19.x not reachable on the index) with one
# line saying so, so CI can skip; anything else is a real failure.
set -euo pipefail
cd "$(dirname "$0")/.."

MCORE=${MEGALOOP_MCORE19:-megatron-core==0.19.2}

ready() {
  [ -x .venv-mc19/bin/python ] && .venv-mc19/bin/python - <<'EOF' 2>/dev/null
import megatron.core, torch, megaloop, pytest, transformers
assert megatron.core.__version__.startswith("0.19."), megatron.core.__version__
EOF
}
if ready; then
  exit 0
fi
# A setup interrupted while the venv was being made leaves a folder whose python is missing or
# broken, or that has no pip yet (venv installs pip last): every later install in it fails.
# Such a folder is made again; one whose python and pip run is kept, and the installs below
# (each a no-op once done) complete it.
if [ -e .venv-mc19 ] && ! .venv-mc19/bin/python -m pip --version >/dev/null 2>&1; then
  echo "setup_mc19_venv: .venv-mc19 is incomplete (its python or pip does not run: an" \
    "interrupted setup?); making it again" >&2
  rm -rf .venv-mc19
fi
if [ ! -e .venv-mc19 ]; then
  python3 -m venv .venv-mc19
fi
# pip through the venv's python: its bin/pip script is one more file an interruption can leave out.
pip=(.venv-mc19/bin/python -m pip)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
quiet() {  # pip's output only when it fails
  if ! "$@" >"$log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
    return 1
  fi
}
quiet "${pip[@]}" install -q torch==2.13.0
if ! quiet "${pip[@]}" install -q --ignore-requires-python --no-deps "$MCORE"; then
  echo "setup_mc19_venv: unavailable: pip cannot install $MCORE here" >&2
  exit 3
fi
# megatron-core 0.19 imports triton (its MoE paged-stash kernels, reached from the transformer
# package) without declaring it; packaging is its declared dependency. The rest is megaloop with
# its test extra: the installed 0.19.x satisfies megaloop's range, so pip keeps it.
quiet "${pip[@]}" install -q "packaging>=24.2" triton
quiet "${pip[@]}" install -q -e '.[test]'
ready || { echo "setup_mc19_venv: the venv does not import megatron-core 0.19" >&2; exit 1; }
