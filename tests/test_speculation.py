"""Self-speculative decoding (``--speculate d:k``) against decoding at full depth.

- greedy: requests arriving at different steps decode the same tokens with and without
  speculation, at every draft depth d < T, and drafts are both kept and rejected (so both
  branches of the rule ran);
- sampling: the token after a speculative round's first draft is distributed as depth-T
  sampling: over 2400 seeds, for each first token x1 the counts of the second token x2 match
  p(x2 | prompt, x1), computed here by a teacher-forced full-depth forward with the same top-k,
  by a chi-square test at the 0.1% level; the same test rejects the draft distribution q (the
  depth-d model's), so it can tell the two apart; and the drafts kept number
  sum over requests of sum_x min(p(x), q(x)) within 4 standard deviations (the rule's rate);
- at TP=2 greedy speculation gives plain decoding's tokens and both ranks sample alike;
- every draft's logits are the depth-d model's over the row's whole sequence, uncached (the
  coda's cache at step d holds the prompt and the kept tokens);
- a row whose probabilities break mid-round ends in that round, alone, with no token past the
  fault; the others decode on;
- what speculation cannot do is refused by name.

The rank bodies run under the CPU shim's placement check.
"""

import torch

from distributed import run_distributed, setup_parallel
from flags import llama_style
from test_placement import check_placement

VOCAB = 256
V = VOCAB - 6
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24], [30, 31]]
ARRIVE = [0, 1, 1, 3]


def _model(tp=1):
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    model_cfg = llama_style(num_layers=4, hidden_size=32, num_attention_heads=4,
                            max_position_embeddings=64, transformer_impl="local",
                            norm_scheme="pre")
    loop = LoopConfig(num_loops=4, num_prelude_layers=1, num_coda_layers=1)
    model = build_model(model_cfg, loop, VOCAB, tp_size=tp)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # (pre-norm: the shallow model's drafts are often, not always, right)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    from megaloop.device import current_device

    return model.cuda(current_device()).eval()  # as a GPU run (the placement check)


def _engine(model, speculate="", **config):
    from megaloop.inference.engine import EngineConfig, InferenceEngine

    config = {"max_sequence_length": 40, "max_batch": 64, "block_size": 4, **config}
    return InferenceEngine(model, V, config=EngineConfig(speculate=speculate, **config))


def _staggered(engine, max_tokens, params):
    requests, step = [], 0
    while step <= max(ARRIVE) or engine.has_work():
        for i, arrive in enumerate(ARRIVE):
            if arrive == step:
                requests.append(engine.add(PROMPTS[i], max_tokens, params))
        engine.step()
        step += 1
    return [r.out for r in requests]


def _greedy(rank, world):
    check_placement()  # the batch and the drafts go where the model is, as on a GPU
    from megaloop.inference.generate import SamplingParams

    setup_parallel(world)
    model = _model()
    plain = _staggered(_engine(model), 16, SamplingParams())
    results = {}
    for spec in ("1:3", "2:3", "3:2", "2:8"):
        engine = _engine(model, spec)
        results[spec] = (_staggered(engine, 16, SamplingParams()), engine.stats["drafted"],
                         engine.stats["accepted"])
    return plain, results


def test_greedy_speculation_decodes_the_full_depth_tokens():
    plain, results = run_distributed(_greedy, 1)[0]
    for spec, (outs, drafted, accepted) in results.items():
        assert outs == plain, (spec, outs, plain)
        assert 0 < accepted < drafted, (spec, accepted, drafted)


def _tensor_parallel(rank, world):
    check_placement()  # the batch and the drafts go where the model is, as on a GPU
    from megaloop.inference.generate import SamplingParams

    setup_parallel(world)
    model = _model(world)
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=5)
    return (_staggered(_engine(model), 12, SamplingParams()),
            _staggered(_engine(model, "2:3"), 12, SamplingParams()),
            _staggered(_engine(model, "2:3"), 12, sampled))


def test_speculation_under_tensor_parallelism():
    """TP=2: greedy speculation gives the ranks' plain greedy tokens, and both ranks draw the
    same sampled tokens (no broadcast: the same logits and streams on each)."""
    ranks = run_distributed(_tensor_parallel, 2)
    plain, greedy, sampled = ranks[0]
    assert greedy == plain and ranks[1] == ranks[0]
    assert all(len(out) == 12 for out in sampled)


