"""The server's model side without HTTP (megaloop/inference/batcher.py, lockstep.py), in forked
ranks: jobs submitted together are decoded in shared forwards and each answers as the same
request decoded alone by ``Generator`` (an independent, unbatched decoder), with and without
early exit; a cancelled job's rows are freed at the next step; and the lockstep driver at TP=2,
fed a scripted sequence of adds, cancels and scores across steps, gives rank for rank the
tokens of TP=1. A row the engine refuses or whose draw fails (on one rank or all) fails only its
job, alike on every rank; a step that fails as a whole leaves /stats with the fresh engine's
counters. The HTTP server at TP=2 (a torchrun launch): tests/test_serve.py."""

import pytest
import torch

from distributed import run_distributed, setup_parallel  # noqa: E402
from test_inference import _model, _sharp_gate  # noqa: E402

EOD = 200  # NullTokenizer(200): ids 0..199, EOD 200
MODEL_KW = {"max_position_embeddings": 64}
LOOP_KW = {"num_loops": 4, "num_coda_layers": 1, "num_prelude_layers": 1}


def _service(exit_text=None, **engine_kw):
    from megaloop.data.tokenizers import NullTokenizer
    from megaloop.inference.early_exit import parse_exit
    from megaloop.inference.engine import EngineConfig
    from megaloop.inference.jobs import ModelService

    model = _model(MODEL_KW, LOOP_KW)
    _sharp_gate(model)  # tokens exit at different steps under q:0.9 (all at step 1 under q:0.5)
    model.eval()
    config = EngineConfig(max_sequence_length=64, **engine_kw)
    return ModelService(model, NullTokenizer(EOD), "tiny", exit_rule=parse_exit(exit_text),
                        max_length=64, engine_config=config)


def _job(prompts, max_tokens, n=1, temperature=0.0, seed=0, stop=(), logprobs=None):
    from megaloop.inference.generate import SamplingParams
    from megaloop.inference.jobs import Job

    return Job(prompts, n, max_tokens, SamplingParams(temperature=temperature, top_k=0,
                                                      top_p=1.0, seed=seed), list(stop),
               logprobs)


def _run(service, jobs, until=None):
    """Submit ``jobs`` at once and run the model loop until all are answered (or ``until()``)."""
    futures = [service.submit(j) for j in jobs]
    service.run_jobs(lambda: not (until() if until else all(f.done() for f in futures)))
    return futures


JOBS = [dict(prompts=[[5, 6, 7, 8]], max_tokens=7),
        dict(prompts=[[9, 10, 11], [12, 13, 14, 15, 16, 17]], max_tokens=5),
        dict(prompts=[[18, 19]], max_tokens=6, n=2, temperature=0.9, seed=3),
        dict(prompts=[[20, 21, 22]], max_tokens=5, logprobs=1)]


def _together_and_alone(rank, world, exit_text):
    from megaloop.inference.batcher import row_seed
    from megaloop.inference.generate import Generator, SamplingParams

    setup_parallel(world)
    service = _service(exit_text)
    jobs = [_job(**kw) for kw in JOBS]
    # The first job starts alone; the others arrive while it decodes (before its 3rd step).
    futures, calls = [service.submit(jobs[0])], []

    def keep_going():
        calls.append(1)
        if len(calls) == 3:
            futures.extend(service.submit(j) for j in jobs[1:])
        return len(futures) < len(jobs) or not all(f.done() for f in futures)

    service.run_jobs(keep_going)
    results = [f.result() for f in futures]
    stats = dict(service.stats)
    # Each row alone, by the unbatched decoder, with the row's seed.
    gen = Generator(service.model, service.vocab_size, kv_policy="full", eod=EOD,
                    exit_rule=service.runner.lockstep.engine.exit_rule)
    alone, alone_forwards = [], 0
    for job in jobs:
        for i, prompt in enumerate(job.rows):
            p = job.params
            gen.depths = []
            alone.append(gen.generate([prompt], job.max_tokens, SamplingParams(
                p.temperature, p.top_k, p.top_p, row_seed(p.seed, i)))[0])
            alone_forwards += gen.stats["decode_forwards"]
    logprob_rows = results[3][0][0]
    return ([o for j in jobs for o in j.outs], alone, stats, alone_forwards,
            [d for j in jobs for d in j.depths], logprob_rows.shape, [j.usage() for j in jobs])


