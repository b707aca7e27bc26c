"""The Huginn recipes end to end at SIZE=cpu (2 ranks, TP=2), on a tiny Huginn-layout folder
(tests/huginn_reference.py: every key of the released config.json, a tokenizer.json):
examples/recipes/huginn_0125_sft.sh converts it and trains 2 SFT steps with Huginn's sampled
recurrence, examples/recipes/huginn_0125_rltt.sh trains 2 RLTT steps from the conversion
(uniform weights over the steps: no exit gate), and export-hf writes the RL checkpoint back in
Huginn's layout. Checked: the runs' exit codes and step lines; the SFT run drew its loop counts
(random depth) and trained the last steps only; the RL update moved the weights; the export holds
Huginn's names and config.json, and its log-probabilities are the independent reference's on
the exported tensors."""

import json
import os
import sys

import torch

from distributed import run_distributed
from test_huginn import _per_step
from test_ouro_recipes import _run, run_recipes


def test_huginn_recipes_end_to_end(tmp_path):
    from safetensors.torch import load_file

    from huginn_reference import make_huginn_folder, per_step_log_probs

    folder = str(tmp_path / "huginn")
    make_huginn_folder(folder, seed=12)
    py = sys.executable
    sft, _ = run_recipes("huginn_0125_sft.sh", "huginn_0125_rltt.sh", folder, tmp_path)
    assert "--exit-loss last" in sft and "--state-init noise" in sft, sft[-3000:]
    assert sft.count(" | depth ") == 2, sft[-3000:]  # each step drew its loop count

    out = str(tmp_path / "export")
    _run([py, "tools/convert_checkpoint.py", "export-hf", "--load", str(tmp_path / "rl_run"),
          "--output-dir", out], {})
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert (cfg["architectures"], cfg["mean_recurrence"]) == (["RavenForCausalLM"], 3)
    exported = load_file(os.path.join(out, "model.safetensors"))
    original = load_file(os.path.join(folder, "model.safetensors"))
    assert set(exported) == set(original)
    assert any(not torch.equal(exported[k], original[k]) for k in original)
    ids = torch.tensor([[5, 9, 17, 4, 30, 12, 7, 21]])
    want = per_step_log_probs({k: v.float() for k, v in exported.items()}, cfg, ids)
    got = run_distributed(_per_step, 1, out, ids)[0][1]
    assert (got - want).abs().max().item() < 1e-5