def _draft_logits(rank, world, spec):
    check_placement()  # the batch and the drafts go where the model is, as on a GPU
    from megaloop.device import current_device
    from megaloop.inference import engine as engine_module, speculation
    from megaloop.inference.generate import SamplingParams

    setup_parallel(world)
    # float64: the cached draft and the uncached forward then differ by rounding of order 1e-16
    # relative, far below the fp32 ulp both logits are cast to (the test's tolerance)
    model = _model().double()
    d = int(spec.split(":")[0])
    gaps, rounds = [], []
    seqs = []  # per row of the round: its tokens up to the position being drafted from

    def round_(engine, requests, k):
        seqs[:] = [r.prompt + r.out for r in requests]
        rounds.append(k)
        return speculate_round(engine, requests, k)

    def logits(model, ids, positions, mask, num_loops, kv, vocab_size, **kwargs):
        out = forward(model, ids, positions, mask, num_loops, kv, vocab_size, **kwargs)
        if num_loops != d:  # the verify
            return out
        for i, seq in enumerate(seqs):
            if positions[i, 0] == len(seq):  # a draft fed: it follows the row
                seq.append(int(ids[i, 0]))
            whole = torch.tensor([seq], device=current_device())
            at = torch.arange(len(seq), device=current_device())[None]
            alone = model(whole, at, None, num_loops=d)[0, -1, :vocab_size].float()
            gaps.append(((out[i, -1] - alone).abs().max().item(), alone.abs().max().item()))
        return out

    speculate_round, forward = engine_module.speculate_round, speculation._logits
    engine_module.speculate_round, speculation._logits = round_, logits
    try:
        outs = _staggered(_engine(model, spec), 12, SamplingParams(temperature=0.8, seed=3))
    finally:
        engine_module.speculate_round, speculation._logits = speculate_round, forward
    return gaps, len(rounds), outs


def test_drafts_are_the_depth_d_model():
    """Every draft forward's logits, for every row and round, are those of the first d loop
    steps run over the row's whole sequence without a cache: the coda's cache at step d holds
    the prompt and every kept token (the prefill and the verify, whose output is step T's,
    fill it too). Both sides compute in float64 and cast to fp32, so they may differ by an
    ulp of the cast: the bound is 2 fp32 ulps of the largest logit."""
    ulp = torch.finfo(torch.float32).eps
    for spec in ("2:3", "1:2"):
        gaps, rounds, outs = run_distributed(_draft_logits, 1, spec)[0]
        assert rounds > 3 and len(gaps) > 3 * rounds, (spec, rounds, len(gaps))
        bad = [(gap, scale) for gap, scale in gaps if not gap <= 2 * ulp * scale]  # (NaN too)
        assert not bad, (spec, len(bad), len(gaps), bad[:5])


N, TOP_K, TEMP = 2400, 4, 0.4
PROMPT = [40, 41, 42, 43]


def _sampled(rank, world, spec):
    check_placement()  # the batch and the drafts go where the model is, as on a GPU
    from megaloop.device import current_device
    from megaloop.inference.generate import SamplingParams
    from megaloop.inference.sampling import probabilities

    setup_parallel(world)
    model = _model()
    engine = _engine(model, spec, max_sequence_length=8)
    requests = [engine.add(PROMPT, 3, SamplingParams(temperature=TEMP, top_k=TOP_K, seed=s))
                for s in range(N)]
    while engine.has_work():
        engine.step()
    pairs = [tuple(r.out[:2]) for r in requests]
    d = int(spec.split(":")[0])
    exact = {}
    with torch.no_grad():
        for x1 in sorted({a for a, _ in pairs}):
            ids = torch.tensor([PROMPT + [x1]], device=current_device())  # where the model is
            pos = torch.arange(ids.size(1), device=current_device()).unsqueeze(0)
            for depth in (4, d):
                logits = model(ids, pos, None, num_loops=depth)[0, -1, :V].float()
                exact[(x1, depth)] = probabilities(logits[None], [TEMP], [TOP_K], [1.0])[0][0]
    return pairs, exact, engine.stats["drafted"], engine.stats["accepted"]


def _chi_square(pairs, exact, depth):
    """Pearson's statistic of the x2 counts against p(x2 | x1) at ``depth``, over the x1
    groups, and its degrees of freedom (cells with expected count >= 5; the rest pooled)."""
    stat, df = 0.0, 0
    for x1 in sorted({a for a, _ in pairs}):
        group = [b for a, b in pairs if a == x1]
        p = exact[(x1, depth)]
        if len(group) < 20:
            continue
        cells = [(t, len(group) * p[t].item()) for t in range(V) if p[t] > 0]
        big = [(t, e) for t, e in cells if e >= 5]
        rest = sum(e for t, e in cells if e < 5)
        observed = {t: group.count(t) for t in set(group)}
        for t, e in big:
            stat += (observed.get(t, 0) - e) ** 2 / e
        small = len(group) - sum(observed.get(t, 0) for t, _ in big)
        if rest > 0:
            stat += (small - rest) ** 2 / rest
        elif small:
            stat += float("inf")  # a token outside the support
        df += len(big) + (rest > 0) - 1
    return stat, df


