"""Parcae folders in and out (megaloop/convert/hf_parcae.py), against the independent reference
of tests/parcae_reference.py (written from Parcae's published definition).

A tiny folder as Parcae's save_pretrained writes it (config.json with every field of its
configuration, model.pt with every tensor, value-embedding tables non-zero) is imported once
with `tools/convert_checkpoint.py import-hf`; then: every pass's log-probabilities equal the
reference's at TP=1 and TP=2, from the checkpoint and from the folder read directly, started from
one given state; seeded bugs in the reference are caught; the export (--names parcae) gives the
folder back bit for bit; every config key has a role and what megaloop cannot compute is refused
by name (value tables or gates at other layers too); the trainer's first loss and greedy
generation are the reference's; each published size's configs have Parcae's parameter count.
"""

import json
import math
import os

import pytest
import torch

import parcae_reference as ref
from distributed import run_distributed
from test_nanbeige import _convert, check_first_loss, cross_entropy

IDS = torch.tensor([[5, 9, 17, 4, 30, 12, 7, 21, 90, 3, 64, 8],
                    [3, 3, 60, 101, 44, 8, 2, 90, 17, 17, 5, 127]])
# Tolerance as tests/test_parcae.py derives it: megaloop (fp32) must be within twice the fp32
# reference's own distance to the float64 reference (plus 4 ulp of the largest |log p|) of the
# float64 one; that bound is ~1e-5 here, and a real mistake moves the log-probabilities by
# orders more (the seeded bugs by > 1000 x TOL).
TOL = 1e-5
FP32_EPS = torch.finfo(torch.float32).eps  # the QK-norm's epsilon in fp32 (torch's default)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("parcae") / "folder")
    w, config, cfg = ref.write_parcae_folder(path, seed=5)
    assert all(w[f"value_embeds.{i}"].abs().min() > 0 for i in (1, 3, 5))  # tables non-zero
    x0 = torch.randn(*IDS.shape, cfg["d"], generator=torch.Generator().manual_seed(4)) * 0.1
    return path, w, config, cfg, x0


@pytest.fixture(scope="module")
def imported(folder, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("parcae_ckpt") / "ckpt")
    printed = _convert("import-hf", "--hf-dir", folder[0], "--save", ckpt,
                       "--tensor-model-parallel-size", "2")
    return ckpt, printed


def _load(source, world):
    from distributed import setup_parallel
    from megaloop.checkpoint.load import load_model
    from megaloop.convert.hf_import import load_exported

    setup_parallel(world)
    if os.path.isfile(os.path.join(source, "config.json")):
        return load_exported(source, tp_size=world)[0].eval()
    return load_model(source, tp_size=world)[0].eval()


def _per_step(rank, world, source, ids, x0):
    """Log-probs [T, b, s, V] after every pass of one forward started from ``x0`` [b, s, d]."""
    from megatron.core import tensor_parallel

    from megaloop.model import recurrence

    model = _load(source, world)
    model.initial_state.noise = lambda like: x0.transpose(0, 1).to(like)  # [s, b, d] there
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    out = []

    def on_step(t, carry, step):
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(step.logits)
        out.append(torch.log_softmax(logits.float(), -1).transpose(0, 1))

    with torch.no_grad():
        ctx = recurrence.context(model, ids, None, None, read_every_step=True)
        carry = recurrence.begin(model, ids, pos, ctx)
        recurrence.fold(model, carry, ctx, on_step=on_step)
    return torch.stack(out)


def _check_close(got, w, cfg, x0):
    """``got`` within the derived bound of the float64 reference (see TOL)."""
    steps = got.size(0)
    want = torch.stack(ref.forward(w, cfg, IDS, x0, steps))
    exact = torch.stack(ref.forward({k: v.double() for k, v in w.items()}, cfg, IDS,
                                    x0.double(), steps, qk_eps=FP32_EPS))
    assert got.shape == want.shape == (cfg["mean_recurrence"], *IDS.shape, cfg["vocab"])
    ulp = FP32_EPS * 2 ** math.floor(math.log2(exact.abs().max().item()))
    bound = 2 * (want.double() - exact).abs().max().item() + 4 * ulp
    err = (got.double() - exact).abs().amax(dim=(1, 2, 3))
    assert bound < 5 * TOL and (err < bound).all(), (err, bound)


@pytest.mark.parametrize("route", ["folder", "checkpoint"])
def test_every_pass_equals_the_reference(folder, imported, route):
    """From the checkpoint and from the folder itself, at TP=1 and TP=2; the passes differ (the
    loop does something at each)."""
    path, w, _, cfg, x0 = folder
    source = path if route == "folder" else imported[0]
    for tp in (1, 2):
        got = run_distributed(_per_step, tp, source, IDS, x0)[0]
        _check_close(got, w, cfg, x0)
    assert (got[1:] - got[:-1]).abs().amax() > 1e-2