@pytest.mark.parametrize("exit_text", [None, "q:0.9"])
def test_jobs_submitted_together_share_forwards_and_answer_as_alone(exit_text):
    """Four jobs (six rows; greedy, sampled with n=2, with log-probs), three of them arriving
    while the first decodes: every row's tokens are those of Generator decoding it alone, all
    six rows shared a decode forward, and the engine decoded them in far fewer forwards than
    one request after another (its counters)."""
    outs, alone, stats, alone_forwards, depths, lp_shape, usages = run_distributed(
        _together_and_alone, 1, exit_text)[0]
    assert outs == alone
    assert outs[3] != outs[4]  # n=2 sampled rows draw from different seeds
    assert stats["decode_rows_max"] == 6
    assert stats["decode_forwards"] <= alone_forwards / 3, (stats, alone_forwards)
    assert lp_shape[0] == len(outs[5])  # a log-prob row per generated token
    assert usages[1] == {"prompt_tokens": 9, "completion_tokens": len(outs[1]) + len(outs[2]),
                         "total_tokens": 9 + len(outs[1]) + len(outs[2])}
    if exit_text:
        assert len(set(depths)) > 1, depths  # rows left the loop at different steps


def _cancel_frees(rank, world):
    setup_parallel(world)
    service = _service()
    keep, gone = _job([[5, 6, 7]], 29), _job([[8, 9], [10, 11, 12]], 29, n=2)
    seen = []

    def until():  # called once per loop iteration, after the previous step
        seen.append(dict(service.stats))
        if len(seen) == 4:
            gone.cancelled.set()  # the client left: its rows are cancelled in this iteration
        return len(seen) == 6

    futures = _run(service, [keep, gone], until)
    return seen, futures[1].exception() is not None, sum(len(o) for o in gone.outs)


def test_a_cancelled_job_frees_its_rows_at_the_next_step():
    """Two jobs (1 + 4 rows); the second's client leaves after three steps: the step after that
    runs only the first job's row, and the cancelled rows' KV blocks are back in the pool."""
    seen, failed, made = run_distributed(_cancel_frees, 1)[0]
    assert failed and 0 < made < 4 * 29
    before, after = seen[3], seen[4]
    assert before["running"] == 5 and after["running"] == 1, (before, after)
    # up to 29 + 3 tokens in 16-token blocks: 2 blocks per row
    assert before["used_blocks"] == 10 and after["used_blocks"] == 2, (before, after)


# --- TP=2 == TP=1 -------------------------------------------------------------------------------
def _scripted(rank, world):
    """Rank 0 drives a Lockstep through a script of commands; every rank records its rows'
    tokens through its own hooks (one stops its row at the row's 5th token)."""
    from megaloop.inference.generate import SamplingParams
    from megaloop.inference.lockstep import Add, Cancel, Lockstep, Score

    setup_parallel(world)
    service = _service()
    tokens: dict = {}

    def make_hook(add):
        tokens[add.key] = []

        def hook(request, token):
            tokens[add.key].append(token)
            return add.payload == "stop at 5" and len(tokens[add.key]) == 5
        return hook

    new_engine = service.runner.lockstep.new_engine
    lockstep = Lockstep(new_engine, make_hook, service.prompt_log_probs)
    greedy, sampled = SamplingParams(), SamplingParams(temperature=1.0, seed=9)
    script = [[Add(0, [5, 6, 7, 8], 8, greedy), Add(1, [9, 10], 12, sampled)],
              [Add(2, list(range(20, 40)), 6, sampled, record_logprobs=True)],
              [],
              [Cancel(1), Add(3, [41, 42, 43], 8, SamplingParams(temperature=1.0, seed=4),
                              payload="stop at 5")],
              [Score(4, [50, 51, 52, 53])]]
    finished, scores = {}, {}
    if rank == 0:
        for commands in script + [[]] * 12:
            done, got, _ = lockstep.step(commands)
            finished.update({k: (r.finish, r.out) for k, r in done})
            scores.update({k: v.tolist() for k, v in got.items()})
        assert not lockstep.engine.has_work()
        lockstep.close()
    else:
        lockstep.follow()
    return tokens, finished, scores


def test_tp2_lockstep_gives_the_tokens_of_tp1():
    """A scripted sequence of adds (greedy, sampled, a long prompt, a row its hook stops),
    a cancel mid-way and a score, over several steps: both TP=2 ranks record the same tokens,
    and those are TP=1's; rank 0 reports the same finished rows and scores."""
    (one,) = run_distributed(_scripted, 1)
    two = run_distributed(_scripted, 2, timeout=90)
    tokens, finished, scores = one
    assert two[0][0] == two[1][0] == tokens
    assert two[0][1] == finished and set(finished) == {0, 2, 3}
    assert finished[3][0] == "stop" and len(finished[3][1]) == 5  # its hook stopped it
    assert 0 < len(tokens[1]) < 12  # cancelled mid-way
    assert scores.keys() == two[0][2].keys() == {4}
    assert torch.allclose(torch.tensor(scores[4]), torch.tensor(two[0][2][4]), atol=1e-5)


