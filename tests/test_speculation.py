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
- what speculation cannot do is refused by name;
- tools/generate.py --speculate (the engine's flag, as tools/serve.py's) reaches the engine
  Generator builds, decodes a trained checkpoint's greedy ids as without it, and a bad value is
  refused naming the flag;
- DraftController picks the k of hand-computed E(k) / cost choices, estimates the per-draft
  acceptance from rounds that stop at their first rejection, probes after a run of plain steps
  (and notices a recovered acceptance) and after a run of rounds; agreed_k gives rank 0's k on
  both ranks at TP=2.

The rank bodies run under the CPU shim's placement check.
"""

import contextlib
import io

import pytest
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

    config = {"max_sequence_length": 40, "max_batch": 64, "block_size": 4,
              "speculate_fixed": True, **config}
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


def _adaptive(rank, world):
    from megaloop.inference.generate import SamplingParams
    from megaloop.inference.speculation import DraftController

    setup_parallel(world)
    model = _model()
    plain = _staggered(_engine(model), 16, SamplingParams())
    engine = _engine(model, "2:3", speculate_fixed=False)
    engine.drafts = DraftController(probe_every=2)  # (rounds and plain steps both, in 16 tokens)
    ks, real = [], engine.drafts.k_for
    engine.drafts.k_for = lambda m: ks.append(real(m)) or ks[-1]
    return plain, _staggered(engine, 16, SamplingParams()), ks


def test_adaptive_greedy_speculation_decodes_the_full_depth_tokens():
    plain, adaptive, ks = run_distributed(_adaptive, 1)[0]
    assert adaptive == plain
    assert 0 in ks and any(k > 0 for k in ks), ks


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

    def round_(engine, requests, k, *times):
        seqs[:] = [r.prompt + r.out for r in requests]
        rounds.append(k)
        return speculate_round(engine, requests, k, *times)

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


# --- tools/generate.py --speculate --------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny looped model trained two steps (test_training.BASE: 2 layers, T = 3)."""
    from test_inference import _train_and_save

    path = str(tmp_path_factory.mktemp("speculate") / "ckpt")
    assert run_distributed(_train_and_save, 1, path) == [0]
    return path


