"""--value-embeddings and --qk-layernorm-scale-free (Parcae's pieces) on megaloop's engine.

The forward against Parcae's own definition is tests/test_parcae.py (tests/parcae_reference.py);
here: which layers carry tables, TP=2 == TP=1 (loss and every gradient: the gate's input
gradient is summed over the ranks), activation recomputation of a forward whose token ids a
later forward has replaced (and that the guard is what makes it right), a checkpoint that
reshards between TP and PP layouts, and the flags' refusals.
"""

import pytest
import torch

from distributed import run_distributed, setup_parallel
from reference import full_grads, lm_batch, max_diff
from flags import llama_style
from test_checkpoint import RESHARD, _save_or_load

VOCAB, SEQ, BATCH, T = 256, 16, 2, 2
# fp32 sums in another order (TP's split products and all-reduces) move a loss of ~5.5 and
# gradients of O(1e-2) by a few ulp per layer: 1e-5 absolute is ~100 ulp of the loss.
TOL = 1e-5


def _model(recompute=None, seed=11):
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model
    from megaloop.parallel.initialize import set_seed

    set_seed(seed)
    model_cfg = llama_style(num_layers=4, hidden_size=64, num_attention_heads=4,
                            num_query_groups=2, max_position_embeddings=SEQ,
                            value_embeddings=True, qk_layernorm=True,
                            qk_layernorm_scale_free=True)
    loop = LoopConfig(num_loops=T, num_prelude_layers=1, num_coda_layers=1,
                      input_injection="scalar-mix")
    return build_model(model_cfg, loop, VOCAB, tp_size=torch.distributed.get_world_size(),
                       recompute=recompute)


def _layers_with_tables(rank, world):
    setup_parallel(world, 11)
    model = _model()
    names = [n for n, _ in model.named_parameters() if "value_" in n]
    qk_params = [n for n, _ in model.named_parameters() if "q_layernorm" in n or "k_layernorm" in n]
    return names, qk_params


def test_every_other_layer_ending_at_the_last_has_a_table():
    """Prelude 1, core 2, coda 1: layers 0..3 once through; 1 and 3 (core layer 0, the coda's
    layer 0) carry a table and a gate, and the scale-free QK-norm has no parameters."""
    names, qk_params = run_distributed(_layers_with_tables, 1)[0]
    assert sorted(names) == sorted(
        f"{part}.layers.0.self_attention.linear_qkv.{p}" for part in ("core", "coda")
        for p in ("value_embedding", "value_gate"))
    assert qk_params == []


def _loss_and_grads(rank, world):
    setup_parallel(world, 11)
    model = _model()
    with torch.no_grad():  # gates away from 1, so their gradient path is exercised
        for n, p in model.named_parameters():
            if n.endswith("value_gate"):  # (drawn whole, each rank's query groups kept)
                full = torch.randn(2, 32, generator=torch.Generator().manual_seed(5)) * 0.5
                p.copy_(full.chunk(world, 0)[rank])
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    loss = model(ids, pos, None, labels=labels).objective.mean()
    loss.backward()
    return loss.item(), full_grads(model)


def test_tp2_equals_tp1():
    (l1, g1), = run_distributed(_loss_and_grads, 1)
    for l2, g2 in run_distributed(_loss_and_grads, 2):
        assert abs(l1 - l2) < TOL, (l1, l2)
        assert g1.keys() == g2.keys()
        assert g1["core.layers.0.self_attention.linear_qkv.value_gate"].abs().max() > 0
        for k in g1:
            assert torch.allclose(g1[k], g2[k], atol=TOL, rtol=1e-4), k


def _interleaved(rank, world, recompute, guard=True):
    """Two forwards (another batch's ids second), then the first one's backward: under full
    recomputation the first forward's blocks are re-run then."""
    from megaloop.model import loop_step

    setup_parallel(world, 11)
    if not guard:  # the seeded bug: no ReselectStep after a block with value embeddings
        loop_step.ReselectStep.apply = staticmethod(lambda h, holder, value: h)
    model = _model(recompute)
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    first = model(ids, pos, None, labels=labels).objective.mean()
    other = torch.roll(ids, 1, dims=1)
    model(other, pos, None, labels=labels).objective.mean()
    first.backward()
    return full_grads(model)


FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def test_recomputation_reads_its_own_forward_s_tokens():
    plain, = run_distributed(_interleaved, 1, None)
    recomputed, = run_distributed(_interleaved, 1, FULL)
    assert max_diff(plain, recomputed) < TOL
    unguarded, = run_distributed(_interleaved, 1, FULL, False)
    assert max_diff(plain, unguarded) > 1000 * TOL  # without the guard: the other batch's ids


VE = ["--value-embeddings", "--qk-layernorm", "--qk-layernorm-scale-free",
      "--num-layers", "4", "--num-prelude-layers", "1", "--num-coda-layers", "1"]
BASE_VE = [f for f in RESHARD] + VE


def _without(flags, name):
    i = flags.index(name)
    return flags[:i] + flags[i + 2:]


def _next_loss(rank, world, flags, ckpt):
    from run_helpers import build_trainer

    stats, _, _ = build_trainer(flags + ["--load", ckpt]).train_step()
    return stats["loss"]


def test_a_checkpoint_loads_at_another_layout(tmp_path):
    """Saved at TP = PP = 1, loaded at TP = 2 (the same logits and next loss) and at PP = 2
    (the core split over two stages, each table on the stage holding its layer: the same next
    loss; a pipeline forward needs labels, so no logits)."""
    flags = _without(BASE_VE, "--num-layers") + ["--num-layers", "4"]
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(_save_or_load, 1, flags, ckpt, True)[0]
    loaded = run_distributed(_save_or_load, 2, flags + ["--tensor-model-parallel-size", "2"],
                             ckpt, False)[0]
    assert torch.allclose(saved[0], loaded[0], atol=1e-6, rtol=0)
    assert abs(saved[1] - loaded[1]) < 1e-6
    staged = run_distributed(_next_loss, 2, flags + ["--pipeline-model-parallel-size", "2"],
                             ckpt)
    assert all(abs(saved[1] - loss) < 1e-6 for loss in staged), (saved[1], staged)


@pytest.mark.parametrize("kw,flag", [
    ({"value_embeddings": True, "hidden_size": 16, "num_attention_heads": 2},
     "--value-embeddings"),
    ({"qk_layernorm_scale_free": True}, "--qk-layernorm"),
    ({"qk_layernorm": True, "qk_layernorm_scale_free": True, "rotary_percent": 0.5},
     "--rotary-percent"),
])
def test_model_flags_are_refused_by_name(kw, flag):
    from megaloop.model.config import ModelConfig

    with pytest.raises(ValueError, match=flag):
        ModelConfig(position_embedding_type="rope", **kw).validate()


def test_sequence_parallel_is_refused_by_name():
    from megaloop.training.run_config import parse_args

    cfg = parse_args(BASE_VE + ["--tensor-model-parallel-size", "2", "--sequence-parallel"])
    with pytest.raises(ValueError, match="--value-embeddings with --sequence-parallel"):
        cfg.validate(world_size=2)