def test_seeded_bugs_are_caught(folder):
    """The reference with one mistake (the value gate without its factor 2; dt without
    softplus) is far from megaloop's; so is the reference without value embeddings."""
    path, w, _, cfg, x0 = folder
    got = run_distributed(_per_step, 1, path, IDS, x0)[0]
    for bug in ("value-gate-without-2", "decay-without-softplus"):
        wrong = torch.stack(ref.forward(w, cfg, IDS, x0, got.size(0), bug=bug))
        assert (got - wrong).abs().max().item() > 1000 * TOL, bug
    no_tables = {k: v for k, v in w.items() if not k.startswith("value_embeds.")}
    wrong = torch.stack(ref.forward(no_tables, cfg, IDS, x0, got.size(0)))
    assert (got - wrong).abs().max().item() > 1000 * TOL


def test_the_import_records_parcae_s_settings(folder, imported):
    from megaloop.checkpoint.config import read_run_config

    _, _, config, _, _ = folder
    ckpt, printed = imported
    run = read_run_config(ckpt)
    m, loop = run["model"], run["loop"]
    assert (m["value_embeddings"], m["qk_layernorm"], m["qk_layernorm_scale_free"],
            m["squared_relu"], m["rotary_interleaved"], m["rotary_base"], m["norm_scheme"]) == \
        (True, True, True, True, True, 50000, "pre")
    assert (loop["input_injection"], loop["injection_source"], loop["injection_source_norm"],
            loop["state_init"], loop["readout_projection"], loop["step_norm"],
            loop["exit_loss"]) == ("parcae", "prelude", True, "noise", True, "identity", "last")
    # 1 + Poisson(mean - 1), the last mean_backprop_depth passes trained
    assert (loop["num_loops"], loop["random_depth_mean"], loop["random_depth_sigma"],
            loop["backprop_last_steps"]) == (4, 3.0, 0.0, 2)
    assert run["generation"]["exit"] is None
    assert "--random-depth-mean 3.0" in printed.replace(" \\\n", "")


def test_export_gives_the_folder_back_bit_for_bit(folder, imported, tmp_path):
    """export-hf --names parcae: every tensor of model.pt equal (the tied head and the RoPE
    table too) and config.json the same; auto picks Parcae's layout for this model."""
    from megaloop.convert.hf_parcae import configs, parcae_style

    path, _, config, _, _ = folder
    out = str(tmp_path / "export")
    _convert("export-hf", "--load", imported[0], "--output-dir", out, "--names", "parcae")
    theirs = torch.load(os.path.join(path, "model.pt"), weights_only=True)
    ours = torch.load(os.path.join(out, "model.pt"), weights_only=True)
    assert sorted(ours) == sorted(theirs)
    assert [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f) == config
    assert not [n for n in os.listdir(out) if n.endswith((".py", ".safetensors"))]
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    assert parcae_style(*configs(config)) is None


def test_every_key_has_a_role_and_what_megaloop_cannot_compute_is_refused():
    from megaloop.convert.hf_looped import default_exit, looped_configs
    from megaloop.convert.hf_parcae import CHECKED, DERIVED, HONOURED, INERT, MATCHED

    roles = [HONOURED, CHECKED, MATCHED, DERIVED, INERT]
    tiny = ref.parcae_config()
    for config in [tiny] + [ref.parcae_config(size) for size in ref.PUBLISHED_SIZES]:
        assert [k for k in config if not any(k in r for r in roles)] == []
    assert all(isinstance(why, str) and why for why in INERT.values())
    model, loop = looped_configs(tiny)
    assert (model.value_embeddings, model.qk_layernorm_scale_free, loop.num_loops) == \
        (True, True, 4)
    assert default_exit(tiny)["exit"] is None
    for key, value in [("injection_type", "linear"), ("nonlin_name", "GELU"),
                       ("norm_class_name", "LayerNorm"), ("init_strategy", "takase"),
                       ("logit_softcap", 15.0), ("sampling_scheme", "fixed"),
                       ("mup_model_scaling_factor", 2), ("_is_recurrent_block_config", True),
                       ("state_init", "zero"), ("clip_qkv", 8.0), ("bias", True),
                       ("recurrent_embedding_dimension", 32), ("padded_vocab_size", 192),
                       ("num_key_value_heads", 2)]:
        with pytest.raises(ValueError, match=f"config.json {key}="):
            looped_configs(dict(tiny, **{key: value}))
    with pytest.raises(ValueError, match=r"\['new_feature'\] are unknown"):
        looped_configs(dict(tiny, new_feature=1))
    # one core layer: Parcae's code puts the value gates at other layers than its tables
    with pytest.raises(ValueError, match="config.json mean_backprop_depth=2: Parcae's code"):
        looped_configs(dict(tiny, n_layers_in_recurrent_block=1))
    # a key the file lacks takes Parcae's default (here LayerNorm, refused)
    with pytest.raises(ValueError, match="config.json norm_class_name='LayerNorm'"):
        looped_configs({k: v for k, v in tiny.items() if k != "norm_class_name"})


