"""LoopFormer checkpoints in (megaloop/convert/hf_loopformer.py), against the independent
plain-torch reference of tests/loopformer_reference.py.

A tiny LoopFormer with seeded non-zero weights (the adaLN linears too) is written in both forms
LoopFormer's GPT.from_pretrained reads: (A) a folder holding the ckpt.pt train.py saves (its
'config' a pickled models.loopformer.GPTConfig, names with torch.compile's prefix) and (B) a
config.json + safetensors folder (names with a "model." prefix, no lm_head). (A) is imported
once with `tools/convert_checkpoint.py import-hf`; then: per-step logits of the checkpoint and of
(B) read directly equal the reference's at TP=1 and TP=2 on the trained route's halves (4 steps
of 1/4, 2 of 1/2); seeded bugs in the reference miss; what megaloop cannot compute and a pickle
naming code are refused by name (the code not run); the trainer's first loss is the reference's
last-step cross-entropy (PP>1 refused by name); greedy generation is the reference's; the
published configuration has the published parameter count.
"""

import json
import os

import pytest
import torch

import loopformer_reference as ref
from distributed import run_distributed

# fp32 on both sides; the bound tests/test_loopformer.py derives (24 residual updates of ~5e-6
# relative each on O(1) logits) grows with the steps: 8 steps x 3 layers x 2 branches here at
# most, the same order, so its 1e-4 stands. A seeded bug moves logits by O(1).
TOL = 1e-4
CFG = {"hidden": 32, "heads": 4, "layers": 3, "eps": torch.finfo(torch.float32).eps,
       "freq": 256, "vocab": 128, "positions": 16, "ffn": 80}
IDS = torch.tensor([[5, 9, 17, 4, 30, 12, 7, 21, 90, 3, 64, 8],
                    [3, 3, 60, 101, 44, 8, 2, 90, 17, 17, 5, 127]])
FULL = [1 / 8] * 8  # LoopFormer's route: its forward's default


