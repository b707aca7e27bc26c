"""lm-evaluation-harness end to end: the shipped local tasks (examples/lm_eval_tasks: multiple
choice and generation) run through lm-eval's own command line, once with ``--model megaloop``
(tools/run_lm_eval.py) and once with lm-eval's ``local-completions`` model against a
tools/serve.py subprocess. The log-likelihoods lm-eval records must equal each other and the
model's own teacher-forced log-probabilities (a plain forward, scored here); the greedy answers
must be the same text both ways.

The two lm-eval runs and the server run in processes forked from this one (which has imported
torch and megatron-core already: a fresh interpreter pays seconds for them each time), running
the tools' own main() with their argv; the server starts while the first run evaluates, and the
second run evaluates against it alongside the first. One
real interpreter of tools/run_lm_eval.py is the refusal test's."""

import glob
import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest
from flags import TEST_FLAGS

pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from distributed import free_port, run_distributed  # noqa: E402
from test_placement import check_placement
from test_evaluate import _train  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "examples", "lm_eval_tasks")
LIMIT = 5


def _docs():
    with open(os.path.join(TASKS, "demo_tasks.jsonl")) as f:
        return [json.loads(line) for line in f][:LIMIT]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny looped model with a sentencepiece tokenizer trained on the demo corpus' text."""
    import importlib.util

    from megaloop.data.tokenizers import train_sentencepiece

    tmp = tmp_path_factory.mktemp("lm_eval")
    spec = importlib.util.spec_from_file_location(
        "make_demo_corpus", os.path.join(ROOT, "megaloop", "cli", "make_demo_corpus.py"))
    corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus)
    import random

    rng = random.Random(0)
    texts = [corpus.document(rng, 6) for _ in range(300)]
    model = train_sentencepiece(texts, str(tmp / "sp"), vocab_size=512)
    path = str(tmp / "ckpt")
    run_distributed(_train, 1, [
        *TEST_FLAGS, "--num-layers", "2", "--num-loops", "3", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "128", "--max-position-embeddings", "128",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
        "--lr", "1e-2", "--mock-data", "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", model, "--eval-iters", "0", "--log-interval", "1",
        "--save", path])
    return path, model


def _tool_main(tool, argv, env, console):
    """In a forked process: ``tools/<tool>``'s main() with ``sys.argv = [tool, *argv]``, the
    environment updated with ``env`` (before lm-eval imports the Hugging Face libraries, which
    read it), stdout/stderr (file descriptors 1 and 2) into ``console.out`` / ``console.err``;
    the process's exit status is main's."""
    import logging
    import traceback

    for fd, suffix in ((1, "out"), (2, "err")):
        target = os.open(f"{console}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    for handler in list(logging.root.handlers):  # pytest's capture: the tool configures its own
        logging.root.removeHandler(handler)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)  # a process the user starts: no launcher's variables
    os.environ.update(env)
    check_placement()  # the shim came with the fork: lm-eval's model and the server run checked
    sys.argv = [os.path.join(ROOT, "megaloop", "cli", tool), *argv]
    code = 1
    try:
        spec = importlib.util.spec_from_file_location(tool[:-3], sys.argv[0])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        code = module.main() or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (exc.code is not None)
    except BaseException:  # noqa: BLE001 - shown in the console file, the test reads it
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _fork_tool(tool, argv, env, console):
    proc = multiprocessing.get_context("fork").Process(target=_tool_main,
                                                       args=(tool, argv, env, console))
    proc.start()
    return proc


def _console(console):
    return tuple(open(f"{console}.{s}").read() if os.path.exists(f"{console}.{s}") else ""
                 for s in ("out", "err"))


def _finish(proc, console, timeout):
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError(f"{console} did not finish in {timeout} s\n"
                             + "".join(_console(console))[-5000:])
    out, err = _console(console)
    assert proc.exitcode == 0, out[-3000:] + err[-5000:]
    return out


def _lm_eval_args(out_dir, model, model_args, tasks):
    return ["--model", model, "--model_args", model_args, "--include_path", TASKS,
            "--tasks", tasks, "--limit", str(LIMIT), "--batch_size", "1",
            "--output_path", out_dir, "--log_samples"]