def _one_rank_fails(rank, world):
    """Failures on rank 1 only: a row's hook raises at its 2nd token (rank 1's engine cancels
    that row: every rank must), then a prompt's score raises after its forward (the step fails
    on every rank, each starts a fresh engine). Nothing hangs, and a row added afterwards
    answers as alone."""
    from megaloop.inference.generate import SamplingParams
    from megaloop.inference.lockstep import Add, Lockstep, Score, StepFailed

    setup_parallel(world)
    service = _service()

    def make_hook(add):
        count = []

        def hook(request, token):
            count.append(token)
            if add.payload == "fail on rank 1" and rank == 1 and len(count) == 2:
                raise RuntimeError("a hook failed on rank 1")
            return False
        return hook

    def score(prompt):
        rows = service.prompt_log_probs(prompt)  # (a failure inside its collectives would
        if rank == 1 and prompt == [99, 98]:     # mismatch them: no exchange can catch that)
            raise ValueError("a score failed on rank 1")
        return rows

    lockstep = Lockstep(service.runner.lockstep.new_engine, make_hook, score)
    report = {"errors": {}, "failed": [], "out": None, "finished": []}
    if rank == 0:
        script = [[Add(0, [5, 6, 7], 6, SamplingParams(), payload="fail on rank 1"),
                   Add(1, [8, 9], 3, SamplingParams())]] + [[]] * 3 + \
            [[Score(2, [99, 98])], [Add(3, [5, 6, 7], 6, SamplingParams())]] + [[]] * 6
        for commands in script:
            try:
                done, _, errors = lockstep.step(commands)
            except StepFailed as exc:
                report["failed"].append(str(exc))
                continue
            report["errors"].update(errors)
            report["finished"] += [k for k, _ in done]
            report["out"] = next((r.out for k, r in done if k == 3), report["out"])
        lockstep.close()
    else:
        lockstep.follow()
    return report


def test_failures_on_one_rank_reach_every_rank():
    report = run_distributed(_one_rank_fails, 2, timeout=90)[0]
    assert report["errors"] == {0: "rank 1: RuntimeError: a hook failed on rank 1"}, report
    (failed,) = report["failed"]
    assert "rank 1: ValueError: a score failed on rank 1" in failed, failed
    # row 1 finished before the failed step; row 0 never reports; row 3 ran on the fresh engine
    assert report["finished"] == [1, 3], report
    (ref,) = run_distributed(_scripted_one_row, 1)
    assert report["out"] == ref


def _scripted_one_row(rank, world):
    from megaloop.inference.generate import Generator

    setup_parallel(world)
    service = _service()
    return Generator(service.model, service.vocab_size, eod=EOD).generate([[5, 6, 7]], 6)[0]


def _ignore_eos(rank, world):
    from megaloop.inference.generate import Generator

    setup_parallel(world)
    service = _service()
    free = Generator(service.model, service.vocab_size).generate([[5, 6, 7]], 8)[0]
    service.eod = service.runner.eod = service.tokenizer.eod = free[2]  # EOD is its 3rd token
    service.runner.lockstep.engine = service.runner.lockstep.new_engine()  # (with that EOD)
    stops, ignores = _job([[5, 6, 7]], 8), _job([[5, 6, 7]], 8)
    ignores.ignore_eos = True
    _run(service, [stops, ignores])
    return free, stops.outs[0], stops.finish[0], ignores.outs[0], ignores.finish[0], \
        ignores.texts[0]


def test_ignore_eos_generates_past_the_end_of_document():
    """The end-of-document id set to the 3rd token the model would generate: a row stops
    there; with ignore_eos it goes on to max_tokens, the tokens of decoding without EOD."""
    free, stops, why, ignores, why_ignored, text = run_distributed(_ignore_eos, 1)[0]
    eod = free[2]
    assert stops == free[:free.index(eod) + 1] and why == "stop"
    assert ignores == free and why_ignored == "length"
    assert text == " " + " ".join(map(str, free))  # EOD's piece is text like any other


