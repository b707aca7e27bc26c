"""The batching engine against each request decoded alone: requests of different prompt lengths,
arriving at different steps, decoded together give the tokens (greedy and sampled) and the
logits of each decoded alone outside the engine (a dense cache, no paging), for every KV policy, with and without an exit rule
and with chunked prefill; prompts of one length prefill in one forward; a long prompt's chunks
do not stall the running rows; early exit runs
only the rows still in the loop at each step; cancelled and finished requests free their blocks;
a request that does not fit waits; an oversized one is refused; a pool of exactly one request's
blocks serves it; ``max_batch`` caps the running rows; a cancelled queued request is returned
once without blocks; a row whose draw fails ends alone; seeds and temperatures torch cannot take
are refused by name; the grouped layout forwards together only rows of one cached length."""

import pytest
import torch

from distributed import run_distributed, setup_parallel
from flags import llama_style

VOCAB = 256
V = VOCAB - 6  # the tokenizer's vocabulary (the model's is padded)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24], [30, 31]]
ARRIVE = [0, 1, 1, 3]  # the engine step each request is added before
MAX_TOKENS = [8, 6, 7, 5]


def _model(num_loops=4):
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    # Local layers also on a GPU: the paged layout these tests check needs the padding mask,
    # which Transformer Engine's attention ignores in decode (it gets the grouped layout).
    model_cfg = llama_style(num_layers=4, hidden_size=32, num_attention_heads=4,
                            max_position_embeddings=64, transformer_impl="local")
    loop = LoopConfig(num_loops=num_loops, num_prelude_layers=1, num_coda_layers=1)
    model = build_model(model_cfg, loop, VOCAB, tp_size=1)
    with torch.no_grad():  # exit probabilities spread token by token: rows exit at their own step
        model.exit_gate.linear.weight.mul_(40.0)
    model.eval()
    return model


def _engine(model, policy="full", rule=None, **config):
    from megaloop.inference.early_exit import parse_exit
    from megaloop.inference.engine import EngineConfig, InferenceEngine

    config = {"max_sequence_length": 32, "max_batch": 8, "block_size": 4, **config}
    return InferenceEngine(model, V, kv_policy=policy, exit_rule=rule and parse_exit(rule),
                           config=EngineConfig(**config))


def _params(i, temperature):
    from megaloop.inference.generate import SamplingParams

    return SamplingParams(temperature=temperature, top_k=20 if temperature else 0, seed=i + 1)


def _alone(model, prompt, max_tokens, policy, rule, params):
    """The prompt alone, prefilled in one forward into a dense LoopKVCache and decoded token by
    token outside the engine (``_alone_chunked``): (tokens, log-softmax of each token's logits,
    depths)."""
    return _alone_chunked(model, prompt, max_tokens, policy, rule, params, len(prompt))


def _alone_chunked(model, prompt, max_tokens, policy, rule, params, chunk):
    """The prompt prefilled ``chunk`` tokens per forward into a dense LoopKVCache (no paging, no
    padding), then decoded: under the one-slot and mod-k policies a chunk reads the earlier
    chunks' cached K/V as decoding does, so chunking is part of what is computed."""
    from megaloop.inference import early_exit
    from megaloop.inference.kv_cache import LoopKVCache
    from megaloop.inference.sampling import sample_rows

    rule = rule and early_exit.parse_exit(rule)
    T = model.loop.num_loops
    kv = LoopKVCache(1, len(prompt) + max_tokens, policy)
    seq, out, seen, depths = list(prompt), [], [], []
    while len(out) < max_tokens:
        start = kv.offset
        n = min(chunk, len(prompt) - start) if start < len(prompt) else 1
        ids = torch.tensor([seq[start:start + n]])
        pos = torch.arange(start, start + n).unsqueeze(0)
        causal = torch.ones(n, start + n, dtype=torch.bool).triu(start + 1)[None, None]
        if rule is not None and start >= len(prompt):
            logits, depth = early_exit.decode_step(model, ids, pos, kv, T, rule)
            depths.append(int(depth[0]))
        elif rule is not None:
            logits, _ = early_exit.prefill(model, ids, pos, kv, T, causal, rule=rule)
        else:
            logits = model(ids, pos, causal, num_loops=T, kv_cache=kv)
        kv.advance(n)
        if kv.offset < len(prompt):
            continue
        logits = logits[0, -1, :V].float().unsqueeze(0)
        seen.append(torch.log_softmax(logits[0], -1))
        token = int(sample_rows(logits, [params.temperature], [params.top_k], [params.top_p],
                                [params.seed], [0], [len(out)])[0][0])
        out.append(token)
        seq.append(token)
    return out, torch.stack(seen), depths


