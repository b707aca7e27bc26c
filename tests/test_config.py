"""Invalid configurations fail with a message naming the flag, before any process group."""

import pytest
import torch

from megaloop.training.run_config import parse_args
from flags import TEST_FLAGS

OK = [*TEST_FLAGS, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
      "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
      "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


def _check(extra, world_size=1):
    parse_args(OK + extra).validate(world_size=world_size)


def test_valid_config_passes():
    _check(["--num-loops", "4", "--global-batch-size", "8"], world_size=2)


def test_valid_pipeline_configs_pass():
    _check(["--pipeline-model-parallel-size", "2", "--num-loops", "4", "--global-batch-size", "4"],
           world_size=2)
    _check(["--pipeline-model-parallel-size", "2", "--num-layers", "3",
            "--decoder-first-pipeline-num-layers", "1", "--recompute-granularity", "full",
            "--recompute-method", "uniform", "--recompute-num-layers", "1"], world_size=2)


@pytest.mark.parametrize("extra,world,match", [
    (["--hidden-size", "90"], 1, "--hidden-size 90 is not divisible by --num-attention-heads 4"),
    (["--tensor-model-parallel-size", "3"], 3, "--num-attention-heads 4 is not divisible by "
                                               "--tensor-model-parallel-size 3"),
    (["--num-loops", "0"], 1, "--num-loops 0 must be >= 1"),
    (["--global-batch-size", "6"], 2, "--global-batch-size 6 is not divisible by "
                                      "--micro-batch-size 2 x data-parallel size 2"),
    (["--num-prelude-layers", "1", "--num-coda-layers", "1"], 1, "leaves no core layer"),
    (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible"),
    (["--num-query-groups", "3"], 1, "--num-query-groups 3"),
    (["--seq-length", "64"], 1, "--seq-length 64 exceeds --max-position-embeddings 32"),
    (["--pipeline-model-parallel-size", "4"], 4, "--pipeline-model-parallel-size 4 exceeds the "
                                                "2 core layers"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "3"], 2,
     "the 3 core layers do not split evenly over --pipeline-model-parallel-size 2"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "3",
      "--decoder-first-pipeline-num-layers", "3"], 2, "leave 0 of the 3 core layers"),
    (["--pipeline-model-parallel-size", "2", "--num-loops", "2", "--global-batch-size", "2"], 2,
     "needs a multiple of --pipeline-model-parallel-size 2"),
    (["--pipeline-model-parallel-size", "2", "--num-loops", "2", "--global-batch-size", "4",
      "--overlap-grad-reduce"], 2, "drop --overlap-grad-reduce"),
    (["--decoder-last-pipeline-num-layers", "1"], 1, "need --pipeline-model-parallel-size > 1"),
    (["--recompute-granularity", "full"], 1, "--recompute-granularity full needs"),
    (["--recompute-method", "block"], 1, "need --recompute-granularity full"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], 1,
     "selective takes no"),
    (["--min-lr", "1", "--lr", "0.1"], 1, "--min-lr"),
    (["--exit-kl-beta", "-1"], 1, "--exit-kl-beta"),
])
def test_invalid_config_names_the_flag(extra, world, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        _check(extra, world)


def test_missing_data_is_reported():
    args = [a for a in OK if a != "--mock-data"]
    with pytest.raises(ValueError, match="--data-path"):
        parse_args(args).validate(world_size=1)


def test_entry_point_exits_2_before_process_group(capsys, monkeypatch):
    import pretrain_looplm

    monkeypatch.setenv("WORLD_SIZE", "1")
    assert pretrain_looplm.main(OK + ["--hidden-size", "90"]) == 2
    assert "--hidden-size 90 is not divisible" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


def test_unknown_choice_rejected_by_parser():
    with pytest.raises(SystemExit):
        parse_args(OK + ["--exit-loss", "bogus"])


def test_help_lists_megatron_flags(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ["--tensor-model-parallel-size", "--num-layers", "--ffn-hidden-size",
                 "--num-query-groups", "--lr-warmup-iters", "--lr-decay-style", "--clip-grad",
                 "--untie-embeddings-and-output-weights", "--tensorboard-dir", "--wandb-project",
                 "--num-loops", "--num-prelude-layers", "--num-coda-layers", "--exit-loss",
                 "--exit-kl-beta", "--exit-loss-smoothing", "--log-jsonl", "--data-path"]:
        assert flag in text, flag


def test_state_passing_variants_validate_with_pipeline():
    """History injection and loop gating run under PP (the carry takes their state round the
    ring; tests/test_pipeline.py proves P = 2 == P = 1), so validation lets them through."""
    from megaloop.training.run_config import parse_args

    base = [*TEST_FLAGS, "--num-layers", "4", "--num-loops", "3",
            "--pipeline-model-parallel-size", "2",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
            "--global-batch-size", "4"]
    for extra in (["--history-injection", "scalar"], ["--timestep-conditioning", "loop-gating"]):
        parse_args(base + extra).validate(world_size=2)


# --- combinations a GPU run would get wrong -----------------------------------------------------
def _gpu_with_te(monkeypatch):
    """What `--transformer-impl auto` sees on a GPU machine with Transformer Engine (the
    resolution asks torch.cuda and imports transformer_engine; nothing else runs on CUDA here)."""
    import sys
    import types

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))


