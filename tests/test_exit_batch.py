"""Early exit in generation, decided per token and per row alone:

- the first generated token follows the exit rule: its log-probabilities are those teacher-forced
  scoring under the same rule gives the last prompt position (``early_exit.exit_log_probs``, which
  runs the prompt without any cache), not the last step's;
- a batch of prompts of different lengths decodes under ``--exit`` through ``Generator`` exactly
  as each prompt alone (tokens, logits and executed depths): a prompt runs all T steps as
  prefill, never the decode path's early exit.
"""

import pytest
import torch

from distributed import run_distributed, setup_parallel
from megaloop.device import current_device
from test_inference import VOCAB, _model, _sharp_gate
from test_placement import check_placement

PROMPTS = [[5, 6], [9, 10, 11, 12, 13, 14, 15], [17, 18, 19, 20, 21]]
MAX_TOKENS = 5
V = VOCAB - 6
LOOP = {"num_loops": 4, "num_coda_layers": 1, "num_prelude_layers": 1}


def _build():
    model = _model({}, LOOP)
    _sharp_gate(model)
    model.eval()
    return model


def _generator_batch_vs_alone(rank, world, rule_text):
    check_placement()  # as on a GPU: model and cache on the device, prompts moved there
    from megaloop.inference.early_exit import parse_exit
    from megaloop.inference.generate import Generator, SamplingParams

    setup_parallel(world)
    model = _build()
    rule = parse_exit(rule_text)
    params = SamplingParams()  # greedy: Generator draws a whole batch's samples at once
    gen = Generator(model, V, num_loops=4, exit_rule=rule, record_logprobs=True)
    batched = gen.generate(PROMPTS, MAX_TOKENS, params)
    batched_logp = [r.logprobs for r in gen.requests]
    alone, alone_logp, alone_depths = [], [], []
    for prompt in PROMPTS:
        one = Generator(model, V, num_loops=4, exit_rule=rule, record_logprobs=True)
        alone += one.generate([prompt], MAX_TOKENS, params)
        alone_logp.append(one.requests[0].logprobs)
        alone_depths.append(one.depths)
    gap = max((a - b).abs().max().item() for row_a, row_b in zip(batched_logp, alone_logp)
              for a, b in zip(row_a, row_b))
    return batched, alone, gap, alone_depths


@pytest.mark.parametrize("rule", ["q:0.5", "kl:0.5"])
def test_generator_mixed_prompt_lengths_decode_as_each_alone(rule):
    batched, alone, gap, depths = run_distributed(_generator_batch_vs_alone, 1, rule)[0]
    assert batched == alone
    assert gap < 1e-5, gap
    # The rule really exits early somewhere (else the test could not tell the paths apart).
    assert any(d < 4 for row in depths for d in row), depths


def _first_token(rank, world, rule_text):
    """Per prompt: the log-probs Generator and the engine draw the first token from, the
    teacher-forced log-probs of the last prompt position under the rule and at step T, and the
    rule's step there."""
    check_placement()
    from megaloop.inference.early_exit import exit_log_probs, parse_exit
    from megaloop.inference.engine import EngineConfig, InferenceEngine
    from megaloop.inference.generate import Generator, SamplingParams

    setup_parallel(world)
    model = _build()
    rule = parse_exit(rule_text)
    engine = InferenceEngine(model, V, exit_rule=rule, config=EngineConfig(
        max_sequence_length=16, max_batch=4, block_size=4, prefill_chunk=3))
    requests = [engine.add(p, 1, SamplingParams(), record_logprobs=True) for p in PROMPTS]
    while engine.has_work():
        engine.step()
    rows = []
    for prompt, request in zip(PROMPTS, requests):
        gen = Generator(model, V, num_loops=4, exit_rule=rule, record_logprobs=True)
        gen.generate([prompt], 1)
        ids = torch.tensor([prompt], device=current_device())  # where the model is
        pos = torch.arange(len(prompt), device=current_device()).unsqueeze(0)
        with torch.no_grad():
            ruled, depth = exit_log_probs(model, ids, pos, 4, rule, V)
            full, _ = exit_log_probs(model, ids, pos, 4, None, V)
        rows.append((gen.requests[0].logprobs[0], request.logprobs[0], ruled[0, -1], full[0, -1],
                     int(depth[0, -1]), request.depths[0]))
    return rows


@pytest.mark.parametrize("rule", ["q:0.5", "kl:0.5"])
def test_first_generated_token_follows_the_exit_rule(rule):
    rows = run_distributed(_first_token, 1, rule)[0]
    for generator, engine, ruled, full, depth, recorded in rows:
        assert recorded == depth  # the engine records the step the first token was read at
        assert (generator - ruled).abs().max() < 1e-5
        assert (engine - ruled).abs().max() < 1e-5
        if depth < 4:  # read before step T: not the full-depth distribution
            assert (generator - full).abs().max() > 1e-3
    assert any(row[-2] < 4 for row in rows), [row[-2] for row in rows]