def _batched_vs_alone(rank, world, policy, rule, temperature, chunk):
    setup_parallel(world)
    model = _model()
    engine = _engine(model, policy, rule, prefill_chunk=chunk)
    requests, step = [], 0
    while step <= max(ARRIVE) or engine.has_work():
        for i, arrive in enumerate(ARRIVE):
            if arrive == step:
                requests.append(engine.add(PROMPTS[i], MAX_TOKENS[i], _params(i, temperature),
                                           record_logprobs=True))
        engine.step()
        step += 1
    results = []
    for i, r in enumerate(requests):
        params = _params(i, temperature)
        if chunk >= len(r.prompt) or policy == "full":
            out, logp, depths = _alone(model, r.prompt, r.max_tokens, policy, rule, params)
        else:
            out, logp, depths = _alone_chunked(model, r.prompt, r.max_tokens, policy, rule,
                                               params, chunk)
        results.append((r.out, out, (torch.stack(r.logprobs) - logp).abs().max().item(),
                        r.depths[1:], depths, r.finish))
    return results, engine.stats


CASES = [("full", None, 0.0, 256), ("full", None, 1.0, 3), ("full", "q:0.5", 0.0, 3),
         ("last-step", "q:0.5", 1.0, 256), ("last-step", "q:0.5", 0.0, 2),
         ("first-step", None, 1.0, 3), ("first-step", "q:0.5", 0.0, 256),
         ("shared-mod-2", "kl:0.5", 0.0, 256), ("shared-mod-2", "q:0.5", 1.0, 3)]


@pytest.mark.parametrize("policy,rule,temperature,chunk", CASES,
                         ids=[f"{p}-{r}-t{t:g}-chunk{c}" for p, r, t, c in CASES])
def test_batched_equals_alone(policy, rule, temperature, chunk):
    """Staggered requests batched == each alone: tokens, logits within 1e-5, exit depths."""
    results, stats = run_distributed(_batched_vs_alone, 1, policy, rule, temperature, chunk)[0]
    for batched, alone, logit_gap, depths, alone_depths, finish in results:
        assert batched == alone and logit_gap < 1e-5 and depths == alone_depths, \
            (batched, alone, logit_gap, depths, alone_depths)
        assert finish == "length"
    assert stats["decode_rows_max"] > 1  # requests really shared decode forwards
    # Decode forwards over unchanged rows reused the last one's gathered cache.
    assert stats["gathers"] < stats["decode_forwards"] + stats["prefill_forwards"]
    if rule is not None and rule.startswith("q"):
        assert len({d for r in results for d in r[3]}) > 1  # rows exited at different steps
    assert stats["used_blocks"] == 0 and stats["running"] == stats["queued"] == 0


def _prefill_together(rank, world):
    setup_parallel(world)
    model = _model()
    engine = _engine(model, prefill_chunk=64)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12], [40, 41], [13, 14, 15, 16]]
    requests = [engine.add(p, 5, _params(i, 1.0)) for i, p in enumerate(prompts)]
    engine.step()
    first = dict(engine.stats)
    while engine.has_work():
        engine.step()
    alone = [_alone(model, p, 5, "full", None, _params(i, 1.0))[0] for i, p in enumerate(prompts)]
    return first, [r.out for r in requests], alone


def test_prompts_of_one_length_prefill_in_one_forward():
    """Four prompts arriving together, three of length 4 and one of 2: two prefill forwards
    (one per length), and every request's tokens are those it gets alone."""
    first, outs, alone = run_distributed(_prefill_together, 1)[0]
    assert first["prefill_forwards"] == 2 and first["prefill_tokens"] == 14, first
    assert outs == alone