def _hf_env(home):
    return dict(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=home,
                TOKENIZERS_PARALLELISM="false")


def _samples(out_dir, tasks):
    samples = {}
    for task in tasks.split(","):
        (path,) = glob.glob(os.path.join(out_dir, "**", f"samples_{task}_*.jsonl"),
                            recursive=True)
        with open(path) as f:
            samples[task] = {s["doc_id"]: s for s in map(json.loads, f)}
    return samples


def _lls(sample):
    return [float(r[0][0]) for r in sample["resps"]]


def _reference(rank, world, ckpt, sp_model, pairs):
    """Sum of log p(continuation | context) from the model's plain forward (last step, real
    vocabulary), the pair encoded as lm-eval's causal models encode it: the whole string, then
    the context alone, the continuation being the tail."""
    check_placement()
    import torch

    from megaloop.data.tokenizers import SentencePieceTokenizer
    from megaloop.device import current_device
    from megaloop.inference.loading import load_for_generation, setup_processes

    setup_processes()
    model, _, _ = load_for_generation(ckpt)  # on the device: so are its inputs
    device = current_device()
    tok = SentencePieceTokenizer(sp_model)
    out = []
    for context, continuation in pairs:
        whole = tok.tokenize(context + continuation)
        n_ctx = len(tok.tokenize(context))
        x = torch.tensor([whole[:-1]], device=device)
        with torch.no_grad():
            logits = model(x, torch.arange(x.size(1), device=device).unsqueeze(0), None)
        logp = torch.log_softmax(logits[0, :, :tok.vocab_size].float(), -1)
        targets = torch.tensor(whole[n_ctx:], device=device)
        out.append(logp[n_ctx - 1:].gather(-1, targets.unsqueeze(-1)).sum().item())
    return out


def _wait_ready(proc, port, console):
    deadline = time.monotonic() + 180
    while True:
        assert proc.is_alive(), "".join(_console(console))
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200:
                return f"http://127.0.0.1:{port}/v1/completions"
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "".join(_console(console))
        time.sleep(0.3)


def test_megaloop_model_equals_local_completions_and_teacher_forcing(ckpt, tmp_path):
    tasks = "megaloop_demo_mc,megaloop_demo_gen"
    env = _hf_env(str(tmp_path / "hf_home"))
    ours_at, served_at = str(tmp_path / "megaloop"), str(tmp_path / "served")
    ours_run = _fork_tool("run_lm_eval.py", _lm_eval_args(
        ours_at, "megaloop", f"load={ckpt[0]},num_loops=3", tasks), env, ours_at)
    port = free_port()
    server = _fork_tool("serve.py", ["--load", ckpt[0], "--port", str(port), "--model-name",
                                     "looped", "--log-level", "warning"], {},
                        str(tmp_path / "server"))
    served_run = None
    try:
        url = _wait_ready(server, port, str(tmp_path / "server"))
        # The served run evaluates while the first one does (its own HF_HOME: no shared cache).
        served_run = _fork_tool("run_lm_eval.py", _lm_eval_args(
            served_at, "local-completions",
            f"model=looped,base_url={url},num_concurrent=1,max_retries=1", tasks),
            _hf_env(str(tmp_path / "hf_home_served")), served_at)
        table = _finish(ours_run, ours_at, 400)
        assert "megaloop_demo_mc" in table and "acc" in table  # lm-eval's results table
        _finish(served_run, served_at, 400)
    finally:
        for proc in (ours_run, server, served_run):
            if proc is None:
                continue
            if proc.is_alive():
                proc.terminate()  # the server: SIGTERM stops it as Ctrl-C does
                proc.join(15)
            if proc.is_alive():
                proc.kill()
                proc.join()
    ours, theirs = _samples(ours_at, tasks), _samples(served_at, tasks)
    docs = _docs()
    assert sorted(ours["megaloop_demo_mc"]) == list(range(LIMIT))
    pairs = [(d["question"], " " + c) for d in docs for c in d["choices"]]
    reference = run_distributed(_reference, 1, ckpt[0], ckpt[1], pairs)[0]
    got = [ll for i in range(LIMIT) for ll in _lls(ours["megaloop_demo_mc"][i])]
    served = [ll for i in range(LIMIT) for ll in _lls(theirs["megaloop_demo_mc"][i])]
    assert got == pytest.approx(reference, abs=1e-4)
    assert served == pytest.approx(reference, abs=1e-4)
    for i in range(LIMIT):
        assert ours["megaloop_demo_gen"][i]["resps"] == theirs["megaloop_demo_gen"][i]["resps"]


