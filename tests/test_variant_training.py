"""The design-space variants through the real trainer: one optimizer step under TP=2, a
checkpoint written at TP=2 and loaded at TP=1 (the new parameters included) gives the same
logits, next loss and weights."""

import pytest
import torch

from distributed import run_distributed
from test_checkpoint import RESHARD, TP2, _save_or_load

VARIANTS = {
    "post+frms+channel-wise+history-dense": [
        "--norm-scheme", "post", "--step-norm", "frms", "--input-injection", "channel-wise",
        "--history-injection", "dense"],
    "magic+identity+concat-linear+loop-gating": [
        "--norm-scheme", "magic", "--step-norm", "identity", "--input-injection",
        "concat-linear", "--timestep-conditioning", "loop-gating"],
    "sandwich+dense+adaln": [
        "--norm-scheme", "sandwich", "--input-injection", "dense", "--timestep-conditioning",
        "adaln", "--history-injection", "channel-wise"],
    "ouro+residual-channel-wise+branch-gating": [
        "--input-injection", "residual-channel-wise", "--timestep-conditioning",
        "branch-gating", "--history-injection", "scalar"],
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_trains_at_tp2_and_reshards_to_tp1(tmp_path, name):
    ckpt = str(tmp_path / "ckpt")
    flags = RESHARD + VARIANTS[name]
    saved = run_distributed(_save_or_load, 2, flags + TP2, ckpt, True)[0]
    loaded = run_distributed(_save_or_load, 1, flags, ckpt, False)[0]
    assert torch.isfinite(torch.tensor(saved[1]))
    assert torch.allclose(saved[0], loaded[0], atol=1e-5, rtol=0)  # logits
    assert abs(saved[1] - loaded[1]) < 1e-5  # the next step's loss
    new = [k for k in saved[2] if "injection" in k or "timestep" in k]
    assert new, sorted(saved[2])
    for k in saved[2]:
        assert torch.allclose(saved[2][k], loaded[2][k], atol=1e-5, rtol=1e-4), k
