"""Context parallelism (--context-parallel-size): CP = 2 trains exactly like CP = 1 on CPU.

megatron-core runs CP attention only in Transformer Engine (its local attention asserts
``context_parallel_size == 1``), so on CPU the equivalence runs a model whose layers have *no
attention*: the layer spec's input norm, self-attention and its bias-dropout-add are megatron-core's
IdentityOp / IdentityFuncOp (a test-only spec, swapped in inside the forked ranks; validation lets
CP through without TE only under pytest with ``MEGALOOP_TEST_CP_WITHOUT_ATTENTION=1``). Everything
else in such a model (embedding with its positions, MLPs, norms, injection, step norm, exit
gate, head, per-step cross-entropy, the exit objective) is position-wise, so a CP rank holding
two chunks of every sequence must compute exactly the per-token values CP = 1 computes there.
The runs go through the real trainer: megatron-core's load-balanced split of every batch (train
and evaluation), ``calculate_per_token_loss`` with ``finalize_model_grads`` (token counts summed
over data x context-parallel ranks), megatron-core DDP reducing over the same group, and the
statistics of ``reduce_stats``. The attention path (TE's CP ring, reused at every loop step) is
GPU-only: tests/test_gpu.py.
"""

import dataclasses
import os

import pytest
import torch

from distributed import run_distributed
from test_training import BASE, _compare
from flags import TEST_FLAGS

MB1, MB2 = ["--micro-batch-size", "1"], ["--micro-batch-size", "2"]
CP2 = ["--context-parallel-size", "2"]
SEQ = 32  # BASE's --seq-length


def _without_attention() -> None:
    """TEST ONLY: every layer spec the model builds loses its attention (see module docstring),
    and validation admits CP without Transformer Engine. Called inside a forked rank."""
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

    from megaloop.model import looped_gpt
    from megaloop.training.run_config import CP_TEST_ROUTE_ENV

    os.environ[CP_TEST_ROUTE_ENV] = "1"
    original = looped_gpt.layer_spec

    def spec(*args, **kwargs):
        s = original(*args, **kwargs)
        return dataclasses.replace(s, submodules=dataclasses.replace(
            s.submodules, input_layernorm=IdentityOp, self_attention=IdentityOp,
            self_attn_bda=IdentityFuncOp))

    looped_gpt.layer_spec = spec


def _chunk_positions(seq: int, cp: int, rank: int) -> list:
    """megatron-core's load-balanced layout: 2 x CP chunks, rank r keeps chunks r and
    2 x CP - 1 - r (written out here independently of megatron-core)."""
    c = seq // (2 * cp)
    return list(range(rank * c, (rank + 1) * c)) + \
        list(range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c))


