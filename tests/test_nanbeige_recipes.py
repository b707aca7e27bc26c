"""The Nanbeige recipes end to end at SIZE=cpu (2 ranks, TP=2), on a tiny Nanbeige-layout folder
(tests/nanbeige_reference.py: every key of the released config.json, a tokenizer.json):
examples/recipes/nanbeige4.2_3b_sft.sh converts it and trains 2 SFT steps,
examples/recipes/nanbeige4.2_3b_rltt.sh trains 2 RLTT steps from the conversion (uniform weights
over the 2 passes: no exit gate), and export-hf writes the RL checkpoint back in Nanbeige's
layout. Checked: the runs' exit codes and step lines; the RL update moved the weights; the export
holds Nanbeige's names and config.json, and its log-probabilities are the independent
reference's on the exported tensors."""

import json
import os
import sys

import torch

from distributed import run_distributed
from test_ouro_recipes import _run, run_recipes
from test_ouro_training import _per_step


def test_nanbeige_recipes_end_to_end(tmp_path):
    from safetensors.torch import load_file

    from nanbeige_reference import log_probs, make_nanbeige_folder

    folder = str(tmp_path / "nanbeige")
    make_nanbeige_folder(folder, seed=12)
    py = sys.executable
    sft, _ = run_recipes("nanbeige4.2_3b_sft.sh", "nanbeige4.2_3b_rltt.sh", folder, tmp_path)
    # the checkpoint's flags: no exit gate, the last pass's loss only (the default recurrent
    # step norm is not printed)
    assert "--exit-loss last" in sft and "--norm-scheme pre" in sft, sft[-3000:]

    out = str(tmp_path / "export")
    _run([py, "tools/convert_checkpoint.py", "export-hf", "--load", str(tmp_path / "rl_run"),
          "--output-dir", out], {})
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert (cfg["architectures"], cfg["num_loops"]) == (["NanbeigeForCausalLM"], 2)
    exported = load_file(os.path.join(out, "model.safetensors"))
    original = load_file(os.path.join(folder, "model.safetensors"))
    assert set(exported) == set(original)
    assert any(not torch.equal(exported[k], original[k]) for k in original)
    ids = torch.tensor([[5, 9, 17, 4, 30, 12, 7, 21]])
    want = log_probs({k: v.float() for k, v in exported.items()}, cfg, ids)
    got = run_distributed(_per_step, 1, out, ids)[0][-1]
    assert (got - want).abs().max().item() < 1e-5
