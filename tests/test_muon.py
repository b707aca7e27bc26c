"""Muon ("What Makes Recurrence Effective in Looped Language Models?" (arXiv 2609.36636)): the
Newton-Schulz step against an SVD reference, the update through the trainer against a plainly
written Muon step, TP=2 / DP=2 == one rank, and checkpoint resume."""

import os

import pytest
import torch

from distributed import run_distributed
from reference import full_grads, full_params
from test_checkpoint import RESUME, _losses, _records, _train
from test_training import BASE, _compare, _one_step

# The Muon of What Makes Recurrence Effective, spelled out (Megatron-LM's defaults differ:
# momentum 0.9, no Nesterov, `spectral` scale).
MUON = ["--optimizer", "muon", "--weight-decay", "0.1", "--muon-momentum", "0.95",
        "--muon-use-nesterov", "--muon-scale-mode", "rms-match"]

# Scale of the orthogonalised update per mode, written from the formulas (rows, cols).
SCALES = {"rms-match": lambda r, c: 0.2 * max(r, c) ** 0.5,
          "spectral": lambda r, c: max(r, c) ** 0.5,
          "unit_rms_norm": lambda r, c: (r / c) ** 0.5,
          "shape_scaling": lambda r, c: max(1.0, r / c) ** 0.5}


def _quintic_on_singular_values(g, steps):
    """Independent reference: G = U S V^T, so NS(G) = U f(S / ||G||_F) V^T with f the scalar
    quintic applied `steps` times to each singular value."""
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    x = s / torch.linalg.norm(g.double())
    for _ in range(steps):
        x = 3.4445 * x - 4.7750 * x ** 3 + 2.0315 * x ** 5
    return u @ torch.diag(x) @ vh, x


@pytest.mark.parametrize("shape", [(48, 80), (80, 48), (64, 64)])
def test_newton_schulz_matches_svd_reference(shape):
    from megaloop.training.muon import newton_schulz

    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    out = newton_schulz(g, steps=5).double()
    ref, _ = _quintic_on_singular_values(g, 5)
    assert (out - ref).abs().max().item() < 1e-4
    # Against the exact polar factor U V^T: NS keeps the singular vectors (U^T NS(G) V is
    # diagonal) and moves every singular value that is not tiny (s / ||G||_F > 2e-3; 5 steps
    # multiply small ones by ~3.44^5) into a band around 1, about [0.68, 1.13], not onto 1.
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    core = u.T @ out @ vh.T
    diag = torch.diagonal(core)
    assert (core - torch.diag(diag)).abs().max().item() < 1e-4
    big = s / s.norm() > 2e-3
    assert diag[big].min().item() > 0.6 and diag[big].max().item() < 1.25, diag
    assert ((out - u @ vh).norm() / (u @ vh).norm()).item() < 0.35


def _muon_step_vs_reference(rank, world, flags=tuple(MUON), momentum=0.95, nesterov=True,
                            mode="rms-match", extra=1.0):
    """One trainer step with --optimizer muon: every hidden matrix moves by the plainly computed
    Muon step from its (clipped) main_grad; every other parameter moves as AdamW's first step."""
    from megaloop.parallel.initialize import initialize
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer

    cfg = parse_args(BASE + list(flags) + ["--micro-batch-size", "2", "--lr-decay-style",
                                           "constant"])
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    trainer = Trainer(cfg)
    before = full_params(trainer.model)
    _, grad_norm, ok = trainer.train_step()
    assert ok and grad_norm > 0
    grads, after = full_grads(trainer.model), full_params(trainer.model)
    lr, wd = 1e-2, 0.1
    muon_names = []
    for name, g in grads.items():
        w0, w1 = before[name], after[name]
        if w0.dim() == 2 and min(w0.shape) > 1 and "embedding" not in name \
                and "output_layer" not in name:
            muon_names.append(name)
            # Plain Muon: first momentum buf = (1 - beta) g; Nesterov g.lerp(buf, beta), else
            # buf; NS5 (a plain loop here); the mode's scale; decoupled decay.
            buf = (1 - momentum) * g
            upd = g + momentum * (buf - g) if nesterov else buf
            x = upd.T if upd.shape[0] > upd.shape[1] else upd
            x = x / (x.norm() + 1e-7)
            for _ in range(5):
                a = x @ x.T
                x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
            x = x.T if upd.shape[0] > upd.shape[1] else x
            expect = w0 * (1 - lr * wd) - lr * SCALES[mode](*w0.shape) * extra * x
            assert torch.allclose(w1, expect, atol=2e-6), name
        else:  # AdamW's first step: lr * g / (|g| + eps) plus decay where it applies
            step = w0 - w1
            assert step.abs().max().item() <= lr * (1 + wd) + 1e-6, name
    return sorted(muon_names)


