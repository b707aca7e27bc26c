# megaloop GPU image.
#
#   docker build -t megaloop .
#   docker run --gpus all --ipc=host --rm megaloop            # prints pretrain_looplm.py --help
#
# The NGC PyTorch image carries CUDA, NCCL and Transformer Engine built against its own torch;
# megaloop's `--transformer-impl auto` then picks Transformer Engine on the GPU. That is all the
# `gpu` extra of setup.py asks for (transformer-engine[pytorch]); the pip line below installs
# setup.py's install_requires that the base lacks, at setup.py's pins (tests/test_dockerfile.py
# checks both, and that every file COPY names exists).
#
# apex: not installed and not needed. megatron-core takes its fused Adam and multi-tensor
# kernels from Transformer Engine first (apex is only its fallback), the TE layer spec's norms
# are TE's, and megaloop's local spec builds its norms through megatron-core's WrappedTorchNorm
# (megaloop.model.specs.norm_spec), never apex's FusedLayerNorm. Whatever the base image ships
# is left as it is.
#
# Base image: NGC PyTorch 26.06, the base megatron-core 0.19.0's own CI image builds on (its
# docker/.ngc_version.dev). Its Python is 3.12, so pip takes the newest megatron-core that setup.py's
# range admits (0.19.x). Its torch satisfies megatron-core's torch>=2.6.0, so pip keeps the
# image's CUDA-matched build. Transformer Engine comes from the image: megatron-core 0.19 declares
# no TE range (its CI runs the image's TE), so the build checks TE >= 2.9 and that megatron-core's
# TE extension imports with it; on a base where pip takes megatron-core 0.16.1 (Python 3.11, e.g.
# 25.11), the build checks 0.16.1's tested range >= 2.9.0a0, < 2.12.0 instead. The build fails if
# the image's torch is replaced or its TE is outside the range. Override with
# --build-arg BASE_IMAGE=... (keep both conditions).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.06-py3
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Dependencies first, in their own layer, so editing the repo does not reinstall them.
# NGC pins its whole Python environment through PIP_CONSTRAINT, which can make megatron-core's
# own pins unsatisfiable (megatron-core's install guide clears it); it is cleared for this one
# command only, and the build fails if pip nevertheless swapped out the image's torch build.
# Besides install_requires: the `log` extra, and the `hf` and `serve` extras, so that the image
# also converts and exports Hugging Face folders and runs tools/serve.py on the GPU node.
RUN TORCH_BEFORE="$(python -c 'import torch; print(torch.__version__)')" && \
    PIP_CONSTRAINT= pip install "megatron-core>=0.16.1,<0.20" einops sentencepiece psutil tqdm \
        tensorboard wandb tokenizers transformers safetensors protobuf fastapi uvicorn jinja2 && \
    TORCH_AFTER="$(python -c 'import torch; print(torch.__version__)')" && \
    if [ "$TORCH_BEFORE" != "$TORCH_AFTER" ]; then \
        echo "pip replaced torch $TORCH_BEFORE with $TORCH_AFTER; use another BASE_IMAGE" >&2; \
        exit 1; \
    fi

# Transformer Engine comes from the base image (megaloop's `gpu` path); check it is a version
# the installed megatron-core was tested with before anything else is built on it.
RUN python -c "import transformer_engine as te, importlib.metadata as m; \
from packaging.version import Version as V; \
mc = V(m.version('megatron-core')); v = V(te.__version__.split('+')[0]); \
ok = V('2.9.0a0') <= v < V('2.12.0') if mc < V('0.17') else V('2.9.0a0') <= v; \
import megatron.core.extensions.transformer_engine; \
print('megatron-core', mc, 'transformer_engine', te.__version__, \
'ok' if ok else 'outside the range megatron-core was tested with'); \
raise SystemExit(0 if ok else 1)"

WORKDIR /workspace/megaloop
COPY . .
# --no-deps: everything megaloop needs is installed above; letting pip resolve setup.py's
# requirements again could touch torch. Editable, so a checkout mounted over this folder (the
# SLURM example's pyxis mounts) is what runs, without rebuilding the image.
RUN pip install --no-deps -e .

CMD ["python", "pretrain_looplm.py", "--help"]
