"""Training from an imported Ouro checkpoint, against the independent reference of
tests/ouro_reference.py (written from Ouro's published definition).

A tiny Ouro-layout folder (every key of the released config.json, trained-looking random weights,
a tokenizer.json) is converted by `tools/convert_checkpoint.py import-hf` once; then
pretrain_looplm.py's trainer (--use-checkpoint-args --finetune, the flags a user passes) takes
its first step at TP=1, TP=2 and PP=2. The batch that step trained on is recorded, and its loss
(megaloop's objective sum_t p_t L_t + beta KL(p || uniform), per token), the per-step losses L_t
and the mean exit distribution must equal the reference's on that batch, computed from the
folder's tensors.
"""

import os
import subprocess
import sys

import pytest
import torch

from distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BETA = 0.1
# fp32 on both sides; the trainer's loss is a mean over 32 tokens of 4 steps of 2 layers.
TOL = 2e-5


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    from ouro_reference import make_ouro_folder

    base = tmp_path_factory.mktemp("ouro_training")
    folder = str(base / "ouro")
    weights, cfg = make_ouro_folder(folder, seed=3)
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "import-hf",
         "--hf-dir", folder, "--save", str(base / "ckpt"), "--tensor-model-parallel-size", "2",
         "--no-progress"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return str(base / "ckpt"), weights, cfg


def _first_step(rank, world, argv):
    """The trainer's first step: (its statistics, the batches this rank's stream gave it)."""
    from run_helpers import build_trainer

    trainer = build_trainer(argv)
    seen, stream = [], trainer.train_iter

    def recording():
        for batch in stream:
            seen.append({k: v.detach().cpu().clone() for k, v in batch.items()
                         if torch.is_tensor(v)})
            yield batch

    trainer.train_iter = recording()
    stats, _, ok = trainer.train_step()
    assert ok
    return stats, seen


def _reference(weights, cfg, batches):
    """(mean objective, mean per-step losses [T], mean exit distribution [T]) of the
    reference over the tokens of ``batches`` (one step's micro-batches)."""
    from ouro_reference import exit_pdf, per_step_log_probs

    objective, losses, probs, tokens = 0.0, 0.0, 0.0, 0.0
    for batch in batches:
        ids, labels = batch["tokens"], batch["labels"]
        mask = batch["loss_mask"].float()
        logp = per_step_log_probs(weights, cfg, ids)  # [T, b, s, V]
        ce = -logp.gather(-1, labels.expand(logp.shape[0], *labels.shape).unsqueeze(-1))[..., 0]
        p = exit_pdf(weights, cfg, ids)  # [T, b, s]
        T = p.shape[0]
        per_token = (p * ce).sum(0) + BETA * (p * torch.log(p * T)).sum(0)
        objective += (per_token * mask).sum()
        losses = losses + (ce * mask).sum((1, 2))
        probs = probs + (p * mask).sum((1, 2))
        tokens += mask.sum()
    return (objective / tokens).item(), (losses / tokens).tolist(), (probs / tokens).tolist()


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_first_training_loss_equals_the_reference(imported, tp, pp):
    ckpt, weights, cfg = imported
    argv = ["--use-checkpoint-args", "--load", ckpt, "--finetune",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
            os.path.join(ckpt, "tokenizer"), "--mock-data", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1",
            "--lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--exit-kl-beta", str(BETA), "--num-workers", "0", "--eval-iters", "0",
            "--distributed-backend", "auto", "--transformer-impl", "auto",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    results = run_distributed(_first_step, tp * pp, argv, timeout=240)
    stats = results[0][0]
    # The micro-batches of the step, from a rank whose stream carries labels (the last stage).
    batches = next(seen for _, seen in results if seen and "labels" in seen[0])
    assert len(batches) == 2  # the global batch: two micro-batches of 2
    loss, step_losses, probs = _reference(weights, cfg, batches)
    assert abs(stats["loss"] - loss) <= TOL * abs(loss), (stats["loss"], loss)
    assert max(abs(a - b) for a, b in zip(stats["step_losses"], step_losses)) <= TOL * 10
    assert max(abs(a - b) for a, b in zip(stats["exit_probs"], probs)) <= TOL
    # Every rank reports the same statistics (they are reduced over the pipeline).
    assert all(r[0]["loss"] == stats["loss"] for r in results)


def _per_step(rank, world, source, ids):
    """Full-vocabulary log-probs [T, b, s, V] of megaloop's model read from ``source`` (an
    import-hf checkpoint, or the Ouro folder itself through the generation loader) at TP =
    ``world``: step t's are the last step's of a t-step run (Ouro has no injection, so the
    first t steps of a T-step run are a t-step run)."""
    from megatron.core import tensor_parallel

    from distributed import setup_parallel
    from megaloop.checkpoint.load import load_model
    from megaloop.convert.hf_import import is_looped_config, load_exported, read_hf_config

    setup_parallel(world)
    if os.path.isfile(os.path.join(source, "config.json")):
        assert is_looped_config(read_hf_config(source))
        model = load_exported(source, tp_size=world)[0]
    else:
        model = load_model(source, tp_size=world)[0]
    model.eval()
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    out = []
    with torch.no_grad():
        for t in range(1, model.loop.num_loops + 1):
            logits = model(ids, pos, None, num_loops=t)
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
            out.append(torch.log_softmax(logits.float(), -1))
    return torch.stack(out)


@pytest.mark.parametrize("route", ["checkpoint", "folder"])
def test_per_step_log_probs_equal_the_reference(imported, route):
    """Steps T = 1..4 of the imported model (and of the folder read directly for generation)
    == the reference, at TP=1 and TP=2, fp32: 1e-5 absolute on log-probabilities of a 128-token
    vocabulary (both sides compute in fp32; the orders of the sums differ)."""
    from ouro_reference import per_step_log_probs

    ckpt, weights, cfg = imported
    source = ckpt if route == "checkpoint" else os.path.join(os.path.dirname(ckpt), "ouro")
    ids = torch.tensor([[5, 9, 17, 4, 30, 12, 7, 21], [3, 3, 60, 101, 44, 8, 2, 90]])
    want = per_step_log_probs(weights, cfg, ids)
    for tp in (1, 2):
        got = run_distributed(_per_step, tp, source, ids)[0]
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < 1e-5, (tp, (got - want).abs().amax((1, 2, 3)))