def _no_stall(rank, world):
    setup_parallel(world)
    model = _model()
    engine = _engine(model, prefill_chunk=4, max_sequence_length=48)
    running = [engine.add(p, 20, _params(i, 0.0)) for i, p in enumerate(PROMPTS[:2])]
    while any(r.cached < len(r.prompt) for r in running):  # 3 + 7 prompt tokens, 4 a step
        engine.step()
    long = engine.add(list(range(40, 62)), 3, _params(9, 0.0))  # 22 tokens: 6 chunks of <= 4
    gained, prefilling = [], 0
    while long.cached < len(long.prompt):
        before = [len(r.out) for r in running]
        engine.step()
        gained.append([len(r.out) - b for r, b in zip(running, before)])
        prefilling += 1
    return gained, prefilling, len(long.out)


def test_chunked_prefill_does_not_stall_decoding():
    """While a 22-token prompt is prefilled 4 tokens per step, each running row gets exactly one
    token per step; the long prompt's first token comes with its last chunk, and that step's
    decode forward already takes it in (two tokens)."""
    gained, prefilling, first = run_distributed(_no_stall, 1)[0]
    assert prefilling == 6 and gained == [[1, 1]] * 6 and first == 2, (gained, prefilling)


def _rows_per_step(rank, world):
    setup_parallel(world)
    model = _model()
    from megaloop.model import layer_forward

    calls = []  # (tokens, rows) of every call of the shared core (through the one function the
    # model calls its blocks with, whichever layer forward then computes them)
    call = layer_forward.call

    def counted(block, hidden_states, *args, **kwargs):
        if block is model.core:
            calls.append(tuple(hidden_states.shape[:2]))
        return call(block, hidden_states, *args, **kwargs)

    layer_forward.call = counted
    engine = _engine(model, "full", "q:0.5", prefill_chunk=256)
    requests = [engine.add(p, 6, _params(i, 0.0)) for i, p in enumerate(PROMPTS)]
    observed, expected = [], []
    while engine.has_work():
        calls.clear()
        before = [len(r.depths) for r in requests]
        engine.step()
        # The decode forward's core calls: one token per row (the prompts are longer than one).
        observed.append([rows for tokens, rows in calls if tokens == 1])
        # Its tokens' exit steps: the new depths except a request's first (from its prefill).
        depths = [d for r, b in zip(requests, before) for j, d in enumerate(r.depths)
                  if j >= b and j > 0]
        expected.append([n for n in (sum(d >= t for d in depths) for t in range(1, 5)) if n])
    return observed, expected


def test_early_exit_runs_only_the_rows_still_in_the_loop():
    """The rows entering loop step t of each decode forward (counted at the core's input) are
    those whose exit step is >= t, across requests."""
    observed, expected = run_distributed(_rows_per_step, 1)[0]
    assert observed == expected, (observed, expected)
    assert any(len(set(step)) > 1 for step in observed)  # some rows left before step T


def _cancel_and_queue(rank, world):
    setup_parallel(world)
    model = _model()
    result = {}
    engine = _engine(model)
    total = engine.allocator.num_blocks
    a, b = engine.add(PROMPTS[0], 10, _params(0, 0.0)), engine.add(PROMPTS[1], 10, _params(1, 0.0))
    engine.step()
    engine.step()
    engine.cancel(a)
    done = engine.step()
    result["cancel"] = (done == [a], a.finish, engine.allocator.free,
                        total - engine.allocator.blocks_for(len(b.prompt) + 10), len(a.out))
    engine.cancel(b)
    engine.step()
    result["all_free"] = engine.allocator.free == total and not engine.has_work()
    # A pool of 5 blocks of 4: a request of 3 + 10 tokens takes 4, so a second one waits.
    engine = _engine(model, num_blocks=5)
    first, second = (engine.add(PROMPTS[i], 10, _params(i, 0.0)) for i in (0, 2))
    steps, first_done = 0, None
    while second.cached == 0 and steps < 30:  # (bounded: a pool that never frees must fail)
        engine.step()
        steps += 1
        if first.finish is not None and first_done is None:
            first_done = steps
    result["queued"] = (first_done, steps, len(first.out), first.finish)
    while engine.has_work():
        engine.step()
    alone = _alone(model, PROMPTS[2], 10, "full", None, _params(2, 0.0))[0]
    result["second"] = (second.out == alone, second.finish)
    try:
        engine.add(list(range(30)), 3, _params(0, 0.0))
    except ValueError as error:
        result["refused"] = str(error)
    return result


