"""A stateful loop variant is one module plus one registration line.

``RunningMean`` below exists only in this file: an injection that mixes into the core's input the
running mean of the states that entered the steps so far (z_t = h + a (m_t - h), m_t the mean of
h_0 .. h_{t-1}), kept in a carry slot it declares. Registered with one line, it runs as the
hand-unrolled recurrence written here says, trains through the real trainer with two pipeline
stages exactly as with one (the slot crosses the stages with the activation), and decodes with a
KV cache as without one. Nothing outside this file knows it.
"""

import torch
from megatron.core.transformer.module import MegatronModule

from megaloop.model.carry import Slot
from megaloop.model.looped_gpt import VARIANTS
from megaloop.model.recurrence import LoopVariant

from distributed import run_distributed, setup_parallel
from flags import llama_style
from reference import embed_by_hand, lm_batch, reference_objective
from test_training import _compare, _one_step

VOCAB, SEQ, BATCH, T = 256, 12, 2, 4


class RunningMean(MegatronModule, LoopVariant):
    """z_t = h + a (m_t - h), m_t = mean(h_0 .. h_{t-1}); a replicated scalar, 0.5 at start,
    owned by the first pipeline stage (where before_core runs)."""

    def __init__(self, config, first: bool):
        super().__init__(config=config)
        if first:
            self.mix = torch.nn.Parameter(torch.full((1,), 0.5, dtype=config.params_dtype))

    def carry_slots(self, num_loops):
        return [Slot("running_mean")] if num_loops > 1 else []

    def before_core(self, z, carry, t, ctx):
        m = carry.h if t == 1 else carry.running_mean + (carry.h - carry.running_mean) / t
        if t < ctx.num_loops:
            carry.running_mean = m
        return z + self.mix * (m - z)


def _register():
    """The one line, run in each rank's process (a forked or spawned child: nothing leaks into
    the other tests)."""
    VARIANTS["running_mean"] = lambda config, loop, first, last: RunningMean(config, first)


def _model(num_loops=T):
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    model_cfg = llama_style(num_layers=2, hidden_size=32, num_attention_heads=4,
                            max_position_embeddings=SEQ)
    loop = LoopConfig(num_loops=num_loops, exit_kl_beta=0.1)
    loop.validate(model_cfg.num_layers)
    return build_model(model_cfg, loop, VOCAB)


def _against_unrolled(rank, world):
    setup_parallel(world)
    _register()
    model = _model()
    ids, pos, labels = lm_batch(VOCAB, SEQ, BATCH)
    out = model(ids, pos, None, labels=labels)
    out.objective.mean().backward()
    grad = model.running_mean.mix.grad.clone()
    model.zero_grad()

    a = model.running_mean.mix
    rope, _, h = embed_by_hand(model, ids, pos)
    entered, losses, lambdas = [], [], []
    weight = model.shared_embedding_or_output_weight()
    for t in range(1, T + 1):
        entered.append(h)
        m = torch.stack(entered).mean(0)
        h = model.step_norm(model.core(hidden_states=h + a * (m - h), attention_mask=None,
                                       rotary_pos_emb=rope))
        logits, _ = model.output_layer(h, weight=weight)
        losses.append(model.compute_language_model_loss(labels, logits))
        if t < T:
            lambdas.append(torch.sigmoid(model.exit_gate.linear(h).squeeze(-1).float()).t())
    ref, _ = reference_objective(torch.stack(losses), torch.stack(lambdas), beta=0.1)
    ref.mean().backward()
    return ((out.objective.detach() - ref.detach()).abs().max().item(), grad.item(),
            a.grad.item())


def test_equals_unrolled_recurrence():
    err, grad, ref_grad = run_distributed(_against_unrolled, 1)[0]
    assert err < 1e-5, err
    assert grad != 0 and abs(grad - ref_grad) < 1e-5 * max(1.0, abs(ref_grad)), (grad, ref_grad)


def _trainer_step(rank, world, extra):
    _register()
    return _one_step(rank, world, extra)


def test_trains_with_two_pipeline_stages_as_with_one():
    extra = ["--micro-batch-size", "2"]
    ref = run_distributed(_trainer_step, 1, extra)[0]
    assert ref[2]["running_mean.mix"].abs().item() > 0  # the variant's parameter learns
    assert ref[3]["running_mean.mix"].item() != 0.5
    for result in run_distributed(_trainer_step, 2, extra + ["--pipeline-model-parallel-size",
                                                             "2"]):
        _compare(ref, result)


def _cached_vs_full(rank, world):
    from megaloop.inference.kv_cache import LoopKVCache

    setup_parallel(world)
    _register()
    model = _model(3).eval()
    ids, pos, _ = lm_batch(VOCAB, SEQ, BATCH)
    prefill = 5
    with torch.no_grad():
        full = model(ids, pos, None)
        kv = LoopKVCache(BATCH, SEQ)
        cached = [model(ids[:, :prefill], pos[:, :prefill], None, kv_cache=kv)]
        kv.advance(prefill)
        for j in range(prefill, SEQ):
            cached.append(model(ids[:, j:j + 1], pos[:, j:j + 1], None, kv_cache=kv))
            kv.advance(1)
    return (full - torch.cat(cached, 1)).abs().max().item()


def test_cached_decoding_equals_uncached():
    err = run_distributed(_cached_vs_full, 1)[0]
    assert err < 1e-5, err


def _name_taken(rank, world):
    setup_parallel(world)
    VARIANTS["core"] = lambda config, loop, first, last: RunningMean(config, first)
    try:
        _model()
    except ValueError as exc:
        return str(exc)
    return None


def test_a_name_the_model_uses_is_refused():
    message = run_distributed(_name_taken, 1)[0]
    assert message and "'core'" in message and "another" in message, message
