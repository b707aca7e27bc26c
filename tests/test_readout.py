"""The chunked per-step readout (megaloop/model/readout.py) against today's readout.

Today's readout is megatron-core's ``ColumnParallelLinear`` followed by its
``vocab_parallel_cross_entropy`` (``--loop-readout logits``). The chunked one must give the same
per-token losses and the same gradients for the hidden states and the head's weight, at TP=1 and
TP=2 (with and without sequence parallelism), for chunk sizes that divide the tokens, do not, or
exceed them; inside the looped model with the exit objective (gate gradients included), tied and
untied; and through the trainer (TP=2, PP=2) after an optimizer step. It must also keep no
[tokens, V/tp] tensor for the backward, which is what it is for.
"""

import pytest
import torch

from distributed import run_distributed, setup_parallel
from reference import full_grads, lm_batch
from flags import llama_style

VOCAB, SEQ, BATCH, HIDDEN = 256, 12, 2, 16


# --- the head alone ----------------------------------------------------------------------------
def _saved_big(fn, params, limit: int):
    """(``fn()``, shapes of the tensors autograd saved during it with at least ``limit``
    elements, parameters excluded)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    big = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip and t.numel() >= limit:
            big.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, big


def _head(rank, world, chunk, sequence_parallel, dtype):
    from megatron.core import tensor_parallel

    from megaloop.model.config import transformer_config
    from megaloop.model.readout import chunked_language_model_loss

    setup_parallel(world)
    config = transformer_config(llama_style(hidden_size=HIDDEN, num_attention_heads=4), 1,
                                tp_size=world, sequence_parallel=sequence_parallel,
                                bf16=dtype == torch.bfloat16)
    head = tensor_parallel.ColumnParallelLinear(
        HIDDEN, VOCAB, config=config, init_method=config.init_method, bias=False,
        gather_output=False)
    assert head.weight.dtype == dtype
    g = torch.Generator().manual_seed(3)  # the same full tensors on every rank
    x_full = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    _, _, labels = lm_batch(VOCAB, SEQ, BATCH)
    upstream = torch.rand(BATCH, SEQ, generator=g)  # a different weight per token's loss
    seq = slice(rank * SEQ // world, (rank + 1) * SEQ // world) if sequence_parallel else \
        slice(None)
    tokens, vocab_local = SEQ * BATCH, head.weight.size(0)

    results = {}
    for name in ("logits", "chunked"):
        x = x_full[seq].clone().to(dtype).requires_grad_()
        head.weight.grad = None
        if name == "logits":  # LanguageModule.compute_language_model_loss, unfused
            def run():
                logits, _ = head(x)
                return tensor_parallel.vocab_parallel_cross_entropy(
                    logits, labels.t().contiguous()).t()
        else:
            def run():
                return chunked_language_model_loss(head, x, None, labels, chunk)
        loss, big = _saved_big(run, [head.weight], tokens * vocab_local)
        (loss.float() * upstream).sum().backward()
        results[name] = (loss.detach().float(), x.grad.float(), head.weight.grad.float(), big)
    (l1, gx1, gw1, big1), (l2, gx2, gw2, big2) = results["logits"], results["chunked"]
    # Errors relative to the largest entry (the per-token losses are ~log V).
    return ((l1 - l2).abs().max().item() / l1.abs().max().item(),
            (gx1 - gx2).abs().max().item() / gx1.abs().max().item(),
            (gw1 - gw2).abs().max().item() / gw1.abs().max().item(), big1, big2)


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_head_equals_megatron_readout_tp1(chunk):
    (loss, gx, gw, big_logits, big_chunked), = run_distributed(
        _head, 1, chunk, False, torch.float32)
    assert loss < 1e-6 and gx < 1e-6 and gw < 1e-6, (loss, gx, gw)
    # The probe sees today's readout keep its [s, b, V] softmax, and the chunked one keep none.
    assert (SEQ, BATCH, VOCAB) in big_logits, big_logits
    assert big_chunked == [], big_chunked


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_head_equals_megatron_readout_tp2(sequence_parallel):
    for loss, gx, gw, big_logits, big_chunked in run_distributed(
            _head, 2, 7, sequence_parallel, torch.float32):
        assert loss < 1e-6 and gx < 1e-6 and gw < 1e-6, (loss, gx, gw)
        assert (SEQ, BATCH, VOCAB // 2) in big_logits and big_chunked == [], (big_logits,
                                                                               big_chunked)


def test_head_bf16_within_rounding():
    # bf16: the GEMMs run in bf16 as in the linear; the chunked weight gradient is summed over
    # chunks in fp32 and rounded once, one bf16 GEMM rounds it once too: the two may differ by
    # one bf16 rounding (2^-8 relative to the entry, so at most 2^-7 of the largest one).
    (loss, gx, gw, _, _), = run_distributed(_head, 1, 7, False, torch.bfloat16)
    assert loss < 1e-6 and gx < 2 ** -7 and gw < 2 ** -7, (loss, gx, gw)


# --- inside the looped model: the exit objective and its gate -----------------------------------
def _model_run(rank, world, readout, untie, exit_loss, layout):
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    setup_parallel(world)
    prelude, coda = layout
    model_cfg = llama_style(num_layers=2 + prelude + coda, hidden_size=32, num_attention_heads=4,
                            max_position_embeddings=16,
                            untie_embeddings_and_output_weights=untie)
    loop = LoopConfig(num_loops=3, num_prelude_layers=prelude, num_coda_layers=coda,
                      exit_loss=exit_loss, loop_readout=readout,
                      loop_readout_chunk_tokens=5)  # 32 tokens: 6 chunks of 5, one of 2
    model = build_model(model_cfg, loop, VOCAB, tp_size=world)
    if exit_loss == "adaptive-gate":  # Ouro stage II, as the trainer sets it up
        for name, p in model.named_parameters():
            p.requires_grad = name.startswith("exit_gate.")
    ids, pos, labels = lm_batch(VOCAB, 16, 2)
    out = model(ids, pos, None, labels=labels)
    out.objective.mean().backward()
    return (out.objective.detach(), out.step_losses, out.exit_probs, full_grads(model))


def _compare_models(world, untie, exit_loss="expected", layout=(0, 0)):
    ref = run_distributed(_model_run, world, "logits", untie, exit_loss, layout)
    new = run_distributed(_model_run, world, "chunked", untie, exit_loss, layout)
    for (obj1, loss1, p1, g1), (obj2, loss2, p2, g2) in zip(ref, new, strict=True):
        assert (obj1 - obj2).abs().max().item() < 1e-6
        assert torch.allclose(loss1, loss2, atol=1e-6, rtol=0, equal_nan=True)
        assert (p1 is None) == (p2 is None)
        if p1 is not None:
            assert (p1 - p2).abs().max().item() < 1e-6
        assert g1.keys() == g2.keys()
        gate = [k for k in g1 if k.startswith("exit_gate.")]
        assert gate and all(g1[k].abs().max() > 0 for k in gate), "no gate gradient compared"
        for k in g1:
            assert torch.allclose(g1[k], g2[k], atol=1e-6, rtol=1e-5), \
                (k, (g1[k] - g2[k]).abs().max().item())


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("untie", [False, True])
def test_model_chunked_equals_logits(tp, untie):
    _compare_models(tp, untie)


def test_model_chunked_equals_logits_prelude_coda_smoothed():
    _compare_models(1, False, "smoothed", (1, 1))


def test_model_chunked_equals_logits_adaptive_gate():
    # Only the gate trains: the head's function is asked for no gradient at all.
    _compare_models(1, False, "adaptive-gate")


# --- through the trainer: one optimizer step, TP=2 and PP=2 -------------------------------------
# (The trainer refuses sequence parallelism with the local spec on CPU; the head test covers it.)
def _per_step_logits(rank, world):
    """The trainer's 1/T sum_t L_t (smoothed objective, eps 1, beta 0) against the same sum
    built from the logits ``fold`` hands ``on_step`` at every step: values and gradients."""
    from megaloop.model import recurrence
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    setup_parallel(world)
    model_cfg = llama_style(num_layers=3, hidden_size=32, num_attention_heads=4,
                            max_position_embeddings=16)
    loop = LoopConfig(num_loops=3, num_coda_layers=1, exit_loss="smoothed",
                      exit_loss_smoothing=1.0, exit_kl_beta=0.0)
    model = build_model(model_cfg, loop, VOCAB, tp_size=world)
    ids, pos, labels = lm_batch(VOCAB, 16, 2)
    out = model(ids, pos, None, labels=labels)
    out.objective.mean().backward()
    ref = full_grads(model)
    model.zero_grad(set_to_none=True)
    ctx = recurrence.context(model, ids, None, None, read_every_step=True)
    losses = []  # -log P^(t)(label): each step's token log-probabilities, with gradient

    def on_step(t, carry, step_out):
        # (the vocab-parallel cross-entropy overwrites its input: give it a copy)
        losses.append(model.compute_language_model_loss(labels, step_out.logits.clone()))

    recurrence.fold(model, recurrence.begin(model, ids, pos, ctx), ctx, on_step=on_step)
    (torch.stack(losses).mean(0)).mean().backward()
    return out.step_losses, torch.stack(losses).detach(), ref, full_grads(model)


def test_on_step_logits_carry_gradient():
    """What RL needs from one forward: every loop step's log-probabilities of given tokens, with
    gradient, through fold's on_step (at TP=2: vocab-parallel logits)."""
    for steps, mine, ref, grads in run_distributed(_per_step_logits, 2):
        assert torch.allclose(steps, mine, atol=1e-5)
        assert ref.keys() - {n for n in ref if n.startswith("exit_gate.")} <= grads.keys()
        for name, g in grads.items():
            assert torch.allclose(g, ref[name], atol=1e-6), name


def test_trainer_tp2_and_pp2_chunked_equal_logits_tp1():
    from test_pipeline import _check

    base = ["--micro-batch-size", "2", "--loop-readout-chunk-tokens", "24"]
    logits = base + ["--loop-readout", "logits"]
    chunked = base + ["--loop-readout", "chunked"]
    _check(logits, chunked + ["--tensor-model-parallel-size", "2"], 2)
    _check(logits, chunked + ["--pipeline-model-parallel-size", "2"], 2)


def test_validation():
    from megaloop.training.run_config import parse_args

    from test_training import BASE

    for extra, message in ((["--loop-readout-chunk-tokens", "0"], "loop-readout-chunk-tokens"),
                           (["--cross-entropy-loss-fusion", "--loop-readout", "chunked"],
                            "--loop-readout logits")):
        cfg = parse_args(BASE + extra)
        with pytest.raises(ValueError, match=message):
            cfg.validate(world_size=1)
    parse_args(BASE + ["--cross-entropy-loss-fusion", "--loop-readout", "logits"]).validate(
        world_size=1)