def test_cancel_frees_blocks_and_a_full_pool_queues():
    r = run_distributed(_cancel_and_queue, 1)[0]
    at_once, finish, free, expected_free, tokens = r["cancel"]
    # Two tokens in the first step (the prefill's and a decode), one in the second; none after
    # the cancel: only the other request's blocks are taken.
    assert at_once and finish == "cancelled" and free == expected_free and tokens == 3
    assert r["all_free"]
    first_done, admitted, first_tokens, first_finish = r["queued"]
    # The first's 10 tokens take 9 steps (two in the first); the second is admitted (and
    # prefilled) in the step after, not before: it waited instead of failing.
    assert (first_done, admitted, first_tokens, first_finish) == (9, 10, 10, "length")
    assert r["second"] == (True, "length")
    assert r["refused"] == ("a prompt of 30 tokens plus max_tokens 3 is 33 tokens, over the "
                            "engine's --max-sequence-length 32; shorten the prompt or max_tokens")


def _stops(rank, world):
    from megaloop.inference.engine import EngineConfig, InferenceEngine

    setup_parallel(world)
    model = _model()
    # A prompt whose greedy continuation has a token at k >= 1 not seen before it: that token
    # is made EOD, so the request ends right there.
    for prompt in PROMPTS:
        greedy = _alone(model, prompt, 6, "full", None, _params(0, 0.0))[0]
        firsts = [k for k in range(1, 6) if greedy[k] not in greedy[:k]]
        if firsts:
            break
    k = firsts[0]
    engine = InferenceEngine(model, V, eod=greedy[k], config=EngineConfig(max_sequence_length=32))

    def hook(request, token):
        if len(request.out) == 2:
            raise ConnectionError("client gone")

    at_eod = engine.add(prompt, 6, _params(0, 0.0))
    past_eod = engine.add(prompt, 6, _params(0, 0.0), ignore_eos=True)
    said_stop = engine.add(prompt, 6, _params(0, 0.0), on_token=lambda r, t: len(r.out) == 1)
    raised = engine.add(prompt, 6, _params(0, 0.0), on_token=hook)
    while engine.has_work():
        engine.step()
    return greedy, k, [(r.out, r.finish, type(r.error).__name__) for r in
                    (at_eod, past_eod, said_stop, raised)], engine.allocator.used


def test_eod_ignore_eos_and_on_token_end_a_request():
    """EOD ends a request ("stop", EOD kept) unless ignore_eos; on_token returning True ends it
    ("stop"); one raising cancels only its own request, which carries the error; all blocks come
    back."""
    greedy, k, (at_eod, past_eod, said_stop, raised), used = run_distributed(_stops, 1)[0]
    assert at_eod == (greedy[:k + 1], "stop", "NoneType")
    assert past_eod == (greedy, "length", "NoneType")
    assert said_stop == (greedy[:1], "stop", "NoneType")
    assert raised == (greedy[:2], "cancelled", "ConnectionError") and used == 0


def _recompute(model, prompt, max_tokens, params):
    """The prompt decoded with no cache at all: the whole sequence through the model for every
    token, sampled from stream 0 of the request's seed."""
    from megaloop.device import current_device
    from megaloop.inference.sampling import sample_rows

    seq, out = list(prompt), []
    while len(out) < max_tokens:
        ids = torch.tensor([seq], device=current_device())  # where the model is
        positions = torch.arange(len(seq), device=current_device())[None]
        logits = model(ids, positions, None, num_loops=model.loop.num_loops)
        logits = logits[0, -1, :V].float()[None]
        token = int(sample_rows(logits, [params.temperature], [params.top_k], [params.top_p],
                                [params.seed], [0], [len(out)])[0][0])
        out.append(token)
        seq.append(token)
    return out


def _run_arrivals(engine, temperature):
    requests, step = [], 0
    while step <= max(ARRIVE) or engine.has_work():
        for i, arrive in enumerate(ARRIVE):
            if arrive == step:
                requests.append(engine.add(PROMPTS[i], MAX_TOKENS[i], _params(i, temperature)))
        engine.step()
        step += 1
    return requests


