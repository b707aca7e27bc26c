"""The command line: `--help` without torch or megatron-core; megatron-core's known noise filtered
once by megaloop.runtime (the 2-rank console itself is checked in test_functional.py)."""

import os
import subprocess
import sys
import warnings

import pytest

from megaloop import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs an entry point's --help in a fresh interpreter and reports which heavy packages it loaded.
_PROBE = """
import runpy, sys
sys.argv = [{script!r}, "--help"]
try:
    runpy.run_path({script!r}, run_name="__main__")
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
loaded = sorted({{name.split(".")[0] for name in sys.modules}} & {{"megatron", "torch", "numpy"}})
print("LOADED:" + ",".join(loaded))
"""


@pytest.mark.parametrize("script", ["pretrain_looplm.py", "tools/convert_checkpoint.py",
                                    "tools/preprocess_data.py", "tools/generate.py",
                                    "tools/evaluate.py", "train_rl.py"])
def test_help_imports_neither_megatron_nor_torch(script):
    path = os.path.join(ROOT, script)
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(script=path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage:" in proc.stdout
    loaded = proc.stdout.rsplit("LOADED:", 1)[1].strip()
    assert loaded == "", f"{script} --help imported {loaded}"
    assert proc.stderr == ""


def test_help_lists_the_loop_flags():
    from megaloop.training.run_config import build_parser

    text = build_parser().format_help()
    for flag in ("--num-loops", "--tensor-model-parallel-size", "--make-vocab-size-divisible-by"):
        assert flag in text


MEGATRON_NOISE = [
    "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
    "Transformer Engine and Apex are not installed. Falling back to local implementations of "
    "multi_tensor_applier and multi_tensor_scale",
    "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
    "When using async grad allreduce it is recommended to set the environment variable "
    "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup",
    "When using sequence parallelism it is recommended to set the environment variable "
    "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup",
]


def _shown(message, category=UserWarning, module=None):
    """Whether `message` gets through after quiet_megatron() on a clean filter list (raised
    from ``module`` when given, else from here)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        runtime._quieted = False
        try:
            runtime.quiet_megatron()
        finally:
            runtime._quieted = True
        if module is None:
            warnings.warn(message, category)
        else:
            warnings.warn_explicit(message, category, f"{module.replace('.', '/')}.py", 66,
                                   module=module, registry={})
    return bool(caught)


@pytest.mark.parametrize("message", MEGATRON_NOISE)
def test_known_megatron_warnings_are_filtered(message):
    assert not _shown(message)


def test_other_warnings_still_show():
    assert _shown("something megaloop should hear about")
    assert _shown("full scope is deprecated", DeprecationWarning)  # the category must match too


def test_non_leaf_grad_warning_is_filtered_only_from_megatron_cores_optimizer():
    """megatron-core's distributed optimizer zeroes the .grad of its parameter-shard views (every
    run with --use-distributed-optimizer): filtered there; from any other module it still shows."""
    message = ("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. Its "
               ".grad attribute won't be populated during autograd.backward().")

    assert not _shown(message, module="megatron.core.optimizer.optimizer")
    assert _shown(message, module="megaloop.training.trainer")


def test_mock_dataset_cache_record_is_dropped(caplog):
    import logging

    runtime.quiet_megatron()
    caplog.set_level(logging.WARNING)
    log = logging.getLogger("megatron.core.datasets.gpt_dataset")
    log.warning("Unable to save MockGPTDataset indexes because path_to_cache is None")
    log.warning("another GPTDataset message")
    assert [r.getMessage() for r in caplog.records] == ["another GPTDataset message"]


def test_rank_zero_before_the_process_group(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    assert not runtime.is_rank_zero()
    runtime.print_rank_0("banner")
    monkeypatch.setenv("RANK", "0")
    assert runtime.is_rank_zero()
    runtime.print_rank_0("banner")
    assert capsys.readouterr().out == "banner\n"


def test_vocab_padding_help_says_what_the_code_does():
    from megaloop.model.config import padded_vocab_size
    from megaloop.training.run_config import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "only where the tensor-parallel size does not divide that" in text
    # 1100 tokens, divisible-by 128 -> 1152 at TP 1, 2 and 3 (Megatron-LM: 1280 at TP 2);
    # TP 5 does not divide 1152, so the multiple becomes 128 x 5.
    assert [padded_vocab_size(1100, 128, tp) for tp in (1, 2, 3, 5)] == [1152, 1152, 1152, 1280]


def _tool(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"tool_{name}", os.path.join(ROOT, "megaloop", "cli", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flags(parser, group_title):
    return {s for g in parser._action_groups if g.title == group_title
            for a in g._group_actions for s in a.option_strings}


@pytest.mark.parametrize("tool, need", [("generate", ["--load", "ckpt", "--prompt-ids", "1"]),
                                        ("evaluate", ["--load", "ckpt", "--output-dir", "out"])])
def test_tools_take_the_trainers_tokenizer_flags(tool, need):
    """A tool flag the trainer also has accepts exactly the trainer's values (and spellings):
    the tokenizer flags of generate.py and evaluate.py (for a folder without its own)."""
    from megaloop.training.run_config import build_parser

    trainer = build_parser()
    parser = _tool(tool).build_parser()
    tokenizer_flags = _flags(trainer, "TokenizerConfig")
    assert tokenizer_flags and tokenizer_flags <= set(parser._option_string_actions)
    kind = next(a for a in trainer._actions if a.dest == "tokenizer_type")
    spellings = list(kind.choices) + ["GPTSentencePieceTokenizer"]  # Megatron-LM's name
    for name in spellings:
        ours, _ = trainer.parse_known_args(["--tokenizer-type", name])
        theirs = parser.parse_args(need + ["--tokenizer-type", name])
        assert theirs.tokenizer_type == ours.tokenizer_type, name
    assert parser.parse_args(need).tokenizer_type is None  # not given: the folder's own
    with pytest.raises(SystemExit):
        parser.parse_args(need + ["--tokenizer-type", "NoSuchTokenizer"])


def test_plot_run_takes_the_trainers_collapse_threshold():
    from megaloop.training.run_config import build_parser

    trainer = build_parser()

    plot = _tool("plot_run").build_parser()
    assert plot.parse_args(["run.jsonl"]).p0_collapse_threshold == \
        trainer.parse_known_args([])[0].p0_collapse_threshold
    assert plot.parse_args(["run.jsonl", "--p0-collapse-threshold", "0.8"]) \
        .p0_collapse_threshold == 0.8
