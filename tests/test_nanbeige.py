"""Nanbeige4.2 folders in and out (megaloop/convert/hf_nanbeige.py), against the independent
reference of tests/nanbeige_reference.py (written from Nanbeige's published definition).

A tiny folder with every key of the released config.json is imported once with
`tools/convert_checkpoint.py import-hf`; then: the log-probabilities after 1 and 2 passes equal
the reference's at TP=1 and TP=2 (from the checkpoint and from the folder read directly), with
the norm between passes and without it (skip_loop_final_norm), and a seeded bug (the norm in the
other place) is caught at once; greedy generation is the reference's; the trainer's first step
from the checkpoint has the reference's loss at (TP, PP) = (1, 1), (2, 1), (1, 2); the export
gives the folder's tensors back bit for bit under Nanbeige's config.json; every key of the
released config.json has a role, and each feature megaloop does not compute is refused by name;
the real model's shapes and parameter count follow from its config.json.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from distributed import run_distributed
from nanbeige_reference import (greedy, log_probs, make_nanbeige_folder, nanbeige_config,
                                random_weights)
from test_ouro_training import _first_step, _per_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONVERT = os.path.join(ROOT, "tools", "convert_checkpoint.py")
# fp32 on both sides; 1e-5 absolute on log-probabilities of a 128-token vocabulary (the orders
# of the sums differ: fused q/k/v, megatron-core's attention), as tests/test_ouro_training.py.
TOL = 1e-5
IDS = torch.tensor([[5, 9, 17, 4, 30, 12, 7, 21], [3, 3, 60, 101, 44, 8, 2, 90]])


def _convert(*args):
    quiet = ["--no-progress"] if args[0] == "import-hf" else []
    out = subprocess.run([sys.executable, CONVERT, *args, *quiet], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    base = tmp_path_factory.mktemp("nanbeige")
    folder = str(base / "nanbeige")
    weights, cfg = make_nanbeige_folder(folder, seed=5)
    _convert("import-hf", "--hf-dir", folder, "--save", str(base / "ckpt"),
             "--tensor-model-parallel-size", "2")
    return str(base / "ckpt"), folder, weights, cfg


@pytest.mark.parametrize("route", ["checkpoint", "folder"])
def test_log_probs_equal_the_reference(imported, route):
    """Pass 1 and pass 2 (the released depth) at TP=1 and TP=2: megaloop's model read from the
    imported checkpoint, and the folder read directly for generation."""
    ckpt, folder, weights, cfg = imported
    source = ckpt if route == "checkpoint" else folder
    want = torch.stack([log_probs(weights, cfg, IDS, t) for t in (1, 2)])
    for tp in (1, 2):
        got = run_distributed(_per_step, tp, source, IDS)[0]
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < TOL, (tp, (got - want).abs().amax((1, 2, 3)))


def test_skip_loop_final_norm_and_a_seeded_bug(tmp_path):
    """skip_loop_final_norm true (the norm only after the last pass) == the reference; the
    reference with the norm in the other place differs by far more than the tolerance, in both
    configurations, so a misplaced norm cannot pass."""
    for skip in (True, False):
        folder = str(tmp_path / f"skip_{skip}")
        weights, cfg = make_nanbeige_folder(folder, seed=6, skip_loop_final_norm=skip)
        got = run_distributed(_per_step, 1, folder, IDS)[0][-1]
        assert (got - log_probs(weights, cfg, IDS)).abs().max().item() < TOL
        wrong = log_probs(weights, cfg, IDS, norm_between=skip)
        assert (got - wrong).abs().max().item() > 1000 * TOL


def test_greedy_generation_is_the_references(imported):
    ckpt, folder, weights, cfg = imported
    prompt = [5, 9, 17, 4]
    want = greedy(weights, cfg, prompt, 6)
    for load in (folder, ckpt):
        out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "generate.py"),
                              "--load", load, "--prompt-ids", ",".join(map(str, prompt)),
                              "--max-tokens", "6", "--no-stop-at-eod"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert [int(t) for t in out.stdout.strip().split(",")] == want, (load, out.stdout)


def first_step_argv(ckpt, tp, pp, *extra):
    """pretrain_looplm.py flags of one training step from an imported checkpoint (its flags
    taken with --use-checkpoint-args) on 2 x 2 mock sequences of 16 tokens at (TP, PP)."""
    return ["--use-checkpoint-args", "--load", ckpt, "--finetune",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
            os.path.join(ckpt, "tokenizer"), "--mock-data", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1",
            "--lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--num-workers", "0", "--eval-iters", "0",
            "--distributed-backend", "auto", "--transformer-impl", "auto",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            *extra]


def cross_entropy(log_probs_of):
    """per_token(m, batch) for ``check_first_loss``: the cross-entropy of ``log_probs_of(ids)``
    ([b, s, V] after the last pass) at the batch's labels."""
    def per_token(m, batch):
        logp = log_probs_of(batch["tokens"])
        return -logp.gather(-1, batch["labels"].unsqueeze(-1))[..., 0]
    return per_token