def _other_layouts(rank, world):
    from megaloop.inference.engine import EngineConfig, InferenceEngine
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model
    from megaloop.device import current_device
    from test_placement import check_placement

    check_placement()  # as on a GPU: the model and caches on the device, the batches moved there
    setup_parallel(world)
    model = _model().cuda(current_device())
    spiral = build_model(llama_style(num_layers=2, hidden_size=32, num_attention_heads=4,
                                     max_position_embeddings=64, transformer_impl="local"),
                         LoopConfig(num_loops=2, loop_resolutions="1/2,1"), VOCAB)
    spiral = spiral.cuda(current_device()).eval()
    report = {}
    for name, m, policy in (("none", model, "none"), ("spiral", spiral, "full"),
                            ("grouped", model, "full")):
        for temperature in (0.0, 1.0):
            engine = _engine(m, policy)
            if name == "grouped":  # what Transformer Engine's attention gets: rows of one length
                engine.layout = "grouped"
            masks = []
            hook = m.register_forward_pre_hook(  # (a mask given, rows at different positions)
                lambda mod, args: masks.append((args[2] is not None,
                                                len(set(args[1][:, 0].tolist())) > 1)))
            try:
                requests = _run_arrivals(engine, temperature)
            finally:
                hook.remove()
            expected = [_recompute(m, PROMPTS[i], MAX_TOKENS[i], _params(i, temperature))
                        for i in range(len(PROMPTS))]
            report[name, temperature] = ([r.out for r in requests] == expected, engine.layout,
                                         any(m for m, _ in masks), any(u for _, u in masks))
    refused = []
    learned = build_model(llama_style(num_layers=2, hidden_size=32, num_attention_heads=4,
                                      max_position_embeddings=64, transformer_impl="local",
                                      position_embedding_type="learned_absolute"),
                          LoopConfig(num_loops=2), VOCAB)
    for make in (lambda: InferenceEngine(learned, V, config=EngineConfig(max_sequence_length=100)),
                 lambda: _engine(spiral, "full", speculate="1:2"),
                 lambda: _engine(model, "none", prefill_chunk=4).add(PROMPTS[1], 2)):
        try:
            make()
        except ValueError as error:
            refused.append(str(error))
    return report, refused


def test_other_layouts_decode_as_recomputation():
    """kv_policy none and SpiralFormer decode each request over its own cache (or none), and the
    grouped layout (Transformer Engine's) forwards rows of one cached length with no mask: each
    gives the tokens of recomputing the whole sequence per token, greedy and sampled, for
    requests of four prompt lengths arriving at different steps. What they cannot take is
    refused by name."""
    report, refused = run_distributed(_other_layouts, 1)[0]
    for (name, temperature), (equal, layout, masked, uneven) in report.items():
        assert equal and layout == {"none": "private", "spiral": "private"}.get(name, "grouped")
        # no forward had a mask or rows at different positions (which would need one)
        assert not masked and not uneven, (name, masked, uneven)
    assert len(refused) == 3, refused
    positions, speculate, chunk = refused
    assert positions.startswith("--max-sequence-length 100 exceeds the model's")
    assert speculate.startswith("--speculate 1:2: its multi-token verify reads a masked, paged")
    assert "prefills a prompt in one forward, and --prefill-chunk is 4" in chunk


GROUPED_PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43], [70, 71, 72, 73]]  # one length
GROUPED_ARRIVE = [0, 0, 1]
GROUPED_TOKENS = 6


def _grouped_rows(rank, world):
    setup_parallel(world)
    # float64: the engine and the dense decode then differ by rounding of order 1e-16
    # relative, far below the fp32 ulp both cast their logits to (the test's tolerance).
    model = _model().double()
    engine = _engine(model)
    engine.layout = "grouped"  # what Transformer Engine's attention gets (test above)
    forwards = []  # per model call: (rows, distinct first positions, a mask given)
    hook = model.register_forward_pre_hook(lambda mod, args: forwards.append(
        (args[0].size(0), len(set(args[1][:, 0].tolist())), args[2] is not None)))
    requests, step = [], 0
    try:
        while step <= max(GROUPED_ARRIVE) or engine.has_work():
            for i, arrive in enumerate(GROUPED_ARRIVE):
                if arrive == step:
                    requests.append(engine.add(GROUPED_PROMPTS[i], GROUPED_TOKENS,
                                               _params(i, 0.0), record_logprobs=True))
            engine.step()
            step += 1
    finally:
        hook.remove()
    results = []
    for i, r in enumerate(requests):
        out, logp, _ = _alone(model, r.prompt, GROUPED_TOKENS, "full", None, _params(i, 0.0))
        results.append((r.out, out, (torch.stack(r.logprobs) - logp).abs().max().item(),
                        logp.abs().max().item(), r.finish))
    return results, forwards