def test_reset_attention_mask_refused_with_transformer_engine(monkeypatch):
    _check(["--reset-attention-mask"])  # CPU: auto is the local spec, which applies the mask
    # Without a GPU every setting is the local spec, Megatron-LM's default included.
    _check(["--reset-attention-mask", "--transformer-impl", "transformer_engine"])
    _gpu_with_te(monkeypatch)
    with pytest.raises(ValueError, match="use --transformer-impl local"):
        _check(["--reset-attention-mask"])  # auto resolves to TE there
    with pytest.raises(ValueError, match="--reset-attention-mask with the Transformer Engine"):
        _check(["--reset-attention-mask", "--transformer-impl", "transformer_engine"])
    _check(["--reset-attention-mask", "--transformer-impl", "local"])
    _check([])


def test_sequence_parallel_refused_with_local_spec(monkeypatch):
    sp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    with pytest.raises(ValueError, match="--sequence-parallel needs the Transformer Engine"):
        _check(sp, world_size=2)
    _check(sp[:2], world_size=2)  # TP without SP is fine on the local spec
    _gpu_with_te(monkeypatch)
    with pytest.raises(ValueError, match="drop --sequence-parallel"):
        _check(sp + ["--transformer-impl", "local"], world_size=2)
    _check(sp, world_size=2)  # auto = TE there


@pytest.mark.parametrize("extra,flags", [
    (["--random-depth-mean", "2"], "--random-depth-mean"),
    (["--truncated-backprop-steps", "1"], "--truncated-backprop-steps"),
    (["--random-depth-mean", "2", "--truncated-backprop-steps", "1", "--lora-rank", "2"],
     "--random-depth-mean and --truncated-backprop-steps"),
])
def test_overlap_grad_reduce_refused_with_varying_loop_count(extra, flags):
    base = ["--num-loops", "3", "--global-batch-size", "4"] + extra
    with pytest.raises(ValueError, match=f"--overlap-grad-reduce with {flags}: .*drop "
                                         f"--overlap-grad-reduce"):
        _check(base + ["--overlap-grad-reduce"], world_size=2)
    _check(base, world_size=2)
    # A fixed loop count runs every core parameter and every LoRA adapter in every step.
    _check(["--num-loops", "3", "--global-batch-size", "4", "--lora-rank", "2",
            "--overlap-grad-reduce"], world_size=2)


def test_per_step_grad_norms_refuse_full_recompute():
    from megaloop.training.run_config import parse_args

    flags = OK + ["--log-grad-norm-per-step", "--recompute-granularity", "full",
                  "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    with pytest.raises(ValueError, match="--log-grad-norm-per-step cannot be used with "
                                         "--recompute-granularity full"):
        parse_args(flags).validate(world_size=1)
    parse_args(OK + ["--log-grad-norm-per-step", "--recompute-granularity",
                     "selective"]).validate(world_size=1)


def test_schedule_resume_flags_contradict():
    from megaloop.training.run_config import parse_args

    with pytest.raises(ValueError, match="contradict each other"):
        parse_args(OK + ["--override-opt_param-scheduler",
                         "--use-checkpoint-opt_param-scheduler"]).validate(world_size=1)