def test_adapter_exit_rule_and_rolling(ckpt):
    """In process: loglikelihood_rolling over several windows equals the sum of its windows'
    token log-probs; fixed:1 scores with step 1 (differs from all steps); bad args are named."""
    run_distributed(_adapter_checks, 1, ckpt[0])


def _adapter_checks(rank, world, ckpt):
    check_placement()
    import torch
    from lm_eval.api.instance import Instance

    from megaloop.device import current_device
    from megaloop.eval.lm_eval_adapter import MegaloopLM

    lm = MegaloopLM(load=ckpt, max_length=16)
    text = "the quiet robot watches the bridge near the harbor. a=4; b=a+3; b=? answer: 7."
    ids = lm.tok_encode(text)
    assert len(ids) > 2 * 16  # several rolling windows
    (rolling,) = lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    # Independent: each token scored with its preceding (at most 15) tokens as context, in
    # the windows lm-eval's rolling scheme uses: disjoint blocks of 16 predicted tokens.
    stream = [lm.eot_token_id] + ids
    total = 0.0
    for start in range(0, len(ids), 16):
        end = min(start + 16, len(ids))
        ctx_start = max(end - 16, 0)
        x = torch.tensor([stream[ctx_start:end]], device=current_device())  # the model's
        with torch.no_grad():
            logits = lm.model(x, torch.arange(x.size(1), device=x.device).unsqueeze(0), None)
        logp = torch.log_softmax(logits[0, :, :lm.vocab_size].float(), -1)
        for j in range(start, end):
            total += logp[j - ctx_start, stream[j + 1]].item()
    assert rolling == pytest.approx(total, abs=1e-3)

    req = [Instance("loglikelihood", {}, ("a=4; b=a+3; b=? answer:", " 7"), 0)]
    full = lm.loglikelihood(req, disable_tqdm=True)[0][0]
    step1 = MegaloopLM(load=ckpt, exit="fixed:1").loglikelihood(req, disable_tqdm=True)[0][0]
    one = MegaloopLM(load=ckpt, num_loops=1).loglikelihood(req, disable_tqdm=True)[0][0]
    assert step1 != pytest.approx(full, abs=1e-6)
    assert step1 == pytest.approx(one, abs=1e-5)  # exiting after step 1 = running 1 step
    with pytest.raises(ValueError, match="--exit"):
        MegaloopLM(load=ckpt, exit="sometimes")
    # A depth below 1 and a misspelt key are refused by name (they ran the trained depth).
    from megaloop.eval.lm_eval_adapter import ModelArgsError

    for kwargs, message in (({"num_loops": 0}, "num_loops 0: the loop steps"),
                            ({"num_loops": -3}, "num_loops -3: the loop steps"),
                            ({"nmu_loops": 1}, "nmu_loops=1: unknown key (did you mean "
                                               "num_loops?); the megaloop model takes load, "
                                               "ckpt_step, num_loops, exit,"),
                            ({"batch_size": "auto"}, "batch_size auto:"),
                            ({"device": "cuda:1"}, "device cuda:1: the megaloop model is placed "
                                                   "on cpu"),
                            ({"ckpt_step": 2, "load": ckpt + "-none"}, "load " + ckpt + "-none")):
        with pytest.raises(ModelArgsError) as info:
            MegaloopLM(**{"load": ckpt, **kwargs})
        assert str(info.value).startswith(message), info.value
    # lm-eval's default device (sent also when the user named none) and the CPU itself load.
    for device in ("cuda:0", "cpu"):
        MegaloopLM(load=ckpt, device=device)
    # ckpt_step is the trainer's --ckpt-step: this run saved iteration 2 only.
    with pytest.raises(ValueError, match="iter_0000001 does not exist"):
        MegaloopLM(load=ckpt, ckpt_step=1)
    assert MegaloopLM(load=ckpt, ckpt_step=2).loglikelihood(req, disable_tqdm=True)[0][0] == \
        pytest.approx(full, abs=1e-6)