def test_grouped_layout_batches_rows_of_one_cached_length_only():
    """Under the grouped layout (no mask), two requests of one prompt length arriving together
    share their forwards; a third of the same length arriving one step later is one token
    behind them from then on, so it must be forwarded apart (batched with them, unmasked, it
    would read their extra cache column as its own). Each request, greedy, gives the tokens of
    decoding it alone over a dense cache, and its logprobs within 4 fp32 ulps of the largest:
    both sides compute in float64 and cast the logits to fp32 before the log-softmax, so they
    differ by at most an ulp of rounding in the cast, moving the log-softmax by about two."""
    results, forwards = run_distributed(_grouped_rows, 1)[0]
    for batched, alone, gap, scale, finish in results:
        tolerance = 4 * scale * torch.finfo(torch.float32).eps
        assert batched == alone and gap <= tolerance, (batched, alone, gap, tolerance)
        assert finish == "length"
    # the first two shared forwards, and no forward mixed positions or had a mask
    assert max(rows for rows, _, _ in forwards) == 2, forwards
    assert all(positions == 1 and not masked for _, positions, masked in forwards), forwards


# --- admission, queueing and faults -------------------------------------------------------------
def _one_request_pool(rank, world):
    setup_parallel(world)
    model = _model()
    prompt, max_tokens = PROMPTS[1], 9  # 7 + 9 = 16 tokens: exactly 4 blocks of 4
    engine = _engine(model, num_blocks=4)
    request = engine.add(prompt, max_tokens, _params(1, 1.0))
    steps = 0
    while engine.has_work() and steps < 3 * max_tokens:  # bounded: a starved request must fail
        engine.step()
        steps += 1
    alone = _alone(model, prompt, max_tokens, "full", None, _params(1, 1.0))[0]
    return request.out == alone, request.finish, steps, engine.has_work(), engine.allocator.free


def test_a_pool_of_exactly_one_request_admits_and_finishes_it():
    """A pool with exactly the blocks one request needs: it is admitted at once and decodes as
    alone (an allocator that wants a spare block would queue it forever, with work left)."""
    same, finish, steps, has_work, free = run_distributed(_one_request_pool, 1)[0]
    # 9 tokens: the prefill's and a decode in the first step, then one per step
    assert (same, finish, steps, has_work, free) == (True, "length", 8, False, 4)


def _max_batch_two(rank, world):
    setup_parallel(world)
    model = _model()
    engine = _engine(model, max_batch=2)
    requests = [engine.add(p, MAX_TOKENS[i], _params(i, 0.0)) for i, p in enumerate(PROMPTS)]
    seen, steps = [], 0
    while engine.has_work() and steps < 60:
        engine.step()
        steps += 1
        seen.append((engine.stats["running"], engine.stats["queued"],
                     sum(r.cached > 0 and r.finish is None for r in requests)))
    alone = [_alone(model, p, MAX_TOKENS[i], "full", None, _params(i, 0.0))[0]
             for i, p in enumerate(PROMPTS)]
    return seen, [r.out for r in requests], alone, engine.stats["decode_rows_max"]


def test_max_batch_two_runs_two_rows_and_queues_the_rest():
    """max_batch 2, four requests: after the first step 2 run and 2 wait; never 3 at once, in
    the engine's counters or in the requests' own state; each answers as alone."""
    seen, outs, alone, rows_max = run_distributed(_max_batch_two, 1)[0]
    assert seen[0] == (2, 2, 2), seen
    assert all(running <= 2 and decoding <= 2 for running, _, decoding in seen), seen
    assert rows_max == 2 and outs == alone