def test_sampled_speculation_keeps_the_full_depth_distribution():
    from scipy.stats import chi2

    pairs, exact, drafted, accepted = run_distributed(_sampled, 1, "1:1")[0]
    # every request drafted once; a draft is kept with probability sum_x min(p(x), q(x))
    assert drafted == N
    rates = [torch.minimum(exact[(x1, 4)], exact[(x1, 1)]).sum().item() for x1, _ in pairs]
    expected, sd = sum(rates), sum(a * (1 - a) for a in rates) ** 0.5
    assert 0.1 * N < expected < 0.95 * N, expected  # both outcomes are common
    assert abs(accepted - expected) < 4 * sd, (accepted, expected, sd)
    stat, df = _chi_square(pairs, exact, 4)
    assert df >= 6 and stat < chi2.ppf(0.999, df), (stat, df)
    # the draft model's distribution is told apart by the same test
    stat_q, df_q = _chi_square(pairs, exact, 1)
    assert stat_q > chi2.ppf(0.999, df_q), (stat_q, df_q)


def _refusals(rank, world):
    from megaloop.inference.early_exit import parse_exit
    from megaloop.inference.engine import EngineConfig, InferenceEngine

    setup_parallel(world)
    model = _model()
    reasons = []
    for kw, spec in (({}, "4:2"), ({}, "2"), ({}, "0:2"), ({"kv_policy": "last-step"}, "2:2"),
                     ({"exit_rule": parse_exit("q:0.5")}, "2:2")):
        try:
            InferenceEngine(model, V, config=EngineConfig(speculate=spec), **kw)
        except ValueError as error:
            reasons.append(str(error))
    return reasons


def test_what_speculation_cannot_do_is_refused_by_name():
    reasons = run_distributed(_refusals, 1)[0]
    assert len(reasons) == 5, reasons
    assert reasons[0].startswith("--speculate 4:2: the draft depth 4 must be below the "
                                 "decoding depth 4")
    assert reasons[1].startswith("--speculate '2': give d:k")
    assert reasons[2].startswith("--speculate 0:2: the draft depth and the drafted tokens")
    assert reasons[3].startswith("--speculate 2:2 needs --kv-policy full")
    assert reasons[4].startswith("--speculate 2:2 and --exit: choose one")


FAULT_TOKENS = 12


def _fault_rows(rank, world, spec):
    check_placement()  # the batch and the drafts go where the model is, as on a GPU
    from megaloop.inference.generate import SamplingParams

    setup_parallel(world)
    model = _model()
    # Rows 0 to 2 greedy, row 3 sampled: a round mixes both. A sampled row is not compared
    # with itself alone: a round's k is the least room of its rows, so near a batch-mate's end
    # its draws take other roles (its distribution stays depth T's).
    params = [SamplingParams()] * 3 + [SamplingParams(temperature=1.0, seed=9)]
    engine = _engine(model, spec)
    requests = [engine.add(p, FAULT_TOKENS, params[i]) for i, p in enumerate(PROMPTS)]
    engine.step()  # the prefill's token and a first round, sound
    bad = requests[1]
    before = list(bad.out)
    # A value add() refuses, set after its checks: the row's logits / temperature overflow to
    # inf, so its probabilities in the next round's draft and verify are not finite.
    bad.params = SamplingParams(temperature=1e-45, seed=2)
    drafted = engine.stats["drafted"]
    ended = engine.step()
    fault = (bad in ended, engine.stats["drafted"] > drafted)
    while engine.has_work():
        engine.step()
    used = engine.allocator.used
    alone = []  # greedy, each prompt alone without speculation: the full-depth tokens
    for p in PROMPTS:
        single = _engine(model)
        request = single.add(p, FAULT_TOKENS, SamplingParams())
        while single.has_work():
            single.step()
        alone.append(request.out)
    return [(r.out, r.finish, repr(r.error)) for r in requests], before, fault, alone, used


def test_a_row_whose_probabilities_break_ends_alone_within_the_round():
    """--speculate: a row whose temperature makes its probabilities non-finite is ended by the
    round it breaks in, with the error and no token past the ones it had (which are its
    full-depth tokens); the greedy rows give the tokens of decoding them alone without
    speculation, the sampled one all its tokens, and every block comes back."""
    for spec in ("2:3", "1:2"):
        rows, before, fault, alone, used = run_distributed(_fault_rows, 1, spec)[0]
        out, finish, error = rows[1]
        assert out == before == alone[1][:len(before)], (spec, out, before, alone[1])
        assert 0 < len(before) < FAULT_TOKENS, (spec, before)
        assert finish == "cancelled" and "cannot sample this row" in error, (spec, rows[1])
        assert fault == (True, True), (spec, fault)  # ended in the step whose round drafted
        for i in (0, 2):
            assert rows[i][:2] == (alone[i], "length"), (spec, i, rows[i], alone[i])
        assert (len(rows[3][0]), rows[3][1:]) == (FAULT_TOKENS, ("length", "None")), rows[3]
        assert used == 0