def _hf_config():
    """config.json of variant B in the keys LoopFormer's HF loader reads (its alternatives)."""
    return {"model_type": "loopformer", "architectures": ["LoopFormerForCausalLM"],
            "n_positions": CFG["positions"], "vocab_size": CFG["vocab"],
            "num_hidden_layers": CFG["layers"], "num_attention_heads": CFG["heads"],
            "hidden_size": CFG["hidden"], "n_inner": CFG["ffn"], "bias": False,
            "dropout": 0.0, "torch_dtype": "float32", "transformers_version": "4.57.0"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from safetensors.torch import save_file

    from ouro_reference import write_tokenizer

    base = tmp_path_factory.mktemp("loopformer")
    w = ref.random_weights(CFG, seed=5)
    assert all(w[f"h.{k}.ada_w"].abs().min() > 0 for k in range(CFG["layers"]))
    state = ref.loopformer_state(w, CFG)
    a, b = base / "ckpt_folder", base / "hf_folder"
    for f in (a, b):
        f.mkdir()
        write_tokenizer(str(f), CFG["vocab"])  # (the trainer test reads a tokenizer)
    ref.write_checkpoint(str(a / "ckpt.pt"), state, ref.gpt_config_fields(CFG), "_orig_mod.")
    save_file({"model." + k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"},
              str(b / "model.safetensors"))
    (b / "config.json").write_text(json.dumps(_hf_config()))
    return str(a), str(b), w


@pytest.fixture(scope="module")
def imported(folders, tmp_path_factory):
    from test_nanbeige import _convert

    ckpt = str(tmp_path_factory.mktemp("loopformer_ckpt") / "ckpt")
    printed = _convert("import-hf", "--hf-dir", folders[0], "--save", ckpt,
                       "--tensor-model-parallel-size", "2")
    return ckpt, printed


def _load(source, world):
    from distributed import setup_parallel
    from megaloop.checkpoint.load import load_model
    from megaloop.convert.hf_import import load_exported
    from megaloop.inference.loading import is_hf_folder

    setup_parallel(world)
    if is_hf_folder(source):
        return load_exported(source, tp_size=world)[0].eval()
    return load_model(source, tp_size=world)[0].eval()


def _per_step(rank, world, source):
    """{loops: logits [steps, b, s, V]} for 4 and 2 loops (routes of 1/4 and 1/2)."""
    from megatron.core import tensor_parallel

    from megaloop.model import recurrence

    model = _load(source, world)
    pos = torch.arange(IDS.shape[1]).expand_as(IDS)
    result = {}
    with torch.no_grad():
        for loops in (4, 2):
            out = []
            ctx = recurrence.context(model, IDS, None, None, loops, read_every_step=True)
            carry = recurrence.begin(model, IDS, pos, ctx)
            recurrence.fold(model, carry, ctx, on_step=lambda t, c, o: out.append(
                tensor_parallel.gather_from_tensor_model_parallel_region(o.logits)
                .transpose(0, 1).float()))
            result[loops] = torch.stack(out)
    return result


@pytest.fixture(scope="module")
def per_step(folders, imported):
    """The imported checkpoint and folder (B) read directly, each at TP=1 and TP=2."""
    return {(name, tp): run_distributed(_per_step, tp, source)[0]
            for name, source in (("checkpoint", imported[0]), ("folder", folders[1]))
            for tp in (1, 2)}


def _reference(w, loops, bug=None):
    return torch.stack(ref.per_step_logits(w, CFG, IDS, [1 / loops] * loops, bug=bug))


def test_per_step_logits_equal_the_reference(folders, per_step):
    w = folders[2]
    for key, got in per_step.items():
        for loops in (4, 2):
            want = _reference(w, loops)
            assert got[loops].shape == want.shape == (loops, *IDS.shape, CFG["vocab"])
            assert 0.3 < want.abs().max().item() < 30  # O(1) logits: TOL is meaningful
            err = (got[loops] - want).abs().max().item()
            assert err < TOL, (key, loops, err)
    steps = per_step[("checkpoint", 1)][4]
    assert (steps[1:] - steps[:-1]).abs().max() > 0.1  # every step changes the readout


@pytest.mark.parametrize("bug", ["no-dt", "gate-offset"])
def test_a_seeded_bug_fails_the_comparison(folders, per_step, bug):
    w = folders[2]
    for got in per_step.values():
        for loops in (4, 2):
            assert (got[loops] - _reference(w, loops, bug)).abs().max().item() > 100 * TOL


def test_the_import_records_loopformer_s_settings(imported):
    from megaloop.checkpoint.config import read_run_config

    run = read_run_config(imported[0])
    m, loop = run["model"], run["loop"]
    assert (m["hidden_size"], m["num_attention_heads"], m["ffn_hidden_size"], m["num_layers"],
            m["max_position_embeddings"], m["norm_scheme"], m["position_embedding_type"],
            m["swiglu"], m["disable_bias_linear"]) == \
        (32, 4, 80, 3, 16, "magic", "learned_absolute", False, True)
    assert (loop["num_loops"], loop["timestep_conditioning"], loop["timestep_frequency_dim"],
            loop["timestep_inference"], loop["step_norm_placement"], loop["exit_loss"]) == \
        (8, "loopformer", 256, "rescaled", "readout", "last")
    assert run["generation"]["exit"] is None
    assert run["tokenizer"]["tokenizer_type"] == "HuggingFaceTokenizer"
    # the training flags it prints continue with LoopFormer's own objective
    assert loop["loopformer_objective"] and "--loopformer-objective" in imported[1]


def test_refusals_name_what_megaloop_cannot_compute(folders):
    from megaloop.convert.hf_folder import check_folder, read_hf_config
    from megaloop.convert.hf_loopformer import configs, from_loopformer, open_weights
    from megaloop.convert.hf_looped import looped_configs

    a, b, _ = folders
    good = _hf_config()
    assert looped_configs(good)[0].hidden_size == 32
    for key, value in [("bias", True), ("dropout", 0.1), ("resid_pdrop", 0.1)]:
        with pytest.raises(ValueError, match=f"config.json {key}={value}"):
            looped_configs(dict(good, **{key: value}))
    with pytest.raises(ValueError, match=r"\['new_feature'\] are unknown"):
        looped_configs(dict(good, new_feature=1))
    with pytest.raises(ValueError, match="n_embd 30 is not divisible by n_head 4"):
        looped_configs(dict(good, hidden_size=30))
    # the checkpoint's own fields go through the same roles (bias from its GPTConfig)
    cfg = read_hf_config(a)
    assert cfg["intermediate_dim"] == CFG["ffn"]  # only 'config' has it, not model_args
    with pytest.raises(ValueError, match="config.json bias=True"):
        configs(dict(cfg, bias=True))
    # a head that differs from wte
    reader = open_weights(a)
    tensors = {n: reader.get(n) for n in reader.names()}
    model, loop = configs(cfg)
    assert len(from_loopformer(tensors.__getitem__, set(tensors), model, loop)) == 47
    bad = dict(tensors, **{"lm_head.weight": tensors["lm_head.weight"] + 1})
    with pytest.raises(ValueError, match="lm_head.weight differs from transformer.wte.weight"):
        from_loopformer(bad.__getitem__, set(bad), model, loop)
    # a config whose size is not the tensors' (shapes from the headers)
    with pytest.raises(ValueError, match="intermediate_dim x n_embd = \\[96, 32\\] does not "
                                         "match the tensor transformer.h.blocks.0.mlp.c_fc"):
        check_folder(b, dict(good, n_inner=96))
    with pytest.raises(ValueError, match="n_layer 2 does not match the weights"):
        check_folder(b, dict(good, num_hidden_layers=2))


class _RunsCode:
    """Pickles as a call of os.system: loading it unsafely would create ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_naming_code_is_refused_not_run(tmp_path):
    from megaloop.convert.hf_folder import read_hf_config
    from megaloop.inference.loading import is_hf_folder

    marker = tmp_path / "ran"
    (tmp_path / "evil").mkdir()
    w = ref.random_weights(CFG, seed=1)
    torch.save({"model": ref.loopformer_state(w, CFG), "extra": _RunsCode(marker)},
               tmp_path / "evil" / "ckpt.pt")
    assert is_hf_folder(str(tmp_path / "evil"))
    with pytest.raises(ValueError, match=r"refused, its pickle names (posix|os)\.system"):
        read_hf_config(str(tmp_path / "evil"))
    assert not marker.exists()


@pytest.mark.parametrize("tp", [1, 2])
def test_first_training_loss_equals_the_reference(folders, imported, tp):
    """The trainer's first step (with --loopformer-objective, the flag import-hf prints for a
    LoopFormer; --use-checkpoint-args takes the architecture): LoopFormer's objective per token,
    micro-batch m on the shorter route the trainer draws for it (the run's seed, iteration 1,
    m), averaged over the step's tokens."""
    from test_nanbeige import check_first_loss, first_step_argv

    from megaloop.model.shortcut_objective import draw_route, route_generator
    from megaloop.training.run_config import parse_args

    seed = parse_args(first_step_argv(imported[0], tp, 1)).training.seed

    def per_token(m, batch):
        short = draw_route(len(FULL), route_generator(seed, 1, m))
        return ref.objective(folders[2], CFG, batch["tokens"], batch["labels"], FULL, short)

    check_first_loss(imported[0], tp, 1, per_token, "--loopformer-objective", tol=TOL)


def test_a_pipeline_split_is_refused(imported):
    """The shared step embedder cannot be split over stages: the refusal names the flag."""
    from megaloop.training import checkpointing
    from megaloop.training.run_config import parse_args
    from test_nanbeige import first_step_argv

    # 3 stages (the 3 layers split evenly: the refusal is loopformer's, not the split's)
    cfg = parse_args(first_step_argv(imported[0], 1, 3))
    checkpointing.apply_checkpoint_args(cfg)  # the checkpoint's model, as the trainer takes it
    assert cfg.loop.timestep_conditioning == "loopformer"
    with pytest.raises(ValueError, match="loopformer with --pipeline-model-parallel-size 3"):
        cfg.validate(world_size=3)


def _greedy(rank, world, source, prompt, n):
    from megaloop.inference.generate import Generator

    model = _load(source, world)
    return Generator(model, model.vocab_size).generate([prompt], n)[0]


def test_greedy_generation_is_the_references(folders, imported):
    """From the imported checkpoint and from the train.py folder read directly (--load)."""
    prompt = [5, 9, 17, 4]
    want = ref.greedy(folders[2], CFG, prompt, 5, FULL)
    for source in (imported[0], folders[0]):
        assert run_distributed(_greedy, 1, source, prompt, 5)[0] == want, source


def _shapes(rank, world, cfg):
    import dataclasses

    from distributed import setup_parallel
    from megaloop.convert.hf_loopformer import configs
    from megaloop.model.config import transformer_config
    from megaloop.model.looped_gpt import LoopedGPTModel

    setup_parallel(world)
    m, loop = configs(cfg)
    config = dataclasses.replace(transformer_config(m, m.num_layers, tp_size=1),
                                 perform_initialization=False)
    with torch.device("meta"):  # shapes only
        model = LoopedGPTModel(config, m, loop, cfg["vocab_size"])
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_the_published_configuration_has_the_published_count():
    """GPTConfig's defaults (the published model: what a bare state dict is read as) give
    278,169,600 parameters, counted from megaloop's tensor shapes."""
    import math

    from megaloop.convert.hf_loopformer import DEFAULTS

    shapes = run_distributed(_shapes, 1, dict(DEFAULTS))[0]
    total = sum(math.prod(s) for s in shapes.values())
    assert total == ref.parameter_count(50304, 1024, 2048, 5120, 3, 256) == 278_169_600
    assert shapes["embedding.word_embeddings.weight"] == (50304, 2048)


def test_the_folders_and_the_checkpoint_serve(folders, imported, tmp_path):
    """`megaloop serve --load` of both folder forms and of the import: each starts and answers
    a completion over HTTP."""
    import sys

    from test_readme_next_steps import _serve_and_ask

    for i, load in enumerate((folders[0], folders[1], imported[0])):
        (tmp_path / str(i)).mkdir()
        _serve_and_ask([sys.executable, "-m", "megaloop", "serve", "--load", load],
                       tmp_path / str(i))


def test_lm_eval_scores_the_folders_and_the_checkpoint_as_the_reference(folders, imported):
    """lm-eval's megaloop model (8 steps of 1/8) scores both folder forms and the import as the
    reference's last step does."""
    from test_nanbeige import check_lm_eval

    w = folders[2]
    check_lm_eval((folders[0], folders[1], imported[0]),
                  lambda ids: torch.log_softmax(ref.per_step_logits(w, CFG, ids, FULL)[-1][0], -1))