def _cancel_queued(rank, world):
    setup_parallel(world)
    model = _model()
    engine = _engine(model, max_batch=1)
    first, queued, third = (engine.add(PROMPTS[i], 4, _params(i, 0.0)) for i in (0, 1, 2))
    returned = list(engine.step())
    engine.cancel(queued)
    used_with_first = engine.allocator.used
    steps, admitted_at = 1, None
    while engine.has_work() and steps < 30:
        returned += engine.step()
        steps += 1
        if third.blocks and admitted_at is None:
            admitted_at = (steps, first.finish)
    alone = _alone(model, PROMPTS[2], 4, "full", None, _params(2, 0.0))[0]
    return ([r is queued for r in returned].count(True), queued.finish, queued.out,
            queued.blocks, queued.cached, used_with_first, admitted_at, third.out == alone,
            engine.allocator.used)


def test_a_cancelled_queued_request_is_returned_once_and_takes_no_blocks():
    """max_batch 1: the second of three requests is cancelled while it waits. The next step
    returns it once (finish cancelled, nothing generated, no blocks); the third is admitted as
    soon as the first is done, and answers as alone."""
    times, finish, out, blocks, cached, used, admitted_at, same, used_after = run_distributed(
        _cancel_queued, 1)[0]
    assert (times, finish, out, blocks, cached) == (1, "cancelled", [], [], 0)
    assert used == 2  # the first request's 3 + 4 tokens only
    # the first's 4 tokens take 3 steps (two in the first); the third comes in the step after
    assert admitted_at == (4, "length") and same and used_after == 0


def _sampling_fault(rank, world):
    from megaloop.inference.generate import SamplingParams

    setup_parallel(world)
    model = _model()
    engine = _engine(model)
    requests = [engine.add(p, MAX_TOKENS[i], _params(i, 1.0)) for i, p in enumerate(PROMPTS)]
    # A value the checks in add() refuse, set after them: its logits / temperature overflow
    # to inf and the draw fails (as any fault in one row's sampling would).
    requests[1].params = SamplingParams(temperature=1e-45, seed=2)
    steps = 0
    while engine.has_work() and steps < 40:
        engine.step()
        steps += 1
    alone = [_alone(model, p, MAX_TOKENS[i], "full", None, _params(i, 1.0))[0]
             for i, p in enumerate(PROMPTS)]
    return ([(r.out, r.finish, repr(r.error)) for r in requests], alone, engine.allocator.used,
            engine.has_work())


def test_a_row_whose_sampling_fails_ends_alone():
    """A row whose draw raises (NaN probabilities) is cancelled with the error; the step does
    not fail, and every other row answers as alone."""
    rows, alone, used, has_work = run_distributed(_sampling_fault, 1)[0]
    out, finish, error = rows[1]
    assert out == [] and finish == "cancelled" and "cannot sample this row" in error, rows[1]
    for i in (0, 2, 3):
        assert rows[i][:2] == (alone[i], "length"), (i, rows[i], alone[i])
    assert used == 0 and not has_work


def _refused_values(rank, world):
    from megaloop.inference.generate import SamplingParams

    setup_parallel(world)
    engine = _engine(_model())

    reasons = []
    for params in (SamplingParams(seed=2 ** 64), SamplingParams(seed=-2 ** 63 - 1),
                   SamplingParams(temperature=1e-45), SamplingParams(temperature=float("inf"))):
        try:
            engine.add([5, 6], 2, params)
        except ValueError as error:
            reasons.append(str(error))
    engine.add([5, 6], 2, SamplingParams(seed=2 ** 64 - 1))  # the extremes torch takes
    engine.add([5, 6], 2, SamplingParams(seed=-2 ** 63))
    return reasons


def test_values_a_generator_or_softmax_cannot_take_are_refused_by_name():
    reasons = run_distributed(_refused_values, 1)[0]
    assert len(reasons) == 4, reasons
    assert reasons[0].startswith("seed 18446744073709551616: must be an integer from "
                                 "-9223372036854775808 to 18446744073709551615")
    assert reasons[1].startswith("seed -9223372036854775809: must be an integer")
    assert reasons[2].startswith("temperature 1e-45: too small to sample with")
    assert reasons[3].startswith("temperature inf: must be finite")