def check_first_loss(ckpt, tp, pp, per_token, *extra, tol):
    """The trainer's first step from an imported checkpoint (``first_step_argv`` and ``extra``
    flags) at (TP, PP): its loss is the mean of the reference's ``per_token(m, batch)`` ([b, s]
    of micro-batch m) over the tokens the step saw, within ``tol``, the same on every rank."""
    argv = first_step_argv(ckpt, tp, pp, *extra)
    results = run_distributed(_first_step, tp * pp, argv, timeout=240)
    stats = results[0][0]
    batches = next(seen for _, seen in results if seen and "labels" in seen[0])
    total, tokens = 0.0, 0.0
    for m, batch in enumerate(batches):
        mask = batch["loss_mask"].float()
        total += (per_token(m, batch) * mask).sum().item()
        tokens += mask.sum().item()
    assert abs(stats["loss"] - total / tokens) <= tol, (stats["loss"], total / tokens)
    assert all(r[0]["loss"] == stats["loss"] for r in results)
    return batches


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_first_training_loss_equals_the_reference(imported, tp, pp):
    """The reference's mean cross-entropy after the last pass (megaloop's objective for a model
    without an exit gate): a mean over 32 tokens of fp32 log-probabilities, each within TOL."""
    ckpt, _, weights, cfg = imported
    per_token = cross_entropy(lambda ids: log_probs(weights, cfg, ids))
    batches = check_first_loss(ckpt, tp, pp, per_token, tol=2 * TOL)
    assert len(batches) == 2


def test_export_gives_the_folder_back(imported, tmp_path):
    """import-hf, then export-hf (auto: Nanbeige's layout, as the checkpoint came from one):
    every tensor bit for bit, every key of the config.json that says what is computed equal;
    auto_map names Nanbeige's code on the Hub, and no megaloop modeling file is written."""
    from safetensors.torch import load_file

    ckpt, folder, _, cfg = imported
    out = str(tmp_path / "export")
    _convert("export-hf", "--load", ckpt, "--output-dir", out)
    theirs = load_file(os.path.join(folder, "model.safetensors"))
    ours = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    from megaloop.convert.hf_nanbeige import CHECKED, HONOURED, HUB_CODE

    for key in [*HONOURED, *CHECKED]:
        if key in cfg:
            assert written[key] == cfg[key], key
    assert written["auto_map"]["AutoModelForCausalLM"].startswith(HUB_CODE + "--")
    assert not [n for n in os.listdir(out) if n.startswith(("modeling_", "configuration_"))]
    # and the export reads back as the same model
    got = run_distributed(_per_step, 1, out, IDS)[0]
    want = run_distributed(_per_step, 1, folder, IDS)[0]
    assert torch.equal(got, want)


def test_every_released_key_has_a_role_and_features_are_refused_by_name():
    from megaloop.convert.hf_looped import looped_configs
    from megaloop.convert.hf_nanbeige import CHECKED, HONOURED, INERT

    released = nanbeige_config(full=True)
    assert all(k in HONOURED or k in CHECKED or k in INERT for k in released)
    model, loop = looped_configs(released)
    assert (loop.num_loops, loop.step_norm_placement, loop.gated, model.norm_scheme) == \
        (2, "recurrent", False, "pre")
    assert looped_configs(dict(released, skip_loop_final_norm=True))[1].step_norm_placement == \
        "readout"
    for key, value in [("loop_loss_weights", [0.5]), ("enable_mhc", True),
                       ("enable_depth_attention", True), ("qk_layernorm", True),
                       ("rope_scaling", {"type": "linear", "factor": 2.0}),
                       ("emb_neighbor_num", 2), ("loop_share_kv", True)]:
        with pytest.raises(ValueError, match=f"config.json {key}="):
            looped_configs(dict(released, **{key: value}))
    with pytest.raises(ValueError, match=r"\['new_feature'\] are unknown"):
        looped_configs(dict(released, new_feature=1))


