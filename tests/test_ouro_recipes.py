"""The Ouro recipes end to end at SIZE=cpu (2 ranks, TP=2), on a tiny Ouro-layout folder made
here (tests/ouro_reference.py: every key of the released config.json, a tokenizer.json,
early_exit_threshold 0.6): examples/recipes/ouro_1.4b_sft.sh converts it and trains 2 SFT steps,
examples/recipes/ouro_1.4b_rltt.sh trains 2 RLTT steps from the conversion, and export-hf writes
the RL checkpoint back under Ouro's names. Checked: the runs' exit codes and step lines; the RL
update moved the weights; the export carries the folder's threshold and Ouro's names; plain
`transformers` loads it and its logits equal the independent reference's on the exported tensors;
generate.py decodes the RL checkpoint with the folder's exit rule (announced)."""

import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "examples", "recipes")

# A reward with spread inside a group (the completion's length), so GRPO/RLTT advantages are
# non-zero and the two steps really update the policy.
ENV = '''
import json
from megaloop.rl.environments import Environment, Prompt


class LengthReward(Environment):
    def __init__(self, path, limit=0):
        with open(path) as f:
            self.items = [Prompt(json.loads(line)["text"], "") for line in f if line.strip()]

    def prompts(self):
        return self.items

    def reward(self, prompt, completion):
        return len(completion) / 10.0
'''


def _run(cmd, env, timeout=600):
    out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    return out.stdout + out.stderr


def _texts(folder, n, length, seed):
    """``n`` texts the folder's tokenizer reads: random ids decoded (no special tokens)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    g = torch.Generator().manual_seed(seed)
    size = tok.get_vocab_size(with_added_tokens=False)
    return [tok.decode(torch.randint(3, size, (length,), generator=g).tolist())
            for _ in range(n)]


def run_recipes(sft_recipe, rl_recipe, folder, tmp_path):
    """SFT data in the folder's tokenizer, preprocessed; ``sft_recipe`` (2 steps) then
    ``rl_recipe`` (2 RLTT steps on a length reward) at SIZE=cpu from the folder, converted once
    into tmp_path/imported. Returns the two runs' output; checks their step lines and that the
    RL updates moved the weights (a non-zero gradient)."""
    py = sys.executable
    with open(tmp_path / "sft.jsonl", "w") as f:
        for prompt, response in zip(_texts(folder, 24, 6, 1), _texts(folder, 24, 5, 2)):
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    _run([py, "tools/preprocess_data.py", "--input", str(tmp_path / "sft.jsonl"),
          "--output-prefix", str(tmp_path / "sft"), "--data-format", "sft",
          "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", folder,
          "--workers", "0", "--no-progress"], {})
    env = {"SIZE": "cpu", "PYTHON": py, "IMPORTED": str(tmp_path / "imported")}
    sft = _run(["bash", os.path.join(RECIPES, sft_recipe), folder,
                str(tmp_path / "sft_text_document")],
               {**env, "SAVE_DIR": str(tmp_path / "sft_run")})
    assert " iteration      2/     2 |" in sft, sft[-2000:]
    (tmp_path / "env.py").write_text(ENV)
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for text in _texts(folder, 8, 4, 3):
            f.write(json.dumps({"text": text}) + "\n")
    rl = _run(["bash", os.path.join(RECIPES, rl_recipe), folder,
               str(tmp_path / "prompts.jsonl")],
              {**env, "SAVE_DIR": str(tmp_path / "rl_run"),
               "ENV": f"{tmp_path / 'env.py'}:LengthReward"})
    steps = [line for line in rl.splitlines() if line.startswith(" rl step")]
    assert len(steps) == 2 and "objective rltt" in rl, rl[-2000:]
    assert all("grad norm 0.0000" not in line for line in steps), steps
    return sft, rl


def test_ouro_recipes_end_to_end(tmp_path):
    from safetensors.torch import load_file

    from ouro_reference import exit_pdf, make_ouro_folder, per_step_log_probs

    folder = str(tmp_path / "ouro")
    make_ouro_folder(folder, seed=11, early_exit_threshold=0.6)
    py = sys.executable
    sft, _ = run_recipes("ouro_1.4b_sft.sh", "ouro_1.4b_rltt.sh", folder, tmp_path)
    assert "default exit rule q:0.6" in sft
    assert "--rotary-base 1000000" in sft  # --use-checkpoint-args took Ouro's RoPE base

    out = str(tmp_path / "export")
    _run([py, "tools/convert_checkpoint.py", "export-hf", "--load", str(tmp_path / "rl_run"),
          "--out", out, "--names", "ouro"], {})
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert (cfg["model_type"], cfg["early_exit_threshold"]) == ("ouro", 0.6)
    exported = load_file(os.path.join(out, "model.safetensors"))
    original = load_file(os.path.join(folder, "model.safetensors"))
    assert set(exported) == set(original)  # Ouro's names, every tensor
    assert any(not torch.equal(exported[k].float(), original[k].float()) for k in original)

    # Plain transformers on the export == the reference on the exported tensors: each token
    # read at the first step whose cumulative exit probability reaches 0.6 (Ouro's rule, from
    # config.json), and at the last step with exit_threshold=1.0.
    import io
    import logging

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The configuration class carries the folder's model type: loading names no other type.
    said = io.StringIO()
    handler = logging.StreamHandler(said)
    transformers.logging.get_logger().addHandler(handler)
    try:
        model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True,
                                                     dtype=torch.float32).eval()
        AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    finally:
        transformers.logging.get_logger().removeHandler(handler)
    assert "You are using a model of type" not in said.getvalue(), said.getvalue()
    ids = torch.tensor([[5, 9, 17, 4, 30, 12, 7, 21]])
    weights = {k: v.float() for k, v in exported.items()}
    per_step = per_step_log_probs(weights, cfg, ids)  # [T, 1, s, V]
    cdf = exit_pdf(weights, cfg, ids).cumsum(0)  # [T, 1, s]
    T = cdf.shape[0]
    first = torch.where(cdf[:-1] >= 0.6, torch.arange(T - 1)[:, None, None], T - 1).amin(0)
    want = per_step.gather(0, first[None, ..., None].expand(1, *per_step.shape[1:]))[0]
    with torch.no_grad():
        got = torch.log_softmax(model(ids).logits.float(), -1)
        full = torch.log_softmax(model(ids, exit_threshold=1.0).logits.float(), -1)
    assert (got - want).abs().max().item() < 1e-4
    assert (full - per_step[-1]).abs().max().item() < 1e-4
    assert 0 < (first < T - 1).sum() < first.numel(), first  # the rule really chose steps

    gen = _run([py, "tools/generate.py", "--load", str(tmp_path / "rl_run"), "--prompt-ids",
                "5,9,17", "--max-tokens", "3", "--no-stop-at-eod"], {})
    assert "q:0.6" in gen, gen
