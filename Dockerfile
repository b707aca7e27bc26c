# megaloop GPU image.
#
#   docker build -t megaloop .
#   docker run --gpus all --ipc=host --rm megaloop            # prints pretrain_looplm.py --help
#
# The NGC PyTorch image carries CUDA, NCCL, Transformer Engine and apex built against its own
# torch; megaloop's `--transformer-impl auto` then picks Transformer Engine on the GPU.
#
# Base image: megatron-core 0.16.1 requires torch>=2.6.0. NGC 25.01 ships torch 2.6.0a0+<sha>,
# a *pre-release* that does not satisfy that pin, so pip would replace the image's CUDA-matched
# torch with a PyPI wheel. 25.04 (the image megatron-core's install guide uses) ships 2.7.0a0,
# which does. Override with --build-arg BASE_IMAGE=... (keep torch >= 2.6.0 final or 2.7 pre).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.04-py3
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Dependencies first, in their own layer, so editing the repo does not reinstall them.
# NGC pins its whole Python environment through PIP_CONSTRAINT, which can make megatron-core's
# own pins unsatisfiable (megatron-core's install guide clears it); it is cleared for this one
# command only, and the build fails if pip nevertheless swapped out the image's torch build.
RUN TORCH_BEFORE="$(python -c 'import torch; print(torch.__version__)')" && \
    PIP_CONSTRAINT= pip install megatron-core==0.16.1 einops sentencepiece psutil tensorboard \
        wandb tokenizers && \
    TORCH_AFTER="$(python -c 'import torch; print(torch.__version__)')" && \
    if [ "$TORCH_BEFORE" != "$TORCH_AFTER" ]; then \
        echo "pip replaced torch $TORCH_BEFORE with $TORCH_AFTER; use another BASE_IMAGE" >&2; \
        exit 1; \
    fi

WORKDIR /workspace/megaloop
COPY . .
# --no-deps: everything megaloop needs is installed above; letting pip resolve setup.py's
# requirements again could touch torch. Editable, so a checkout mounted over this folder (the
# SLURM example's pyxis mounts) is what runs, without rebuilding the image.
RUN pip install --no-deps -e .

CMD ["python", "pretrain_looplm.py", "--help"]
