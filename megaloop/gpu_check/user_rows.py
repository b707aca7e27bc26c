"""The GPU check's rows that run megaloop's other entry points as a user does: generation
(``tools/generate.py``) and serving (``tools/serve.py`` started as a process of its own, one
HTTP completion request) from the smoke row's checkpoint, trained with Transformer Engine on a
GPU, and generation with the Transformer Engine layers judged against the local ones (their
teacher-forced logits, in the worker); generation from a checkpoint trained 2 steps with FP8;
and two RL steps of ``train_rl.py`` with a KL to the reference policy (the reference model is
built, placed and run).

Tools run as processes, exactly as a user types them; training runs in the worker, as the
smoke row's. On a GPU the checkpoints are TE (and FP8) ones; the CPU rehearsal runs the same
command lines from its local-spec checkpoints (``rows.cpu_flags`` swaps the training flags).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import time
import urllib.error
import urllib.request

from megaloop.gpu_check import procs, rows
from megaloop.gpu_check.report import Result, say
from megaloop.gpu_check.worker import PY, ROOT

PROMPT = [5, 6, 7, 8]
NEW_TOKENS = 8
_IDS_LINE = re.compile(r"^\d+(,\d+)*$")

# A user's RL environment, written to the output directory and named on the command line as a
# user names their own (``--env FILE:CLASS``): the smoke model's NullTokenizer reads text as ids.
RL_ENV = '''"""The GPU check's RL environment: prompts of NullTokenizer ids; reward 1 when the
completion's ids sum to an even number."""
from megaloop.rl.environments import Environment, Prompt


class EvenSum(Environment):
    def __init__(self, size: int = 8):
        self.items = [Prompt(" ".join(str((7 * i + j) % 60) for j in range(2 + i % 3)), "")
                      for i in range(size)]

    def prompts(self):
        return self.items

    def reward(self, prompt, completion):
        return float(sum(int(x) for x in completion.split()) % 2 == 0)