def test_run_lm_eval_refuses_a_misspelt_model_arg_in_one_line(ckpt, tmp_path):
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf"), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "megaloop", "cli", "run_lm_eval.py"), "--model", "megaloop",
         "--model_args", f"load={ckpt[0]},nmu_loops=1", "--include_path", TASKS,
         "--tasks", "megaloop_demo_mc", "--limit", "1", "--output_path", str(tmp_path / "o")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().split("\n")[-1].startswith(
        "error: --model_args nmu_loops=1: unknown key (did you mean num_loops?)"), proc.stderr
    return True


def test_progress_bars_count_the_requests(ckpt):
    """lm-eval's run of a demo task takes minutes: the model's bars on stderr count its requests
    (log-likelihood pairs, rolling texts, generations) to the end; lm-eval's own bar before them
    counts tokenization only. disable_tqdm (lm-eval's switch) silences them, and so does
    MegaloopLM.progress = False (tools/run_lm_eval.py --no-progress), lm-eval's tokenization bar
    included."""
    assert run_distributed(_progress_checks, 1, ckpt[0])[0]
    spec = importlib.util.spec_from_file_location(
        "run_lm_eval", os.path.join(ROOT, "megaloop", "cli", "run_lm_eval.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    argv = ["--model", "megaloop", "--no-progress", "--limit", "2"]
    assert tool.take_no_progress(argv) == (["--model", "megaloop", "--limit", "2"], True)
    assert tool.take_no_progress(argv[:2]) == (argv[:2], False)


def _progress_checks(rank, world, ckpt):
    import contextlib
    import io
    import re

    from lm_eval.api.instance import Instance

    from megaloop.eval.lm_eval_adapter import MegaloopLM

    check_placement()
    lm = MegaloopLM(load=ckpt, max_length=16, batch_size=2, max_gen_toks=2)
    pairs = [Instance("loglikelihood", {}, (q, " " + a), i) for i, (q, a) in enumerate(
        [("a=4; b=?", "4"), ("the quiet", "robot"), ("x", "y"), ("1 2 3", "4"), ("z", "w")])]
    texts = [Instance("loglikelihood_rolling", {}, ("the quiet robot watches the bridge " * k,),
                      k) for k in (1, 4, 6)]  # the longer ones span several windows
    gens = [Instance("generate_until", {}, (p, {"until": ["."]}), i)
            for i, p in enumerate(["the quiet", "a=4;"])]

    def bar(call, requests, desc):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            call(requests)
        counts = re.findall(re.escape(desc) + r":[^\r\n]*?(\d+)/(\d+) \[", err.getvalue())
        assert counts and counts[-1] == (str(len(requests)),) * 2, err.getvalue()
        assert {total for _, total in counts} == {str(len(requests))}
        return err.getvalue()

    bar(lm.loglikelihood, pairs, "megaloop log-likelihoods")
    # The windows of a rolling text are scored without a bar of their own (no second bar).
    assert "megaloop log-likelihoods" not in bar(lm.loglikelihood_rolling, texts,
                                                 "megaloop rolling log-likelihoods")
    bar(lm.generate_until, gens, "megaloop generation")
    for quiet in ({"disable_tqdm": True}, {}):
        if not quiet:
            lm.progress = False  # (tools/run_lm_eval.py --no-progress sets it on the class)
        for call, requests in ((lm.loglikelihood, pairs), (lm.loglikelihood_rolling, texts),
                               (lm.generate_until, gens)):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                call(requests, **quiet)
            assert "/" not in err.getvalue(), (quiet, err.getvalue())  # no n/total: no bar
    return True
