"""megaloop.rl.logprobs: the per-step log-probs of sampled tokens from one fold equal, at every
step t, those of a separate forward run to depth t (log-softmax over the tokenizer's vocabulary
at the sampling temperature, written out here); their gradient equals the sum of the separate
forwards' gradients; the exit distribution equals the training objective's; TP=2 equals TP=1."""

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed, setup_parallel
from flags import llama_style

VOCAB, T, TEMPERATURE = 100, 3, 0.9  # the model pads the output layer to 128 rows
WEIGHTS = [0.2, 0.3, 0.5]


def _check(rank, world):
    from megatron.core import tensor_parallel

    from megaloop.device import current_device
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model
    from megaloop.rl.logprobs import step_log_probs
    from test_placement import check_placement

    check_placement()  # model and tokens on the device, as in the RL trainer
    setup_parallel(world)
    cfg = llama_style(num_layers=2, hidden_size=32, num_attention_heads=4,
                      max_position_embeddings=16)
    model = build_model(cfg, LoopConfig(num_loops=T), VOCAB, tp_size=world)
    model.cuda(current_device())
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(current_device())
    ids, target = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(ids.size(1), device=current_device()).expand_as(ids)
    params = [p for p in model.parameters() if p.requires_grad]

    step_logp, exit_probs = step_log_probs(model, tokens, VOCAB, temperature=TEMPERATURE)
    assert step_logp.shape == (T, 2, 8) and exit_probs.shape == (T, 2, 8)
    weights = torch.tensor(WEIGHTS, device=current_device()).view(-1, 1, 1)
    grads = torch.autograd.grad((weights * step_logp).sum(), params, allow_unused=True)

    want_grads = [torch.zeros_like(p) for p in params]
    for t in range(1, T + 1):
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(
            model(ids, pos, None, num_loops=t))
        logp = F.log_softmax(logits[..., :VOCAB].float() / TEMPERATURE, -1)
        want = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        assert (step_logp[t - 1] - want).abs().max().item() < 1e-5, t
        for acc, g in zip(want_grads, torch.autograd.grad(WEIGHTS[t - 1] * want.sum(), params,
                                                          allow_unused=True)):
            if g is not None:
                acc += g
    for p, g, w in zip(params, grads, want_grads):
        g = torch.zeros_like(p) if g is None else g
        assert torch.allclose(g, w, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        trained = model(ids, pos, None, labels=target, num_loops=T).exit_probs
    assert (exit_probs - trained).abs().max().item() < 1e-6
    assert exit_probs.sum(0).sub(1).abs().max().item() < 1e-5
    return step_logp.detach(), exit_probs


def test_per_step_log_probs_from_one_fold():
    one = run_distributed(_check, 1)[0]
    two = run_distributed(_check, 2)
    for rank in two:
        assert (rank[0] - one[0]).abs().max().item() < 1e-5
        assert (rank[1] - one[1]).abs().max().item() < 1e-6


def test_temperature_must_be_positive():
    from megaloop.rl.logprobs import step_log_probs

    with pytest.raises(ValueError, match="temperature 0"):
        step_log_probs(None, torch.zeros(1, 2, dtype=torch.long), VOCAB, temperature=0)