# --- one row's fault stays in its request -------------------------------------------------------
def _faulty_jobs(rank, world):
    """Jobs built directly (as if a check before the engine had missed a value): one whose seed
    torch's generator cannot take, one whose temperature overflows the logits, among good
    jobs. Then a step that fails as a whole (a prompt's score raises) and a job after it."""
    from megaloop.inference.batcher import row_seed
    from megaloop.inference.generate import Generator, SamplingParams

    setup_parallel(world)
    service = _service()
    good = [_job([[5, 6, 7, 8]], 7), _job([[18, 19]], 6, n=2, temperature=0.9, seed=3)]
    bad = [_job([[9, 10]], 5, seed=2 ** 64, temperature=1.0), _job([[9, 10]], 5,
                                                                    temperature=1e-45)]
    futures = _run(service, [good[0], bad[0], good[1], bad[1]])
    errors = [repr(f.exception()) for f in futures[1::2]]
    alone = []
    gen = Generator(service.model, service.vocab_size, kv_policy="full", eod=EOD)
    for job in good:
        for i, prompt in enumerate(job.rows):
            p = job.params
            alone.append(gen.generate([prompt], job.max_tokens, SamplingParams(
                p.temperature, p.top_k, p.top_p, row_seed(p.seed, i)))[0])
    outs = [o for j in good for o in j.outs]
    before = dict(service.stats)
    # A step that fails as a whole: its engine is dropped, and /stats must not keep its counters.
    score = service.runner.lockstep.score

    def failing_score(prompt):
        if prompt == [40, 41]:
            raise ValueError("a score failed")
        return score(prompt)

    service.runner.lockstep.score = failing_score
    running, scored = _job([[5, 6, 7, 8]], 20), _job([[40, 41]], 0, logprobs=1)
    scored.echo = True
    seen = []

    def until():
        seen.append(dict(service.stats))
        if len(seen) == 3:
            service.submit(scored)
        return running.future is not None and running.future.done() and \
            scored.future is not None and scored.future.done()

    _run(service, [running], until)
    after_failure = seen[-1]
    after = _job([[5, 6, 7, 8]], 7)
    _run(service, [after])
    return (errors, outs, alone, before, after_failure, repr(running.future.exception()),
            after.outs[0] == good[0].outs[0], dict(service.stats))


def test_a_row_the_engine_refuses_fails_only_its_job():
    """A seed outside torch's range and a temperature that overflows, submitted past the
    server's checks: those two jobs fail with the engine's message, the jobs decoded with them
    answer as alone, and no engine is dropped. A step that fails as a whole (a score) drops the
    engine: /stats then shows the fresh engine's counters and the restart."""
    errors, outs, alone, before, after_failure, running_error, same, last = run_distributed(
        _faulty_jobs, 1)[0]
    assert "seed 18446744073709551616: must be an integer" in errors[0], errors
    assert "temperature 1e-45: too small to sample with" in errors[1], errors
    assert outs == alone
    assert before["engine_restarts"] == 0 and before["steps"] > 0
    assert "a score failed" in running_error
    # the fresh engine's counters: nothing ran in it yet, nothing is held
    assert after_failure["engine_restarts"] == 1 and after_failure["steps"] == 0, after_failure
    assert after_failure["used_blocks"] == 0 and after_failure["running"] == 0
    assert same and last["engine_restarts"] == 1 and 0 < last["steps"] <= 7


def _faults_on_ranks(rank, world):
    """Under lockstep: a row every rank refuses (its seed), and a row whose draw fails on rank 1
    only (its hook there corrupts the temperature after the first token); both are cancelled
    on every rank and the steps go on; a good row decoded with them answers as alone."""
    from megaloop.inference.generate import SamplingParams
    from megaloop.inference.lockstep import Add, Lockstep

    setup_parallel(world)
    service = _service()

    def make_hook(add):
        def hook(request, token):
            if add.payload == "corrupt on rank 1" and rank == 1:
                request.params = SamplingParams(temperature=1e-45)
            return False
        return hook

    lockstep = Lockstep(service.runner.lockstep.new_engine, make_hook, service.prompt_log_probs)
    report = {"errors": {}, "out": None, "failed": 0, "left": None}
    if rank == 0:
        script = [[Add(0, [5, 6, 7], 6, SamplingParams()),
                   Add(1, [8, 9], 4, SamplingParams(temperature=1.0, seed=2 ** 64)),
                   Add(2, [8, 9], 6, SamplingParams(), payload="corrupt on rank 1")]] + [[]] * 8
        for commands in script:
            try:
                done, _, errors = lockstep.step(commands)
            except Exception:
                report["failed"] += 1
                continue
            report["errors"].update(errors)
            report["out"] = next((r.out for k, r in done if k == 0), report["out"])
        report["left"] = (lockstep.engine.has_work(), lockstep.engine.allocator.used)
        lockstep.close()
    else:
        lockstep.follow()
        report["left"] = (lockstep.engine.has_work(), lockstep.engine.allocator.used)
    return report


def test_row_faults_are_isolated_alike_on_every_rank():
    reports = run_distributed(_faults_on_ranks, 2, timeout=90)
    report = reports[0]
    assert report["failed"] == 0, report
    assert sorted(report["errors"]) == [1, 2], report
    assert report["errors"][1].startswith("rank 0: ValueError: seed 18446744073709551616")
    assert report["errors"][2].startswith("rank 1: ValueError: cannot sample this row")
    assert report["out"] == run_distributed(_scripted_one_row, 1)[0]
    # every rank dropped both rows: nothing runs, no block is held
    assert [r["left"] for r in reports] == [(False, 0), (False, 0)], reports