def _llama_shapes(model, loop, vocab):
    """The Llama-named tensor shapes of a looped model without prelude or coda, from megaloop's
    configs (written out here: what Nanbeige's index lists)."""
    H, heads = model.hidden_size, model.num_attention_heads
    d, groups, ffn = model.kv_channels, model.num_query_groups, model.ffn_hidden_size
    shapes = {"model.embed_tokens.weight": (vocab, H), "model.norm.weight": (H,)}
    if model.untie_embeddings_and_output_weights:
        shapes["lm_head.weight"] = (vocab, H)
    for i in range(loop.num_core_layers(model.num_layers)):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,),
                       p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (heads * d, H),
                       p + "self_attn.k_proj.weight": (groups * d, H),
                       p + "self_attn.v_proj.weight": (groups * d, H),
                       p + "self_attn.o_proj.weight": (H, heads * d),
                       p + "mlp.gate_proj.weight": (ffn, H), p + "mlp.up_proj.weight": (ffn, H),
                       p + "mlp.down_proj.weight": (H, ffn)})
    return shapes


def test_the_real_model_s_shapes_and_parameter_count(imported):
    """Nanbeige4.2-3B's config.json gives megaloop's configs whose tensors are the released
    index's: 4,169,800,704 parameters (its total_size, 8,339,601,408 bytes of bf16, over 2).
    The shape rule holds at the tiny size, where megaloop's model gives the folder's tensors
    back bit for bit (test_export_gives_the_folder_back)."""
    from safetensors.torch import load_file

    from megaloop.convert.hf_looped import looped_configs

    model, loop = looped_configs(nanbeige_config(full=True))
    full = _llama_shapes(model, loop, 166144)
    assert sum(torch.Size(s).numel() for s in full.values()) == 8_339_601_408 // 2
    assert len(full) == 22 * 9 + 3
    ckpt, folder, _, cfg = imported
    tiny_model, tiny_loop = looped_configs(cfg)
    stored = load_file(os.path.join(folder, "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in stored.items()} == \
        _llama_shapes(tiny_model, tiny_loop, cfg["vocab_size"])
    assert sorted(random_weights(cfg, 0)) == sorted(stored)


def test_the_folder_and_the_checkpoint_serve(imported, tmp_path):
    """`megaloop serve --load` of the Nanbeige folder and of its import: each starts and answers
    a completion over HTTP (the model is the one generate.py loads, whose greedy tokens are the
    reference's: test_greedy_generation_is_the_references)."""
    from test_readme_next_steps import _serve_and_ask

    ckpt, folder, _, _ = imported
    for i, load in enumerate((folder, ckpt)):
        (tmp_path / str(i)).mkdir()
        _serve_and_ask([sys.executable, "-m", "megaloop", "serve", "--load", load],
                       tmp_path / str(i))


def _lm_eval_scores(rank, world, sources, pair, exit=None, prepare=None):
    from lm_eval.api.instance import Instance

    from megaloop.eval.lm_eval_adapter import MegaloopLM

    request = [Instance("loglikelihood", {}, pair, 0)]
    scores = []
    for source in sources:
        lm = MegaloopLM(load=source, exit=exit)
        if prepare is not None:
            prepare(lm.model)
        scores.append(lm.loglikelihood(request, disable_tqdm=True)[0])
    return scores


def check_lm_eval(sources, log_probs_of, exit=None, prepare=None):
    """lm-eval's megaloop model, --model_args load=SOURCE (and exit=``exit``; ``prepare(model)``
    after loading): the log-likelihood of a continuation is the reference's sum of its tokens'
    log-probabilities (``log_probs_of(ids)``: [s, V] of one sequence), and greedy-ness (whether
    each continuation token is the argmax) agrees."""
    context, continuation = [5, 9, 17, 4], [30, 12, 7]
    pair = (" ".join(f"w{i}" for i in context), " " + " ".join(f"w{i}" for i in continuation))
    logp = log_probs_of(torch.tensor([context + continuation])[:, :-1])
    want = sum(logp[len(context) - 1 + j, t].item() for j, t in enumerate(continuation))
    greedy_ = all(logp[len(context) - 1 + j].argmax().item() == t
                  for j, t in enumerate(continuation))
    scores = run_distributed(_lm_eval_scores, 1, sources, pair, exit, prepare)[0]
    for score, is_greedy in scores:
        assert abs(score - want) < len(continuation) * TOL, (score, want)
        assert is_greedy == greedy_


def test_lm_eval_scores_the_folder_and_the_checkpoint_as_the_reference(imported):
    """lm-eval scores the Nanbeige folder and its import as the reference does."""
    ckpt, folder, weights, cfg = imported
    check_lm_eval((folder, ckpt), lambda ids: log_probs(weights, cfg, ids)[0])
