"""Huginn-0125 folders in and out (megaloop/convert/hf_huginn.py), against the independent
reference of tests/huginn_reference.py (written from Huginn's published definition).

A tiny folder with every key of the released config.json is imported once with
`tools/convert_checkpoint.py import-hf`; then: every step's log-probabilities equal the
reference's at TP=1 and TP=2, from the checkpoint and from the folder read directly, from the
zero state (Huginn's init_scale 0) and from the random state megaloop draws (handed to the
reference); three seeded bugs (no embedding scale, RoPE on halves, no second ln_f) are caught;
the drawn state has Huginn's distribution and is the same on tensor-parallel ranks; greedy
generation is the reference's; the trainer's first step from the checkpoint has the reference's
loss at (TP, PP) = (1, 1), (2, 1), (1, 2); truncated backpropagation through the last k steps
gives the reference's gradient; the huginn-kl exit rule stops where the reference's KL says;
the export gives the folder back bit for bit under Huginn's config.json; every key of the
released config.json has a role; the real model's shapes and parameter count follow from its
config.json.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from distributed import run_distributed
from huginn_reference import (forward, greedy, huginn_config, make_huginn_folder,
                              per_step_log_probs, random_weights, rope_table)
from test_nanbeige import (CONVERT, _convert, check_first_loss, check_lm_eval,
                          cross_entropy)

# fp32 on both sides; the sums run in other orders (fused QKV, megatron-core's attention and
# norms), each rounding ~1e-7 relative, through 1 + 2 x 3 + 1 layers and a 128-token softmax:
# agreement to ~2e-6 is what fp32 gives here, 1e-5 leaves a margin while any seeded bug below
# moves the log-probabilities by more than 0.1.
TOL = 1e-5
IDS = torch.tensor([[5, 9, 17, 4, 30, 12, 7, 21], [3, 3, 60, 101, 44, 8, 2, 90]])


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    base = tmp_path_factory.mktemp("huginn")
    folder = str(base / "huginn")
    weights, cfg = make_huginn_folder(folder, seed=5)
    printed = _convert("import-hf", "--hf-dir", folder, "--save", str(base / "ckpt"),
                       "--tensor-model-parallel-size", "2")
    return str(base / "ckpt"), folder, weights, cfg, printed


def _load(source, world):
    from distributed import setup_parallel
    from megaloop.checkpoint.load import load_model
    from megaloop.convert.hf_import import load_exported

    setup_parallel(world)
    if os.path.isfile(os.path.join(source, "config.json")):
        return load_exported(source, tp_size=world)[0].eval()
    return load_model(source, tp_size=world)[0].eval()


def _per_step(rank, world, source, ids, zero_state=True):
    """(the initial state megaloop drew [b, s, h], the log-probs [T, b, s, V] of every step of one
    forward). ``zero_state``: Huginn's init_scale 0 (megaloop's --state-init-scale 0)."""
    from megatron.core import tensor_parallel

    from megaloop.model import recurrence

    model = _load(source, world)
    if zero_state:
        model.initial_state.std = 0.0
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    out = []

    def on_step(t, carry, step):
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(step.logits)
        out.append(torch.log_softmax(logits.float(), -1).transpose(0, 1))

    with torch.no_grad():
        ctx = recurrence.context(model, ids, None, None, read_every_step=True)
        carry = recurrence.begin(model, ids, pos, ctx)
        s0 = carry.h.transpose(0, 1).clone()
        recurrence.fold(model, carry, ctx, on_step=on_step)
    return s0, torch.stack(out)


@pytest.mark.parametrize("route", ["checkpoint", "folder"])
def test_log_probs_equal_the_reference(imported, route):
    """Every step (Huginn's mean recurrence, 3 here) from the zero state, at TP=1 and TP=2."""
    ckpt, folder, weights, cfg, _ = imported
    want = per_step_log_probs(weights, cfg, IDS)
    for tp in (1, 2):
        s0, got = run_distributed(_per_step, tp, ckpt if route == "checkpoint" else folder,
                                  IDS)[0]
        assert not s0.any()
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < TOL, (tp, (got - want).abs().amax((1, 2, 3)))


def test_seeded_bugs_are_caught(imported):
    """The reference with one mistake (no sqrt(n_embd) embedding scale; RoPE on halves instead
    of interleaved pairs; the coda's output not normalized by ln_f) is far from megaloop's."""
    ckpt, _, weights, cfg, _ = imported
    got = run_distributed(_per_step, 1, ckpt, IDS)[0][1]
    for bug in ("scale", "halves", "coda_norm"):
        wrong = per_step_log_probs(weights, cfg, IDS, bug=bug)
        assert (got - wrong).abs().max().item() > 1000 * TOL, bug


def test_the_drawn_state_enters_as_huginn_s(imported):
    """From the random state megaloop draws (the same on both tensor-parallel ranks), every
    step's log-probabilities are the reference's fed that state; the state is not zero and
    differs between two forwards."""
    ckpt, _, weights, cfg, _ = imported
    results = run_distributed(_per_step, 2, ckpt, IDS, False)
    (s0, got), (s0_other_rank, _) = results
    assert torch.equal(s0, s0_other_rank)
    assert s0.abs().max() > 0
    want = per_step_log_probs(weights, cfg, IDS, s0=s0)
    assert (got - want).abs().max().item() < TOL
    assert (got - per_step_log_probs(weights, cfg, IDS)).abs().max().item() > 100 * TOL


def _draws(rank, world, sequence_parallel):
    from distributed import setup_parallel
    from megaloop.model.initial_state import RandomInitialState

    setup_parallel(1)  # two data-parallel ranks

    class Config:
        hidden_size = 32

    Config.sequence_parallel = sequence_parallel
    state = RandomInitialState(Config, 1.0, math.sqrt(32))
    like = torch.empty(2048, 4, 32)
    return state.noise(like), state.noise(like)


def test_the_state_has_huginn_s_distribution():
    """s_0 = TruncatedNormal(0, sigma^2, +-3 sigma) x sqrt(d), sigma = sqrt(2 / (5 d)): bounded
    by 3 sigma sqrt(d), with the standard deviation of a normal truncated at 3 sigma,
    sigma sqrt(1 - 2 x 3 phi(3) / (Phi(3) - Phi(-3))) sqrt(d), within 5 standard errors over
    262144 draws; successive draws differ; ranks of a data-parallel pair draw different numbers,
    tensor-parallel ranks without sequence parallelism the same, with it different."""
    d, sigma = 32, math.sqrt(2 / (5 * 32))
    phi = math.exp(-4.5) / math.sqrt(2 * math.pi)
    mass = math.erf(3 / math.sqrt(2))
    want = sigma * math.sqrt(1 - 6 * phi / mass) * math.sqrt(d)
    (first, second), (other_rank, _) = run_distributed(_draws, 2, False)
    assert first.abs().max() <= 3 * sigma * math.sqrt(d) * (1 + 1e-6)
    n = first.numel()
    assert abs(first.std().item() - want) < 5 * want / math.sqrt(2 * n)
    assert abs(first.mean().item()) < 5 * want / math.sqrt(n)
    assert not torch.equal(first, second) and not torch.equal(first, other_rank)

    same = run_distributed(_tp_draws, 2, False)
    assert torch.equal(same[0], same[1])
    split = run_distributed(_tp_draws, 2, True)
    assert not torch.equal(split[0], split[1])


def _tp_draws(rank, world, sequence_parallel):
    from distributed import setup_parallel
    from megaloop.model.initial_state import RandomInitialState

    setup_parallel(world)  # TP = 2

    class Config:
        hidden_size = 32

    Config.sequence_parallel = sequence_parallel
    return RandomInitialState(Config, 1.0, 1.0).noise(torch.empty(16, 2, 32))


def _greedy(rank, world, source, prompt, n):
    from megaloop.inference.generate import Generator

    model = _load(source, world)
    model.initial_state.std = 0.0
    return Generator(model, model.vocab_size).generate([prompt], n)[0]


def test_greedy_generation_is_the_references(imported):
    """megaloop's cached decoding at full depth from the zero state (Huginn's generate with
    init_scale 0) gives the reference's greedy tokens, which recompute everything per token."""
    ckpt, folder, weights, cfg, _ = imported
    prompt = [5, 9, 17, 4]
    want = greedy(weights, cfg, prompt, 6)
    for source in (folder, ckpt):
        assert run_distributed(_greedy, 1, source, prompt, 6)[0] == want, source


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_first_training_loss_equals_the_reference(imported, tp, pp):
    """The trainer from the checkpoint (its flags taken with --use-checkpoint-args, the fixed
    mean recurrence: no --random-depth-mean) and --state-init-scale 0: the reference's mean
    cross-entropy after the last step from the zero state (32 tokens, each within TOL)."""
    ckpt, _, weights, cfg, _ = imported
    per_token = cross_entropy(lambda ids: per_step_log_probs(weights, cfg, ids)[-1])
    check_first_loss(ckpt, tp, pp, per_token, "--state-init-scale", "0", tol=2 * TOL)


def _adapter_grad(rank, world, source, ids, no_grad_steps):
    model = _load(source, world)
    model.initial_state.std = 0.0
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    out = model(ids[:, :-1], pos[:, :-1], None, labels=ids[:, 1:], no_grad_steps=no_grad_steps)
    out.objective.mean().backward()
    return model.injection.weight.grad.clone()


def test_backprop_through_the_last_steps_is_huginn_s(imported):
    """Huginn trains the last k of T sampled steps: ``no_grad_steps(0, T, k) = max(T - k, 0)``
    (its sampler's n = max(p - k, 0) steps without gradient, then min(k, p) with); the adapter's
    gradient of the last step's mean cross-entropy with the first step run without gradient is
    the reference's with that step detached, and differs from the full gradient."""
    from megaloop.training.random_depth import no_grad_steps

    assert [no_grad_steps(0, T, 8) for T in (1, 8, 9, 40)] == [0, 0, 1, 32]
    assert no_grad_steps(5, 3) == 2  # --truncated-backprop-steps keeps the last step

    ckpt, _, weights, cfg, _ = imported
    leaves = {k: v.clone().requires_grad_(True) for k, v in weights.items()}
    ids = IDS
    grads = {}
    for n in (1, 0):
        for leaf in leaves.values():
            leaf.grad = None
        logp = forward(leaves, cfg, ids[:, :-1], no_grad_steps=n)[-1]
        ce = -logp.gather(-1, ids[:, 1:].unsqueeze(-1))[..., 0]
        ce.mean().backward()
        grads[n] = leaves["transformer.adapter.weight"].grad.clone()
        got = run_distributed(_adapter_grad, 1, ckpt, ids, n)[0]
        # fp32 rounding through the unrolled graph; 1e-4 of the largest entry is two orders
        # above the forward's agreement
        assert (got - grads[n]).abs().max() < 1e-4 * grads[n].abs().max(), n
    assert (grads[1] - grads[0]).abs().max() > 0.01 * grads[0].abs().max()


def _exits(rank, world, source, ids, rule_text):
    from megaloop.inference.early_exit import exit_log_probs
    from megaloop.model.exit_rules import parse_exit

    model = _load(source, world)
    model.initial_state.std = 0.0
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return exit_log_probs(model, ids, pos, model.loop.num_loops, parse_exit(rule_text),
                              model.vocab_size)[1]


def test_huginn_kl_stops_where_the_reference_s_kl_says(imported):
    """huginn-kl:eps stops a token after the first step t whose KL(p_{t-1} || p_t) is below eps,
    p_0 uniform over the vocabulary (Huginn's KLExitEvaluator). eps is put in the widest gap of
    the reference's KL values (so rounding cannot move a token across it), and some tokens then
    stop before the last step and some run to it."""
    ckpt, _, weights, cfg, _ = imported
    logp = per_step_log_probs(weights, cfg, IDS)  # [T, b, s, V]
    T, V = logp.shape[0], logp.shape[-1]
    previous = torch.cat([torch.full_like(logp[:1], -math.log(V)), logp[:-1]])
    kl = (previous.exp() * (previous - logp)).sum(-1)  # [T, b, s]: KL(p_{t-1} || p_t)
    values = kl[:-1].flatten().sort().values
    gaps = values[1:] - values[:-1]
    i = int(gaps[len(gaps) // 4: 3 * len(gaps) // 4].argmax()) + len(gaps) // 4
    eps = float((values[i] + values[i + 1]) / 2)
    below = torch.cat([kl[:-1] < eps, torch.ones_like(kl[:1], dtype=torch.bool)])
    want = below.float().argmax(0) + 1  # the first step that stops, 1-based
    assert 1 < want.float().mean() < T and (want < T).any() and (want == T).any()
    got = run_distributed(_exits, 1, ckpt, IDS, f"huginn-kl:{eps}")[0]
    assert torch.equal(got, want)


def test_the_import_records_huginn_s_settings(imported):
    """The checkpoint's run config: Huginn's pieces, the training sampler, and the KL exit as its
    default rule; the printed training flags carry the sampler."""
    from megaloop.checkpoint.config import read_run_config

    ckpt, _, _, cfg, printed = imported
    run = read_run_config(ckpt)
    m, loop = run["model"], run["loop"]
    assert (m["qk_bias"], m["rotary_interleaved"], m["norm_scheme"]) == (True, True, "sandwich")
    assert m["embedding_scale"] == math.sqrt(cfg["n_embd"])
    assert (loop["state_init"], loop["share_final_norm"], loop["input_injection"],
            loop["injection_source"], loop["step_norm_placement"], loop["exit_loss"]) == \
        ("noise", True, "concat-linear", "prelude", "readout", "last")
    assert (loop["num_loops"], loop["random_depth_mean"], loop["backprop_last_steps"]) == \
        (cfg["mean_recurrence"], cfg["mean_recurrence"], cfg["mean_backprop_depth"])
    assert run["generation"]["exit"] == "huginn-kl:0.001"
    assert f"--random-depth-mean {float(cfg['mean_recurrence'])}" in printed.replace(" \\\n", "")


def test_export_gives_the_folder_back(imported, tmp_path):
    """import-hf, then export-hf (auto: Huginn's layout, as the model is Huginn-style): every
    tensor bit for bit (the RoPE table too), every key that says what is computed equal;
    auto_map names Huginn's code on the Hub; the export reads back as the same model."""
    from safetensors.torch import load_file

    ckpt, folder, _, cfg, _ = imported
    out = str(tmp_path / "export")
    _convert("export-hf", "--load", ckpt, "--output-dir", out)
    theirs = load_file(os.path.join(folder, "model.safetensors"))
    ours = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs), \
        [k for k in theirs if not torch.equal(ours[k], theirs[k])]
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    from megaloop.convert.hf_huginn import CHECKED, DERIVED, HONOURED, HUB_CODE

    for key in [*HONOURED, *CHECKED, *DERIVED]:
        if key in cfg and key != "init_values":
            assert written[key] == cfg[key], key
    assert all(math.isclose(written["init_values"][k], v) for k, v in cfg["init_values"].items())
    assert written["auto_map"]["AutoModelForCausalLM"].startswith(HUB_CODE + "--")
    assert not [n for n in os.listdir(out) if n.startswith(("modeling_", "configuration_"))]
    got = run_distributed(_per_step, 1, out, IDS)[0][1]
    want = run_distributed(_per_step, 1, folder, IDS)[0][1]
    assert torch.equal(got, want)


def test_export_names_huginn_refuses_what_huginn_cannot_compute(tmp_path):
    from megaloop.convert.hf_export import write_hf_folder
    from megaloop.convert.hf_huginn import configs

    model, loop = configs(huginn_config())
    loop.share_final_norm = False
    with pytest.raises(ValueError, match="--names huginn needs a model Huginn's code computes; "
                                         "this one has a coda norm of its own"):
        write_hf_folder(str(tmp_path / "x"), model, loop, {}, names="huginn")
    assert not os.path.exists(tmp_path / "x")


def test_every_released_key_has_a_role_and_features_are_refused_by_name():
    from megaloop.convert.hf_huginn import CHECKED, DERIVED, HONOURED, INERT
    from megaloop.convert.hf_looped import default_exit, looped_configs

    released = huginn_config(full=True)
    assert all(k in HONOURED or k in CHECKED or k in INERT or k in DERIVED for k in released)
    model, loop = looped_configs(released)
    assert (model.hidden_size, model.num_attention_heads, model.kv_channels) == (5280, 55, 96)
    assert (loop.num_loops, loop.num_prelude_layers, loop.num_coda_layers,
            loop.num_core_layers(model.num_layers)) == (32, 2, 2, 4)
    assert (loop.random_depth_mean, loop.random_depth_sigma, loop.backprop_last_steps) == \
        (32.0, 0.5, 8)
    assert model.rotary_base == 50000 and model.norm_epsilon == 1e-6
    assert default_exit(released)["exit"] == "huginn-kl:0.001"
    for key, value in [("test_time_noise", 1), ("state_init", "zero"),
                       ("injection_type", "add"), ("bias", True), ("nonlin_name", "GELU"),
                       ("sampling_scheme", "fixed"), ("block_class_name", "PreNormBlock")]:
        with pytest.raises(ValueError, match=f"config.json {key}="):
            looped_configs(dict(released, **{key: value}))
    with pytest.raises(ValueError, match=r"n_layers=9: Huginn's configuration derives 8"):
        looped_configs(dict(released, n_layers=9))
    with pytest.raises(ValueError, match="tie_embeddings false"):
        looped_configs(dict(released, tie_embeddings=False))
    with pytest.raises(ValueError, match=r"\['new_feature'\] are unknown"):
        looped_configs(dict(released, new_feature=1))


def _huginn_shapes(model, loop, vocab):
    """Huginn's tensor shapes of a megaloop Huginn-style configuration, written out here from
    Huginn's definition (the RoPE table aside)."""
    d, heads, ffn = model.hidden_size, model.num_attention_heads, model.ffn_hidden_size
    hd, groups = model.kv_channels, model.num_query_groups
    shapes = {"transformer.wte.weight": (vocab, d), "transformer.ln_f.weight": (d,),
              "transformer.adapter.weight": (d, 2 * d)}
    for block, n in (("prelude", loop.num_prelude_layers),
                     ("core_block", loop.num_core_layers(model.num_layers)),
                     ("coda", loop.num_coda_layers)):
        for i in range(n):
            p = f"transformer.{block}.{i}."
            shapes.update({p + "attn.Wqkv.weight": ((heads + 2 * groups) * hd, d),
                           p + "attn.qk_bias": (2, 1, heads, hd), p + "attn.proj.weight": (d, d),
                           p + "mlp.fc.weight": (2 * ffn, d), p + "mlp.proj.weight": (d, ffn),
                           **{p + f"norm_{j}.weight": (d,) for j in (1, 2, 3, 4)}})
    return shapes


def test_the_real_model_s_shapes_and_parameter_count(imported):
    """Huginn-0125's config.json gives megaloop's configs whose tensors number 3,564,976,800
    parameters (the released model's count, tied head): wte 65536 x 5280, 8 layers of fused QKV
    3 x 5280^2, q/k bias 2 x 5280, projection 5280^2, [gate; up] 2 x 17920 x 5280, down
    17920 x 5280 and four norms, the adapter 5280 x 10560 and ln_f. The shape rule holds at the
    tiny size, where megaloop's model gives the folder's tensors back bit for bit
    (test_export_gives_the_folder_back)."""
    from safetensors.torch import load_file

    from megaloop.convert.hf_huginn import configs

    model, loop = configs(huginn_config(full=True))
    full = _huginn_shapes(model, loop, 65536)
    assert sum(torch.Size(s).numel() for s in full.values()) == 3_564_976_800
    ckpt, folder, _, cfg, _ = imported
    stored = load_file(os.path.join(folder, "model.safetensors"))
    tiny = _huginn_shapes(*configs(cfg), cfg["vocab_size"])
    assert {k: tuple(v.shape) for k, v in stored.items() if k != "freqs_cis"} == tiny
    assert sorted(random_weights(cfg, 0)) == sorted(stored)


def test_the_folder_and_the_checkpoint_serve(imported, tmp_path):
    """`megaloop serve --load` of the Huginn folder and of its import: each starts and answers a
    completion over HTTP (with the default huginn-kl exit rule)."""
    from test_readme_next_steps import _serve_and_ask

    ckpt, folder, _, _, _ = imported
    for i, load in enumerate((folder, ckpt)):
        (tmp_path / str(i)).mkdir()
        _serve_and_ask([sys.executable, "-m", "megaloop", "serve", "--load", load],
                       tmp_path / str(i))


def _zero_state(model):
    model.initial_state.std = 0.0


def test_lm_eval_scores_the_folder_and_the_checkpoint_as_the_reference(imported):
    """lm-eval's megaloop model at full depth (exit=none) from the zero state scores the Huginn
    folder and its import as the reference does."""
    ckpt, folder, weights, cfg, _ = imported
    check_lm_eval((folder, ckpt), lambda ids: per_step_log_probs(weights, cfg, ids)[-1, 0],
                  exit="none", prepare=_zero_state)


def test_a_bfloat16_folder_imports_and_a_wrong_rope_table_is_refused(tmp_path):
    """The released folder is bfloat16 (its RoPE table too): it imports; a table of another
    base (config.json and the weights from different models) is refused by name."""
    from safetensors.torch import load_file, save_file

    folder = str(tmp_path / "bf16")
    make_huginn_folder(folder, seed=7, dtype=torch.bfloat16)
    _convert("import-hf", "--hf-dir", folder, "--save", str(tmp_path / "ckpt"))
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    cfg = huginn_config()
    tensors["freqs_cis"] = rope_table(8, cfg["block_size"], 500000).to(torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})
    out = subprocess.run([sys.executable, CONVERT, "import-hf", "--hf-dir", folder, "--save",
                          str(tmp_path / "ckpt2"), "--no-progress"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and "freqs_cis is not the interleaved RoPE table" in out.stderr, \
        out.stderr