def _tensors(folder):
    from megaloop.convert.hf_parcae import open_weights

    reader = open_weights(folder)
    return {n: reader.get(n) for n in reader.names()}


@pytest.mark.parametrize("rename,named", [
    (("value_embeds.5.weight", "value_embeds.4.weight"), "value_embeds.4.weight"),
    (("transformer.coda.1.attn.ve_gate.weight", "transformer.coda.0.attn.ve_gate.weight"),
     "transformer.coda.0.attn.ve_gate.weight"),
    (("value_embeds.1.weight", None), "value_embeds.1.weight"),
])
def test_tables_or_gates_at_other_layers_are_refused_by_name(folder, rename, named):
    from megaloop.convert.hf_parcae import configs, from_parcae

    path, _, config, _, _ = folder
    tensors = _tensors(path)
    old, new = rename
    moved = tensors.pop(old)
    if new:
        tensors[new] = moved
    with pytest.raises(ValueError, match=f"tensor {named}: the weights' value embeddings"):
        from_parcae(tensors.__getitem__, set(tensors), *configs(config))


def test_bad_weights_are_refused_by_name(folder, tmp_path):
    """An untied head under tie_embeddings, a RoPE table of another base, an extra tensor and a
    NaN are each refused naming the tensor; a bfloat16 file (its table rounded) is read."""
    from megaloop.convert.hf_parcae import configs, from_parcae, open_weights

    path, _, config, _, _ = folder
    model, loop = configs(config)
    good = _tensors(path)
    cases = [({"lm_head.weight": good["lm_head.weight"] + 1}, "lm_head.weight differs"),
             ({"freqs_cis": ref.rope_table(16, 64, 10000)}, "freqs_cis is not"),
             ({"transformer.extra.weight": torch.zeros(2)}, r"\['transformer.extra.weight'\]")]
    for change, message in cases:
        tensors = {**good, **change}
        with pytest.raises(ValueError, match=message):
            from_parcae(tensors.__getitem__, set(tensors), model, loop)
    bf16 = {k: v.to(torch.bfloat16) for k, v in good.items()}
    from_parcae(lambda n: bf16[n].float(), set(bf16), model, loop)
    broken = dict(good)
    broken["transformer.C.weight"] = broken["transformer.C.weight"].clone()
    broken["transformer.C.weight"][0, 0] = math.nan
    os.makedirs(tmp_path / "nan")
    torch.save(broken, tmp_path / "nan" / "model.pt")
    with pytest.raises(ValueError, match="tensor transformer.C.weight holds 1 NaN"):
        open_weights(str(tmp_path / "nan")).get("transformer.C.weight")


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_first_training_loss_equals_the_reference(folder, imported, tp, pp):
    """The trainer's first step from the checkpoint (its flags with --use-checkpoint-args: the
    fixed mean recurrence, no random depth) from the zero state (--state-init-scale 0): the
    reference's mean cross-entropy after the last pass (32 tokens, each within TOL)."""
    _, w, _, cfg, _ = folder

    def log_probs_of(ids):
        x0 = torch.zeros(*ids.shape, cfg["d"])
        return ref.forward(w, cfg, ids, x0, cfg["mean_recurrence"])[-1]

    check_first_loss(imported[0], tp, pp, cross_entropy(log_probs_of), "--state-init-scale",
                     "0", tol=2 * TOL)


def _greedy(rank, world, source, prompt, n):
    from megaloop.inference.generate import Generator

    model = _load(source, world)
    model.initial_state.std = 0.0  # the zero state
    return Generator(model, model.vocab_size).generate([prompt], n)[0]


def test_greedy_generation_is_the_references(folder, imported):
    """megaloop's cached decoding at full depth from the zero state gives the reference's greedy
    tokens, which recompute the whole sequence per token."""
    path, w, _, cfg, _ = folder
    prompt = [5, 9, 17, 4]
    want = ref.greedy(w, cfg, prompt, 6)
    for source in (path, imported[0]):
        assert run_distributed(_greedy, 1, source, prompt, 6)[0] == want, source


# --- the published sizes --------------------------------------------------------------------