def _cp_step(rank, world, extra, check_placement=False):
    """The trainer's step on the attention-free model (tests/test_training.py's ``_one_step``,
    plus what only CP has: the batch each rank sees, the rotary table, an evaluation).
    ``check_placement``: under the CPU shim's placement check (megaloop/cpu_shim.py)."""
    _without_attention()
    if check_placement and not torch.cuda.is_available():
        from megaloop import cpu_shim

        cpu_shim.enable_placement_check()
    from megatron.core import parallel_state

    from megaloop.model import recurrence
    from megaloop.parallel.initialize import initialize
    from megaloop.training.checkpointing import unwrap
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer
    from reference import full_grads, full_params

    cfg = parse_args(BASE + ["--eval-iters", "1"] + extra)
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    trainer = Trainer(cfg)
    cp = cfg.parallel.context_parallel_size
    assert parallel_state.get_context_parallel_world_size() == cp
    model = unwrap(trainer.model)
    assert model.config.context_parallel_size == cp
    stats, grad_norm, ok = trainer.train_step()
    assert ok
    grads = full_grads(trainer.model)
    params = full_params(trainer.model)
    second, _, _ = trainer.train_step()
    evaluation = trainer.evaluate()

    # The batches the model reads: this CP rank's two chunks of every sequence, all keys aligned
    # (mock samples have positions 0..seq-1), and the rotary table cut the same way.
    batch = next(trainer.train_iter)
    positions = _chunk_positions(SEQ, cp, parallel_state.get_context_parallel_rank())
    assert batch["tokens"].shape == (cfg.training.micro_batch_size, SEQ // cp)
    assert all(batch[k].shape == batch["tokens"].shape
               for k in ("labels", "loss_mask", "position_ids"))
    assert batch["position_ids"].tolist() == [positions] * cfg.training.micro_batch_size
    if model.pre_process and model.position_embedding_type == "rope":
        ctx = recurrence.context(model, batch["tokens"])
        full = model.rotary_pos_emb.get_emb(SEQ)  # [seq, 1, 1, d]: every position, no CP cut
        assert torch.equal(ctx.rotary_pos_emb, full[positions])
    return stats, float(grad_norm), grads, params, second["loss"], evaluation


def _check(ref, result):
    *train_ref, eval_ref = ref
    *train, evaluation = result
    # Every token counted once: the sums over CP ranks are the sums over whole sequences.
    assert train[0]["tokens"] == train_ref[0]["tokens"]
    _compare(tuple(train_ref), tuple(train))
    assert evaluation["tokens"] == eval_ref["tokens"]
    assert abs(evaluation["loss"] - eval_ref["loss"]) < 2e-5
    for key in ("step_losses", "exit_probs"):
        for a, b in zip(evaluation[key], eval_ref[key], strict=True):
            assert abs(a - b) < 2e-5, key


@pytest.fixture(scope="module")
def cp1():
    return run_distributed(_cp_step, 1, MB2)[0]


def test_cp2_equals_cp1(cp1):
    for result in run_distributed(_cp_step, 2, MB2 + CP2):
        _check(cp1, result)


def test_cp2_dp2_equals_cp1(cp1):
    """4 ranks: CP groups {0, 1} and {2, 3}; gradients and token counts reduced over all four.
    Under the placement check: the split batch, the rotary slice and every collective stay on
    the accelerator."""
    for result in run_distributed(_cp_step, 4, MB1 + CP2, True, timeout=240):
        _check(cp1, result)


def test_pp2_cp2_equals_cp1(cp1):
    """The loop's carry under PP x CP: this rank's part of each sequence, per-token fp32
    accumulators included, travels the pipeline ring (3 loop steps = 3 virtual chunks)."""
    for result in run_distributed(_cp_step, 4, MB2 + CP2 + ["--pipeline-model-parallel-size",
                                                            "2"], timeout=240):
        _check(cp1, result)


def test_cp2_learned_positions_equal_cp1():
    """Learned absolute positions read the split position ids: chunks and positions align."""
    extra = ["--position-embedding-type", "learned_absolute"]
    ref = run_distributed(_cp_step, 1, MB2 + extra)[0]
    for result in run_distributed(_cp_step, 2, MB2 + CP2 + extra):
        _check(ref, result)


# --- the batch split alone ----------------------------------------------------------------
def _split(rank, world, seq):
    from megatron.core import parallel_state

    from megaloop.data.datasets import on_this_context_parallel_rank
    from megaloop.parallel.config import ParallelConfig
    from megaloop.parallel.initialize import initialize

    initialize(ParallelConfig(context_parallel_size=world), seed=1)
    b = 3
    ids = torch.arange(b * seq).view(b, seq)
    batch = {"tokens": ids, "labels": ids + 1000, "loss_mask": (ids % 3 != 0).float(),
             "position_ids": torch.arange(seq).expand(b, seq).contiguous()}
    mine = on_this_context_parallel_rank(dict(batch))
    positions = _chunk_positions(seq, world, parallel_state.get_context_parallel_rank())
    for k, v in batch.items():
        assert torch.equal(mine[k], v[:, positions]), k
        assert mine[k].dtype == v.dtype
    return positions


@pytest.mark.parametrize("cp", [2, 4])
def test_batch_split_is_megatron_core_load_balanced_layout(cp):
    seq = 8 * cp
    parts = run_distributed(_split, cp, seq)
    # Together the ranks hold every position once; rank r holds chunks r and 2 CP - 1 - r.
    assert sorted(p for part in parts for p in part) == list(range(seq))
    c = seq // (2 * cp)
    for r, part in enumerate(parts):
        assert part[0] == r * c and part[c] == (2 * cp - 1 - r) * c


def _no_split_without_cp(rank, world):
    from megaloop.data.datasets import on_this_context_parallel_rank
    from megaloop.parallel.config import ParallelConfig
    from megaloop.parallel.initialize import initialize

    batch = {"tokens": torch.arange(8).view(1, 8)}
    assert on_this_context_parallel_rank(batch) is batch  # no megatron-core groups yet
    initialize(ParallelConfig(), seed=1)  # CP = 1: DP = 2
    assert on_this_context_parallel_rank(batch) is batch
    return True


def test_no_split_without_context_parallelism():
    run_distributed(_no_split_without_cp, 2)


# --- validation (no process group) --------------------------------------------------------
OK = [*TEST_FLAGS, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
      "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
      "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
      "--context-parallel-size", "2"]


def _validate(extra, world=2):
    from megaloop.training.run_config import parse_args

    parse_args(OK + extra).validate(world_size=world)


def test_cp_without_transformer_engine_is_refused(monkeypatch):
    from megaloop.training.run_config import CP_TEST_ROUTE_ENV

    monkeypatch.delenv(CP_TEST_ROUTE_ENV, raising=False)
    for impl in (["--transformer-impl", "local"], []):  # auto resolves to local without a GPU
        with pytest.raises(ValueError, match="--context-parallel-size 2 needs the Transformer "
                                             "Engine layer spec"):
            _validate(impl)
    # The test route opens only inside pytest.
    monkeypatch.setenv(CP_TEST_ROUTE_ENV, "1")
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    with pytest.raises(ValueError, match="needs the Transformer Engine layer spec"):
        _validate([])


@pytest.mark.parametrize("extra,world,match", [
    ([], 3, "world size 3 is not divisible by --tensor-model-parallel-size 1 x "
            "--context-parallel-size 2 x --pipeline-model-parallel-size 1"),
    (["--tensor-model-parallel-size", "2"], 2, "launch a multiple of 4 processes"),
    (["--seq-length", "30"], 2,
     "--seq-length 30 is not divisible by 2 x --context-parallel-size 2"),
    (["--context-parallel-size", "4", "--seq-length", "20"], 4, "multiple of 8"),
    (["--reset-attention-mask"], 2, "--reset-attention-mask with --context-parallel-size 2"),
    (["--num-loops", "2", "--loop-resolutions", "1,1/2", "--loop-topology", "anchor"], 2,
     "--loop-resolutions with a coarse step .* and --context-parallel-size 2"),
    (["--context-parallel-size", "0"], 1, "--context-parallel-size .* must be >= 1"),
    # CP ranks share their samples: the data-parallel size excludes them.
    (["--global-batch-size", "2"], 4, "--global-batch-size 2 is not divisible by "
                                      "--micro-batch-size 2 x data-parallel size 2"),
])
def test_invalid_cp_config_names_the_flag(monkeypatch, extra, world, match):
    from megaloop.training.run_config import CP_TEST_ROUTE_ENV

    monkeypatch.setenv(CP_TEST_ROUTE_ENV, "1")  # past the TE check, to the rules behind it
    with pytest.raises(ValueError, match=match):
        _validate(extra, world)


def test_cp_with_te_unfused_attention_is_refused(monkeypatch):
    from megaloop.model.config import ModelConfig

    if not hasattr(ModelConfig, "attention_backend"):
        pytest.skip("no --attention-backend flag in this tree")
    # TE resolved as on a GPU machine (validation only; nothing is built).
    monkeypatch.setattr("megaloop.model.config.use_transformer_engine", lambda model: True)
    _validate(["--bf16"])  # TE + CP passes (TE's CP attention needs 16-bit inputs)
    for backend in ("unfused", "local"):
        with pytest.raises(ValueError, match=f"--attention-backend {backend}: TE runs "
                                             "context-parallel attention only"):
            _validate(["--bf16", "--attention-backend", backend])


def test_valid_cp_config_passes(monkeypatch):
    from megaloop.training.run_config import CP_TEST_ROUTE_ENV

    monkeypatch.setenv(CP_TEST_ROUTE_ENV, "1")
    _validate(["--global-batch-size", "4"], world=4)  # CP 2 x DP 2
    _validate(["--pipeline-model-parallel-size", "2", "--num-loops", "2",
               "--global-batch-size", "4"], world=4)


def test_context_parallel_flag_in_help():
    from megaloop.training.run_config import build_parser

    assert "--context-parallel-size" in build_parser().format_help()