@pytest.mark.parametrize("flags,momentum,nesterov,mode,extra", [
    (MUON, 0.95, True, "rms-match", 1.0),
    # Megatron-LM's defaults: momentum 0.9, no Nesterov, spectral scale.
    (["--optimizer", "muon", "--weight-decay", "0.1"], 0.9, False, "spectral", 1.0),
    (["--optimizer", "muon", "--weight-decay", "0.1", "--muon-scale-mode", "unit_rms_norm",
      "--muon-extra-scale-factor", "0.5"], 0.9, False, "unit_rms_norm", 0.5),
    # megaloop's shipped spellings: --muon-nesterov, --muon-ns-steps, `shape`.
    (["--optimizer", "muon", "--weight-decay", "0.1", "--muon-nesterov", "--muon-ns-steps", "5",
      "--muon-scale-mode", "shape"], 0.9, True, "shape_scaling", 1.0),
], ids=["recurrence-effective", "megatron-defaults", "unit-rms-extra", "megaloop-aliases"])
def test_muon_step_through_trainer_matches_plain_reference(flags, momentum, nesterov, mode, extra):
    names = run_distributed(_muon_step_vs_reference, 1, flags, momentum, nesterov, mode,
                            extra)[0]
    # Attention and MLP matrices of the core; not the embedding, head, norms or gate.
    assert any("linear_qkv" in n for n in names) and any("linear_fc2" in n for n in names)
    assert not any("exit_gate" in n or "norm" in n for n in names), names


@pytest.fixture(scope="module")
def muon_single_rank():
    return run_distributed(_one_step, 1, MUON + ["--micro-batch-size", "2"])[0]


def test_muon_tp2_equals_tp1_after_optimizer_steps(muon_single_rank):
    for result in run_distributed(_one_step, 2, MUON + ["--micro-batch-size", "2",
                                                        "--tensor-model-parallel-size", "2"]):
        _compare(muon_single_rank, result)


def test_muon_dp2_equals_dp1_after_optimizer_steps(muon_single_rank):
    for result in run_distributed(_one_step, 2, MUON + ["--micro-batch-size", "1"]):
        _compare(muon_single_rank, result)


def test_muon_rejects_distributed_optimizer():
    from megaloop.training.run_config import parse_args

    cfg = parse_args(BASE + MUON + ["--use-distributed-optimizer"])
    with pytest.raises(ValueError, match="--use-distributed-optimizer"):
        cfg.validate(world_size=2)


def test_muon_resume_reproduces_losses(tmp_path):
    """The momentum buffers are saved and loaded (megatron's sharded optimizer state)."""
    flags = RESUME + MUON
    straight = run_distributed(_train, 1, flags + ["--log-jsonl", str(tmp_path / "a.jsonl")])[0][1]
    ckpt = str(tmp_path / "ckpt")
    first = flags + ["--save", ckpt, "--load", ckpt, "--log-jsonl", str(tmp_path / "b.jsonl")]
    run_distributed(_train, 1, first + ["--exit-interval", "3"])
    run_distributed(_train, 1, first)
    assert os.path.exists(os.path.join(ckpt, "iter_0000006"))
    assert _losses(_records(tmp_path / "b.jsonl")) == _losses(straight)


def test_muon_pp2_equals_pp1_after_optimizer_steps(muon_single_rank):
    for result in run_distributed(_one_step, 2, MUON + ["--micro-batch-size", "2",
                                                        "--pipeline-model-parallel-size", "2"]):
        _compare(muon_single_rank, result)