'''
# Flags of pretraining's data pipeline that train_rl.py does not take (its prompts come from the
# environment; --micro-batch-size is its own): flag -> values it takes.
_PRETRAIN_ONLY = {"--mock-data": 0, "--global-batch-size": 1, "--seq-length": 1,
                  "--eval-iters": 1, "--num-workers": 1, "--micro-batch-size": 1}


def _drop(argv: list, flags: dict) -> list:
    out, i = [], 0
    while i < len(argv):
        if argv[i] in flags:
            i += 1 + flags[argv[i]]
        else:
            out.append(argv[i])
            i += 1
    return out


def generate_argv(ckpt: str, *flags: str) -> list:
    return [os.path.join(ROOT, "tools", "generate.py"), "--load", ckpt, "--prompt-ids",
            ",".join(map(str, PROMPT)), "--max-tokens", str(NEW_TOKENS), *flags]


def serve_argv(ckpt: str, port: int) -> list:
    """The server of the smoke checkpoint, in fp32 as the generate rows whose ids its greedy
    completion must equal (``generate_and_serve``)."""
    return [os.path.join(ROOT, "tools", "serve.py"), "--load", ckpt, "--host", "127.0.0.1",
            "--port", str(port), *rows.FP32]


def rl_argv(d: str) -> list:
    """Two GRPO steps of the smoke row's model (TE, bf16) with a KL to the reference policy."""
    return [*_drop(rows.TINY, _PRETRAIN_ONLY), *rows.TE, *rows.BF16,
            "--env", f"{d}/rl_env.py:EvenSum", "--prompts-per-step", "4", "--group-size", "2",
            "--max-new-tokens", "8", "--micro-batch-size", "4", "--train-iters", "2",
            "--kl-beta", "0.1", "--log-jsonl", f"{d}/rl.jsonl"]


def fp8_train_argv(d: str) -> list:
    """The smoke row's model trained 2 steps with FP8 (tensorwise, the recipe for loops) and
    saved."""
    return [*rows.TINY, *rows.TE, *rows.BF16, *rows.FP8["tensorwise"], "--train-iters", "2",
            "--lr-warmup-iters", "1", "--save", f"{d}/ckpt", "--save-interval", "2",
            "--log-jsonl", f"{d}/train.jsonl"]


def printed_ids(log: str) -> list | None:
    """The ids tools/generate.py printed for its one prompt: the last line of comma-separated
    integers in its log (stdout and stderr share it)."""
    lines = [line.strip() for line in log.splitlines() if _IDS_LINE.match(line.strip())]
    return [int(x) for x in lines[-1].split(",")] if lines else None


def ids_verdict(ids: list | None, vocab: int, what: str) -> list:
    if ids is None:
        return [f"{what}: no generated ids printed"]
    if not 1 <= len(ids) <= NEW_TOKENS:
        return [f"{what}: {len(ids)} ids generated, expected 1..{NEW_TOKENS}: {ids}"]
    if not all(0 <= i <= vocab for i in ids):  # vocab: the NullTokenizer's EOD id
        return [f"{what}: ids outside the vocabulary 0..{vocab}: {ids}"]
    return []


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 60):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return r.status, json.loads(r.read().decode() or "null")


class UserRows:
    """The rows, run by the check (megaloop.gpu_check.main.Check) whose plumbing they use."""

    def __init__(self, check):
        self.check = check

    def eod(self) -> int:
        """The NullTokenizer's end-of-document id (= --vocab-size) of the models trained here."""
        argv = self.check.argv(rows.TINY)
        return int(argv[argv.index("--vocab-size") + 1])

    def _tool(self, name: str, argv: list, cap: float) -> procs.Finished | None:
        c = self.check
        log = c.log_path(name)
        t = min(cap, c.left())
        if t < 20:
            c.report.add(Result(name, "FAIL", f"not run: out of time (budget {c.budget:.0f} s)"))
            return None
        return procs.run_logged([PY, *argv], log, t, ROOT, c.env, name)

    def _run_generate(self, name: str, argv: list) -> tuple | None:
        """Run tools/generate.py for row ``name``: exit 0 and 1..NEW_TOKENS ids in the
        vocabulary; (ids, the finished process), or None after a FAIL row."""
        c = self.check
        c.show_gpu_command(name, "python " + shlex.join(argv))
        done = self._tool(name, argv, 150)
        if done is None:
            return None
        ids = printed_ids(open(done.log, errors="replace").read())
        problems = ([f"exited {done.rc}" + (" (timed out)" if done.timed_out else "")]
                    if done.rc else []) + ids_verdict(ids, self.eod(), "generate")
        if problems:
            c.fail(name, "; ".join(problems), done.log, done.seconds)
            return None
        return ids, done

    def _generate(self, name: str, argv: list) -> list | None:
        """A tools/generate.py row judged on its own output (``_run_generate``); the ids."""
        ran = self._run_generate(name, argv)
        if ran is None:
            return None
        ids, done = ran
        self.check.report.add(Result(name, self.check.status(True), f"prompt {PROMPT} -> {ids}",
                                     done.seconds, numbers={"ids": ids}, log=done.log))
        return ids

    def generate_and_serve(self, ckpt: str):
        """tools/generate.py and tools/serve.py on the smoke checkpoint: both answer, and the
        server's greedy completion equals generate's ids (one decode path behind both). Both
        build the local layers by default whatever the checkpoint was saved with (the TE
        checkpoint's weights map by name); generate also runs with --transformer-impl
        transformer_engine, the layers the checkpoint was trained with, judged against the
        local build (``te_generate``). Both generate in fp32 (--fp32; on a GPU the bf16-trained
        smoke checkpoint would load in bf16): the TE row compares their ids with fp32 logits,
        and the server, in fp32 too, must answer the local ids."""
        c = self.check
        ids = self._generate("generate: smoke checkpoint (TE) via tools/generate.py",
                             generate_argv(ckpt, *rows.FP32))
        if ids is None:
            return
        self.te_generate(ckpt, ids)

        name = "serve: smoke checkpoint (TE) via tools/serve.py + POST /v1/completions"
        port = _free_port()
        argv = serve_argv(ckpt, port)
        c.show_gpu_command(name, "python " + shlex.join(argv) + " & curl -s localhost:"
                           f"{port}/v1/completions -d '{{\"prompt\": {PROMPT}, \"max_tokens\": "
                           f"{NEW_TOKENS}, \"temperature\": 0}}'")
        log = c.log_path(name)
        t = min(180.0, c.left())
        if t < 20:
            return c.report.add(Result(name, "FAIL", f"not run: out of time (budget "
                                                     f"{c.budget:.0f} s)"))
        start = time.time()
        problems, text = [], None
        with procs.started([PY, *argv], log, ROOT, c.env, name) as proc:
            base = f"http://127.0.0.1:{port}"
            ready = False
            while not ready and not problems:  # up: /health answers 200
                if proc.poll() is not None:
                    problems.append(f"the server exited ({proc.returncode}) before answering")
                elif time.time() - start > t:
                    problems.append(f"the server did not answer /health within {t:.0f} s")
                else:
                    try:
                        ready = _http(base + "/health", timeout=5)[0] == 200
                    except (urllib.error.URLError, OSError):
                        time.sleep(0.5)  # not listening yet
            if ready:  # one request, as a user sends it; its failure is the row's finding
                try:
                    _, body = _http(base + "/v1/completions",
                                    {"prompt": PROMPT, "max_tokens": NEW_TOKENS,
                                     "temperature": 0},
                                    timeout=max(t - (time.time() - start), 30))
                    text = body["choices"][0]["text"]
                except urllib.error.HTTPError as exc:
                    problems.append(f"POST /v1/completions answered {exc.code}: "
                                    f"{exc.read().decode(errors='replace')[:300]}")
                except (urllib.error.URLError, OSError) as exc:
                    problems.append(f"POST /v1/completions got no answer: {exc!r}")
        secs = time.time() - start
        if not problems:
            got = [int(x) for x in text.split()]
            eod = self.eod()
            # The server does not return the end-of-document token's text.
            want = ids[:-1] if ids and ids[-1] == eod else ids
            if got != want:
                problems.append(f"greedy completion {got} differs from tools/generate.py's "
                                f"{want}")
        if problems:
            return c.fail(name, "; ".join(problems), log, secs)
        c.report.add(Result(name, c.status(True), f"greedy completion {got} equals "
                            f"tools/generate.py's", secs, numbers={"ids": got}, log=log))

    def te_generate(self, ckpt: str, ids: list):
        """tools/generate.py --fp32 --transformer-impl transformer_engine on the smoke
        checkpoint, judged against the local build of the same checkpoint (``ids``: the local
        tool's greedy ids, --fp32 too): the teacher-forced fp32 logits of the prompt and ``ids`` from both builds, in the
        worker, and TE's greedy ids against them (rows.te_generation_verdict). Without a GPU,
        generation refuses TE: swapped for local, the tool's command line is the previous row's
        (its ids reused) and both logits come from the local build, so the same comparison runs
        and must find them bitwise equal."""
        c = self.check
        name = ("generate: smoke checkpoint (TE) via tools/generate.py --transformer-impl "
                "transformer_engine")
        argv = [*generate_argv(ckpt, *rows.FP32), *rows.TE]
        if c.gpu:
            ran = self._run_generate(name, argv)
            if ran is None:
                return
            te_ids, done = ran
            log, secs = done.log, done.seconds
        else:
            c.show_gpu_command(name, "python " + shlex.join(argv))
            say(f"{name}: the same CPU command line as the previous row; its ids reused")
            te_ids, log, secs = ids, None, 0.0
        te_impl = "transformer_engine" if c.gpu else "local"
        value = c.in_worker(name, "generation_logits", {"load": ckpt, "impls": ["local", te_impl],
                                                        "ids": [*PROMPT, *ids]}, 60)
        if value is None:  # (in_worker reported the FAIL row)
            return
        self.judge_te_generate(name, ids, te_ids, value["logits"], log or c.last_log,
                               secs + c.last_secs, c.last_log)

    def judge_te_generate(self, name: str, ids: list, te_ids: list, logits: list,
                          log: str | None, secs: float | None, logits_log: str | None):
        """The TE generate row's verdict from what ran: ``logits`` = [local, TE] teacher-forced
        logits of PROMPT + ``ids``; a correctness row (a FAIL sets the exit status)."""
        c = self.check
        ok, detail, numbers = rows.te_generation_verdict(logits[0], logits[1], ids, te_ids,
                                                         len(PROMPT))
        numbers.update(ids=te_ids, local_ids=ids, logits_log=logits_log)
        c.report.add(Result(name, c.status(ok), f"prompt {PROMPT} -> {te_ids}; {detail}", secs,
                            numbers=numbers, log=log))

    def fp8_checkpoint(self):
        """Train 2 steps with FP8 and save (in the worker), then generate from that checkpoint
        with tools/generate.py."""
        c = self.check
        d = os.path.join(c.out, "fp8_ckpt")
        os.makedirs(d, exist_ok=True)
        argv = fp8_train_argv(d)
        name = "FP8 checkpoint: train 2 (tensorwise) + save"
        rc = c.in_worker(name, "pretrain", {"argv": c.argv(argv)}, 90,
                         f"pretrain_looplm.py {shlex.join(argv)} (in the worker)")
        if rc is None:
            return
        problems = rows.smoke_verdict(rows.train_records(os.path.join(d, "train.jsonl")),
                                      [1, 2], rc, "train 2")
        if not os.path.isdir(os.path.join(d, "ckpt", "iter_0000002")):
            problems.append("no checkpoint iter_0000002")
        if problems:
            return c.fail(name, "; ".join(problems), c.last_log, c.last_secs)
        c.report.add(Result(name, c.status(True), "2 steps applied, saved iter_0000002"
                            + ("" if c.gpu else " (FP8 flags dropped on CPU)"), c.last_secs,
                            log=c.last_log))
        self._generate("FP8 checkpoint: generate via tools/generate.py",
                       generate_argv(os.path.join(d, "ckpt")))

    def rl(self):
        """Two RL steps of train_rl.py (in the worker) with a KL to the reference policy: both
        logged with finite log-probs and KL."""
        c = self.check
        d = os.path.join(c.out, "rl")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "rl_env.py"), "w") as f:
            f.write(RL_ENV)
        argv = rl_argv(d)
        name = "RL: 2 GRPO steps with a reference policy (train_rl.py)"
        rc = c.in_worker(name, "train_rl", {"argv": c.argv(argv)}, 120,
                         f"train_rl.py {shlex.join(argv)} (in the worker)")
        if rc is None:
            return
        records = rows.train_records(os.path.join(d, "rl.jsonl"))
        problems = [] if rc == 0 else [f"train_rl.py exited {rc}"]
        if [r.get("iteration") for r in records] != [1, 2]:
            problems.append(f"logged iterations {[r.get('iteration') for r in records]}, "
                            f"expected [1, 2]")
        values = [v for r in records for v in (*r.get("step_log_probs", []), r.get("kl"))]
        if records and not rows.finite(values):
            problems.append(f"non-finite log-probs or KL: {values}")
        if problems:
            return c.fail(name, "; ".join(problems), c.last_log, c.last_secs)
        c.report.add(Result(name, c.status(True), f"2 steps; reward "
                            f"{[r['reward_mean'] for r in records]}, KL "
                            f"{[round(r['kl'], 6) for r in records]}", c.last_secs,
                            log=c.last_log))
