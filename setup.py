"""megaloop: train looped language models on megatron-core."""

from setuptools import find_packages, setup

setup(
    name="megaloop",
    version="0.1.0",
    description="Megatron-core trainer for looped (recurrent-depth) language models",
    packages=find_packages(include=["megaloop", "megaloop.*"]),
    py_modules=["pretrain_looplm"],
    # `megaloop <command>`: the tools under one name (megaloop/cli/main.py lists them).
    entry_points={"console_scripts": ["megaloop=megaloop.cli.main:main"]},
    python_requires=">=3.10",
    install_requires=[
        # 0.16.1 (the last release for Python 3.11, which pip takes there) through 0.19.x (Python
        # 3.12, current GPU images); both are tested (tools/setup_mc19_venv.sh).
        "megatron-core>=0.16.1,<0.20",
        "torch>=2.6",
        "einops",
        "numpy",
        "sentencepiece",
        # dist_checkpointing's writer needs psutil but megatron-core does not declare it.
        "psutil",
        "tqdm",
    ],
    extras_require={
        # GPU only: never install on a CPU machine (a broken TE makes `import megatron.core` fail).
        "gpu": ["transformer-engine[pytorch]"],
        # protobuf: export-hf converts a sentencepiece model to tokenizer.json (transformers reads
        # the model's protobuf).
        "hf": ["transformers", "safetensors", "tokenizers", "protobuf"],
        # --tensorboard-dir (tools/setup_venv.sh installs it: examples/slurm's default) and
        # --wandb-project (wandb is large, with a service binary: only on request).
        "tensorboard": ["tensorboard"],
        "log": ["tensorboard", "wandb"],
        # Plots (tools/evaluate.py, tools/plot_run.py, tools/attention_probes.py) and
        # lm-evaluation-harness (tools/run_lm_eval.py; the adapter follows its 0.4 model API).
        "eval": ["matplotlib", "lm-eval[api]>=0.4.13,<0.5"],
        # tools/serve.py's OpenAI-compatible HTTP server (jinja2: tokenizers' chat templates).
        "serve": ["fastapi", "uvicorn", "jinja2"],
        # (httpx and openai: tests/test_serve*.py's HTTP clients; the eval extra:
        # tests/test_evaluate.py)
        "test": ["pytest", "tokenizers", "transformers", "safetensors", "protobuf", "fastapi",
                 "uvicorn", "jinja2", "httpx", "openai", "matplotlib",
                 "lm-eval[api]>=0.4.13,<0.5"],
    },
)