def _megaloop_shapes(model, loop, rows):
    """megaloop's tensor shapes (TP = 1) of a Parcae-style configuration, written out here from
    its flags: per layer two norms, the fused QKV, the output projection, the relu^2 MLP, and in
    every other layer (ending at the last) a value table and gate; the injection (A_log,
    dt_bias, B, the source norm), C, the coda's final norm and the tied embedding."""
    d, heads, ffn = model.hidden_size, model.num_attention_heads, model.ffn_hidden_size
    shapes = {"embedding.word_embeddings.weight": (rows, d), "injection.A_log": (d,),
              "injection.dt_bias": (d,), "injection.B": (d, d),
              "injection.source_norm.weight": (d,), "step_norm.weight": (d, d),
              "coda.final_layernorm.weight": (d,)}
    parts = [("prelude", loop.num_prelude_layers),
             ("core", loop.num_core_layers(model.num_layers)), ("coda", loop.num_coda_layers)]
    n, j = model.num_layers, 0
    for part, count in parts:
        for i in range(count):
            p = f"{part}.layers.{i}."
            shapes.update({p + "input_layernorm.weight": (d,), p + "pre_mlp_layernorm.weight": (d,),
                           p + "self_attention.linear_qkv.weight": (3 * d, d),
                           p + "self_attention.linear_proj.weight": (d, d),
                           p + "mlp.linear_fc1.weight": (ffn, d),
                           p + "mlp.linear_fc2.weight": (d, ffn)})
            if j % 2 == (n - 1) % 2:
                shapes[p + "self_attention.linear_qkv.value_embedding"] = (rows, d)
                shapes[p + "self_attention.linear_qkv.value_gate"] = (heads, 32)
            j += 1
    return shapes


def test_the_shape_rule_holds_at_the_tiny_size(folder):
    """The hand-written shapes are those of the tiny folder's tensors under megaloop's names
    (which the import loads into the model, shape for shape)."""
    from megaloop.convert.hf_parcae import configs, from_parcae

    path, _, config, _, _ = folder
    model, loop = configs(config)
    tensors = _tensors(path)
    got = from_parcae(tensors.__getitem__, set(tensors), model, loop)
    assert {k: tuple(v.shape) for k, v in got.items()} == \
        _megaloop_shapes(model, loop, config["padded_vocab_size"])


@pytest.mark.parametrize("size", list(ref.PUBLISHED_SIZES))
def test_every_published_size_has_parcae_s_parameter_count(size):
    """hf_parcae.configs of each published config.json gives megaloop configs whose tensors,
    taken to Parcae's names (on the meta device: shapes only), number Parcae's own count
    (tests/test_parcae.py parcae_count; 144,323,136 for the small one), the tied head and the
    RoPE buffer aside."""
    from megaloop.convert.hf_parcae import configs, to_parcae
    from test_parcae import parcae_count

    config = ref.parcae_config(size)
    model, loop = configs(config)
    shapes = _megaloop_shapes(model, loop, config["padded_vocab_size"])
    state = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    theirs = to_parcae(state, model, loop)
    count = sum(v.numel() for k, v in theirs.items() if k not in ("lm_head.weight", "freqs_cis"))
    P, d, heads = ref.PUBLISHED_SIZES[size]
    assert count == parcae_count(P, d, heads=heads)
    if size == "small":
        assert count == 144_323_136
    assert (model.kv_channels, model.max_position_embeddings, loop.num_loops,
            loop.backprop_last_steps) == (128, 2048, 8, 4)


def test_the_folder_and_the_checkpoint_serve(folder, imported, tmp_path):
    """`megaloop serve --load` of the Parcae folder and of its import: each starts and answers a
    completion over HTTP."""
    import sys

    from test_readme_next_steps import _serve_and_ask

    for i, load in enumerate((folder[0], imported[0])):
        (tmp_path / str(i)).mkdir()
        _serve_and_ask([sys.executable, "-m", "megaloop", "serve", "--load", load],
                       tmp_path / str(i))


def _zero_state(model):
    model.initial_state.std = 0.0


def test_lm_eval_scores_the_folder_and_the_checkpoint_as_the_reference(folder, imported):
    """lm-eval's megaloop model at full depth from the zero state (Parcae's noise scaled to 0)
    scores the Parcae folder and its import as the reference does from x0 = 0."""
    from test_nanbeige import check_lm_eval

    path, w, _, cfg, _ = folder

    def log_probs_of(ids):
        x0 = torch.zeros(*ids.shape, cfg["d"])
        return ref.forward(w, cfg, ids, x0, cfg["mean_recurrence"])[-1][0]

    check_lm_eval((path, imported[0]), log_probs_of, exit="none", prepare=_zero_state)