def _generate_engines(rank, world, argvs):
    """tools/generate.py's main(argv) for each of ``argvs`` in this rank, recording the engines
    it builds: per argv (exit code, stdout, stderr, per engine (speculate, drafted, accepted))."""
    check_placement()
    from megaloop.inference import generate as generate_module
    from test_inference_precision import _tool

    real, built = generate_module.InferenceEngine, []

    class Recording(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    generate_module.InferenceEngine = Recording  # the name Generator builds its engines by
    results = []
    try:
        for argv in argvs:
            built.clear()
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = _tool("generate").main(argv)
            results.append((code, out.getvalue(), err.getvalue(),
                            [(e.speculate, e.stats["drafted"], e.stats["accepted"])
                             for e in built]))
    finally:
        generate_module.InferenceEngine = real
    return results


def test_generate_speculate_reaches_the_engine_and_keeps_the_greedy_ids(ckpt):
    """--speculate 1:2 reaches every engine Generator builds (its up-front check and the one
    that decodes) as the tuple (1, 2), which drafts; the ids printed equal those without it.
    A draft depth at the model's T (3) is refused after loading, naming the flag."""
    argv = ["--load", ckpt, "--prompt-ids", "5,6,7,8", "--prompt-ids", "9,10",
            "--max-tokens", "12", "--no-stop-at-eod"]
    plain, spec, deep = run_distributed(_generate_engines, 1, [
        argv, argv + ["--speculate", "1:2"], argv + ["--speculate", "3:2"]])[0]
    assert plain[0] == 0 and [e[0] for e in plain[3]] == [None, None], plain
    lines = plain[1].strip().split("\n")
    assert len(lines) == 2 and all(len(line.split(",")) == 12 for line in lines), plain[1]
    assert spec[0] == 0, spec[2]
    assert [e[0] for e in spec[3]] == [(1, 2), (1, 2)], spec[3]
    assert spec[3][-1][1] > 0, spec[3]  # the decoding engine drafted
    assert spec[1] == plain[1]
    assert deep[0] == 2 and deep[1] == "", deep
    assert deep[2].strip().splitlines()[-1].startswith(
        "error: --speculate 3:2: the draft depth 3 must be below the decoding depth 3"), deep[2]


@pytest.mark.parametrize("extra, line", [
    (["--speculate", "2"], "error: --speculate '2': give d:k (draft depth d, k drafted tokens "
                           "per round), e.g. 2:4"),
    (["--speculate", "0:2"], "error: --speculate 0:2: the draft depth and the drafted tokens "
                             "must be >= 1"),
    (["--speculate", "1:2", "--kv-policy", "last-step"],
     "error: --speculate 1:2 needs --kv-policy full (a multi-token verify over one-slot or "
     "mod-k caches differs from token-by-token decoding)"),
])
def test_generate_refuses_a_bad_speculate_value_naming_the_flag(ckpt, extra, line, capsys,
                                                               monkeypatch):
    """Exit code 2 and one line naming --speculate and what to give, before any process
    group."""
    from test_inference_precision import _tool

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert _tool("generate").main(["--load", ckpt, "--prompt-ids", "5,6", "--max-tokens", "4",
                                   *extra]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [line]
    assert not torch.distributed.is_initialized()


# --- DraftController ------------------------------------------------------------------------------
def _controller(kept, k, draft_s, verify_s, plain_s=1.0, **kw):
    """A controller that has timed one plain step and one round (decay 1: the last of each)."""
    from megaloop.inference.speculation import DraftController

    c = DraftController(decay=1.0, **kw)
    c.record_plain(plain_s)
    c.record(kept, k, draft_s, verify_s)
    return c


def test_controller_picks_the_k_of_the_most_tokens_per_second():
    """Rows keeping 4, 3 and 1 of 4 drafts: a = 8 kept / 10 tested = 0.8 (accepted / drafted
    would say 8/12). c_plain 1 s, c_draft 0.4 s / 4 = 0.1 s, c_verify 1.2 s. By hand,
    E(k) = (1 - 0.8^(k+1)) / 0.2 and rate(k) = E(k) / (0.1 k + 1.2):
    k = 1: 1.8 / 1.3 = 1.3846;  2: 2.44 / 1.4 = 1.7429;  3: 2.952 / 1.5 = 1.968;
    4: 3.3616 / 1.6 = 2.101;  5: 3.68928 / 1.7 = 2.1702;  6: 3.951424 / 1.8 = 2.19524;
    7: 4.161139 / 1.9 = 2.19007;  8: 4.328911 / 2.0 = 2.16446;  rate(0) = 1 / 1 s.
    So k = 6 of up to 8, the most allowed below that, and 0 where there is no room."""
    c = _controller([4, 3, 1], 4, 0.4, 1.2)
    assert c.acceptance == pytest.approx(0.8)
    assert [c.rate(k) for k in (0, 1, 4, 6, 8)] == pytest.approx(
        [1.0, 1.8 / 1.3, 3.3616 / 1.6, 3.951424 / 1.8, 4.328911 / 2.0], rel=1e-6)
    assert [c.k_for(m) for m in (8, 7, 6, 5, 4, 1, 0)] == [6, 6, 6, 5, 4, 1, 0]


def test_controller_decodes_plainly_where_drafts_do_not_pay():
    """Rows keeping 1, 0, 0, 0 of 4: a = 1 / 5 = 0.2; c_draft 3.6 s / 4 = 0.9 s (a host-bound
    forward: a draft costs about a full one), c_verify 1.1 s. rate(1) = 1.2 / 2.0 = 0.6,
    rate(2) = 1.24 / 2.9 = 0.428, below rate(0) = 1: k = 0."""
    c = _controller([1, 0, 0, 0], 4, 3.6, 1.1)
    assert c.acceptance == pytest.approx(0.2)
    assert c.rate(1) == pytest.approx(0.6) and c.rate(2) == pytest.approx(1.24 / 2.9)
    assert c.k_for(4) == 0


def test_controller_measures_first_then_probes_both_ways():
    """0 until a plain step is timed, then max_k until a round is; after probe_every plain
    steps in a row the best k >= 1 once (which notices a recovered acceptance), after
    probe_every rounds in a row 0 once."""
    from megaloop.inference.speculation import DraftController

    c = DraftController(decay=1.0, probe_every=3)
    assert c.k_for(4) == 0
    c.record_plain(1.0)
    assert c.k_for(4) == 4 and c.k_for(2) == 2
    c.record([1, 0, 0, 0], 4, 3.6, 1.1)  # the previous test's losing round
    choices = []
    for _ in range(3):
        choices.append(c.k_for(4))
        c.record_plain(1.0)
    assert choices == [0, 0, 0] and c.k_for(4) == 1  # the probe: rate(1) is the best k >= 1
    c.record([1, 1, 1], 1, 0.1, 1.2)  # every draft kept now: a = 1, rate(k) = (k+1)/(0.1k+1.2)
    assert c.acceptance == 1.0 and c.k_for(4) == 4  # 5 / 1.6 = 3.125 tokens/s
    c.record([4], 4, 0.4, 1.2)
    c.record([4], 4, 0.4, 1.2)
    assert c.k_for(4) == 0  # three rounds in a row: time a plain step again
    c.record_plain(1.0)
    assert c.k_for(4) == 4


def test_controller_averages_over_rounds_and_refuses_impossible_rounds():
    """decay 0.5: kept 8 of 10 tested, then 0 of 2 (two rows rejecting their first draft):
    kept 8 + 0.5 (0 - 8) = 4 over tested 10 + 0.5 (2 - 10) = 6, a = 2/3; c_draft 0.1 then
    0.3 s: 0.2 s."""
    from megaloop.inference.speculation import DraftController

    c = DraftController(decay=0.5)
    assert c.acceptance is None
    c.record([4, 3, 1], 4, 0.4, 1.2)
    c.record([0, 0], 4, 1.2, 1.0)
    assert c.acceptance == pytest.approx(2 / 3)
    assert (c.c_draft, c.c_verify) == (pytest.approx(0.2), pytest.approx(1.1))
    for kept, k in (([5], 4), ([1], 0), ([], 2), ([-1], 2)):
        with pytest.raises(ValueError, match="each row keeps 0..k"):
            c.record(kept, k, 1.0, 1.0)
    with pytest.raises(ValueError, match="decay 0: must be in"):
        DraftController(decay=0)
    with pytest.raises(ValueError, match="probe_every 0: must be >= 1"):
        DraftController(probe_every=0)


def test_expected_tokens_of_a_round():
    from megaloop.inference.speculation import expected_tokens

    # a = 0.5, k = 3: 1 + 0.5 + 0.25 + 0.125 (the k-th draft kept with probability a^k)
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0


def _agreed(rank, world):
    from megaloop.inference.speculation import agreed_k

    setup_parallel(world)
    return agreed_k(3 if rank == 0 else 1)


def test_agreed_k_is_the_first_ranks_under_tensor_parallelism():
    assert run_distributed(_agreed, 2) == [3, 3]
