"""Serving throughput and latency of tools/serve.py, early exit on and off, side by side with
Hugging Face generate() on the exported model (prints, never asserts).

    bash examples/demo_cpu.sh            # trains the demo model and saves demo/checkpoint
    python benchmarks/serve.py [--load demo/checkpoint --data-path demo/corpus_text_document]
    python benchmarks/serve.py --before-tree /tmp/old   # also a server from another checkout

Servers of this tree are started as subprocesses on the same checkpoint, one at full depth, one
with ``--exit RULE`` and one with ``--speculate d:k``, and driven through the ``openai`` client (asyncio) at each
``--concurrency``: a cell sends max(c, --min-requests) streamed completions, greedy, every
prompt ``--prompt-length`` held-out token ids, every answer ``--max-tokens`` tokens
(``ignore_eos``; a server that refuses that field is asked without it and the table shows the
tokens it returned). Per cell: output tokens/s over the cell's wall time, time to first token and
inter-token latency (per request: from its first token to its last over the tokens in between,
which holds when a server sends several tokens in one chunk), p50/p99 over the cell's requests.
Hugging Face ``generate()`` runs in this process on the folder ``export-hf`` writes, the first
prompts of the same set, batch 1 and 16, greedy, exactly ``--max-tokens`` new tokens.

Every cell is measured ``--repeats`` times, the repeats interleaved across servers (and HF) so
that the machine's load falls on all alike; a figure is the mean and (range) of its repeats. A
ratio is taken within each repeat (the two figures measured minutes apart, under the same
load) and reported as the mean and range of those; a goal counts as met only when the whole
range clears it. The exit rule's held-out loss increase is measured here too, the way
benchmarks/decode.py measures it (deterministic: no spread). Quality beside every speed-up:
each server's greedy answers to the first ``--agreement-prompts`` prompts are compared with the
full-depth server's (speculation must give the same text; early exit's share of identical
answers is reported), and the speculating server's acceptance rate is read from its ``/stats``.

The disconnect check streams one long answer beside a few busy rows, closes the stream after a
few tokens, and reads from the server's request log how many tokens that request still
generated after the client left (one per decoding step of its row).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

GOAL_BATCHING = 6.0  # tokens/s at concurrency 16 over concurrency 1
GOAL_EXIT = 1.4  # early exit over full depth at concurrency 16
GOAL_EXIT_LOSS = 0.01  # ... at this held-out loss increase at most
GOAL_HF = 3.0  # the server at concurrency 16 over HF generate() at batch 16
GOAL_HF_ONE = 1.0  # the server at concurrency 1 over HF generate() at batch 1
GOAL_SPECULATE = 1.5  # self-speculation over full depth at concurrency 1 (greedy text identical)


# --- figures over repeats ------------------------------------------------------------------------
@dataclass
class Spread:
    """A figure measured several times: its mean and range."""

    mean: float
    lo: float
    hi: float

    @classmethod
    def of(cls, values) -> "Spread":
        values = list(values)
        if not values:
            raise ValueError("a figure needs at least one measurement")
        return cls(sum(values) / len(values), min(values), max(values))

    def fmt(self, digits: int = 1) -> str:
        return f"{self.mean:.{digits}f} ({self.lo:.{digits}f}-{self.hi:.{digits}f})"


def ratio(nums: list, dens: list) -> Spread:
    """nums[i] / dens[i] within each repeat i: their mean and range."""
    if len(nums) != len(dens):
        raise ValueError(f"a ratio pairs repeats: {len(nums)} against {len(dens)}")
    return Spread.of(n / d for n, d in zip(nums, dens))


def verdict(r: Spread, goal: float) -> str:
    """'met' when all of the range is at least ``goal``, 'not met' when all of it is below,
    else the spread decides nothing."""
    if r.lo >= goal:
        return "met"
    if r.hi < goal:
        return "not met"
    return "not decided (the goal lies within the spread)"


def percentile(values, q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


@dataclass
class Cell:
    """One cell measured once: the streamed requests' timings."""

    wall_s: float
    tokens: list  # completion tokens of each request (from the usage chunk)
    ttft_s: list  # send -> first token chunk, per request
    itl_s: list  # (last token's arrival - first's) / (tokens - 1), per request
    chunks: int  # token chunks received in all

    @classmethod
    def of(cls, wall_s: float, results: list) -> "Cell":
        """From each request's (send time, token-chunk arrival times, completion tokens or None:
        then its chunks are counted)."""
        ttft = [a[0] - sent for sent, a, _ in results if a]
        tokens = [t if t is not None else len(a) for _, a, t in results]
        # A server may put several tokens into one chunk (text that arrived together): the gap
        # between chunks is not a token's. Per request: the time from its first token to its
        # last over the tokens in between (GenAI-Perf's inter-token latency).
        itl = [(a[-1] - a[0]) / (t - 1) for (_, a, _), t in zip(results, tokens) if t > 1 and a]
        return cls(wall_s, tokens, ttft, itl, sum(len(a) for _, a, _ in results))

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens) / self.wall_s


def summarize(cells: list) -> dict:
    """Per figure of a cell's repeats, its Spread (latencies in ms)."""
    return {"tok/s": Spread.of(c.tokens_per_s for c in cells),
            "ttft50": Spread.of(1e3 * percentile(c.ttft_s, 50) for c in cells),
            "ttft99": Spread.of(1e3 * percentile(c.ttft_s, 99) for c in cells),
            "itl50": Spread.of(1e3 * percentile(c.itl_s, 50) for c in cells),
            "itl99": Spread.of(1e3 * percentile(c.itl_s, 99) for c in cells),
            "tokens": Spread.of(sum(c.tokens) / len(c.tokens) for c in cells)}


def table(rows: list) -> str:
    """A markdown table of (server, mode, concurrency, requests, summary) rows."""
    head = ("| server | mode | concurrency | requests | tokens/request | output tok/s | "
            "TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |\n" + "|---" * 10 + "|")
    lines = [head]
    for server, rule, c, n, s in rows:
        lines.append(f"| {server} | {rule} | {c} | {n} | {s['tokens'].mean:.1f} | "
                     f"{s['tok/s'].fmt()} | {s['ttft50'].fmt(0)} | {s['ttft99'].fmt(0)} | "
                     f"{s['itl50'].fmt(1)} | {s['itl99'].fmt(1)} |")
    return "\n".join(lines)


# --- arguments -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--load", default="demo/checkpoint", help="megaloop checkpoint to serve")
    p.add_argument("--data-path", default="demo/corpus_text_document",
                   help="indexed dataset whose last documents give the prompts and the held-out "
                        "windows")
    p.add_argument("--exit", default="kl:0.3",
                   help="the early-exit server's rule (default kl:0.3: benchmarks/decode.py's "
                        "per-token rule of lowest depth within 1%% held-out loss on the demo)")
    p.add_argument("--speculate", default="2:4",
                   help="the speculating server's d:k (default 2:4; '' leaves it out)")
    p.add_argument("--agreement-prompts", type=int, default=8,
                   help="greedy answers compared with full depth's, per server")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated client counts")
    p.add_argument("--min-requests", type=int, default=8,
                   help="a cell sends max(concurrency, this) requests")
    p.add_argument("--prompt-length", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--repeats", type=int, default=3, help="measurements of every cell")
    p.add_argument("--hf-batch", default="1,16",
                   help="Hugging Face generate() batch sizes ('' to skip)")
    p.add_argument("--hf-folder", default=None,
                   help="an export-hf folder of --load (default: exported into a temporary "
                        "folder by tools/convert_checkpoint.py export-hf)")
    p.add_argument("--tree", default=ROOT,
                   help="the checkout whose tools/serve.py is measured (default: this one)")
    p.add_argument("--label", default="this tree", help="its name in the table")
    p.add_argument("--before-tree", default=None,
                   help="another checkout whose tools/serve.py is measured too, as 'before'")
    p.add_argument("--threads", type=int, default=1,
                   help="OMP_NUM_THREADS of every server, and torch threads of HF generate()")
    p.add_argument("--disconnect-after", type=int, default=3,
                   help="token chunks the disconnecting client reads before it closes")
    p.add_argument("--windows", type=int, default=8, help="held-out windows (exit-rule loss)")
    p.add_argument("--window-length", type=int, default=96)
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds a server may take to answer /health")
    return p


def _ints(flag: str, text: str) -> list:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: comma-separated integers expected, e.g. 1,4,16")
    if any(v < 1 for v in values):
        raise ValueError(f"{flag} {text!r}: every value must be at least 1")
    return values


def check_args(a) -> None:
    """Bad input, one line each, before anything starts."""
    a.concurrency = _ints("--concurrency", a.concurrency)
    if not a.concurrency:
        raise ValueError("--concurrency '': name at least one client count, e.g. 1,4,16,64")
    a.hf_batch = _ints("--hf-batch", a.hf_batch)
    for flag in ("min_requests", "prompt_length", "max_tokens", "repeats", "threads",
                 "disconnect_after", "windows", "agreement_prompts"):
        if getattr(a, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(a, flag)}: must be at least 1")
    if a.disconnect_after >= a.max_tokens:
        raise ValueError(f"--disconnect-after {a.disconnect_after}: must be below --max-tokens "
                         f"{a.max_tokens}, or the answer ends before the client leaves")
    if a.window_length < 4:
        raise ValueError(f"--window-length {a.window_length}: must be at least 4")
    if not os.path.isdir(a.load):
        raise ValueError(f"--load {a.load}: no checkpoint there; run `bash examples/demo_cpu.sh` "
                         f"first")
    for flag in ("tree", "before_tree"):
        tree = getattr(a, flag)
        if tree and not os.path.isfile(os.path.join(tree, "tools", "serve.py")):
            raise ValueError(f"--{flag.replace('_', '-')} {tree}: no tools/serve.py there")
    if a.hf_folder and not os.path.isfile(os.path.join(a.hf_folder, "config.json")):
        raise ValueError(f"--hf-folder {a.hf_folder}: no config.json there (an export-hf folder "
                         f"is expected)")
    from megaloop.inference.early_exit import parse_exit

    from megaloop.inference.speculation import parse_speculate

    parse_exit(a.exit)  # its own one-line error for a malformed rule
    parse_speculate(a.speculate)


# --- servers -------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One tools/serve.py subprocess, its log in a file."""

    def __init__(self, label: str, tree: str, load: str, mode, threads: int, logdir: str):
        # mode: None (full depth), an exit rule, or "speculate d:k"
        self.label, self.mode = label, mode
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        name = (mode or "full").replace(":", "_").replace(" ", "_")
        self.log_path = os.path.join(logdir, f"{label}-{name}.log")
        cmd = [sys.executable, os.path.join(tree, "tools", "serve.py"), "--load",
               os.path.abspath(load), "--port", str(self.port), "--model-name", "bench"]
        if mode and mode.startswith("speculate "):
            cmd += ["--speculate", mode.split(" ", 1)[1]]
        elif mode:
            cmd += ["--exit", mode]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        self.log = open(self.log_path, "w")
        # Run where this benchmark runs: a run's tokenizer path may be relative to there.
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.ignore_eos = True

    def wait(self, timeout: float) -> None:
        import httpx

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} server exited with {self.proc.returncode}; "
                                   f"its log: {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.label} server gave no /health in {timeout:.0f} s; its log: "
                           f"{self.log_path}")

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _client(server: Server):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=900)


async def _stream(client, server: Server, prompt: list, max_tokens: int, close_after=None):
    """One streamed completion: (send time, arrival time of each token chunk, completion tokens
    from the usage chunk or None when the client closed early)."""
    extra = {"ignore_eos": True} if server.ignore_eos else {}
    sent = time.perf_counter()
    stream = await client.completions.create(
        model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra)
    arrivals, tokens = [], None
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        # A token's chunk has text, or no finish reason yet (a token whose text is still empty,
        # e.g. half a multi-byte character); the last chunk of a choice carries only its finish.
        arrivals += [now for ch in chunk.choices if ch.text or ch.finish_reason is None]
        if close_after is not None and len(arrivals) >= close_after:
            await stream.close()
            return sent, arrivals, None
    return sent, arrivals, tokens


async def _cell(server: Server, prompts: list, concurrency: int, max_tokens: int) -> Cell:
    client = _client(server)
    gate = asyncio.Semaphore(concurrency)

    async def one(p):
        async with gate:
            return await _stream(client, server, p, max_tokens)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - start
    await client.close()
    return Cell.of(wall, results)


async def _greedy(server: Server, prompts: list, max_tokens: int) -> list:
    """The server's greedy answer (text) to each prompt, one request at a time."""
    client = _client(server)
    texts = []
    for p in prompts:
        r = await client.completions.create(model="bench", prompt=p, max_tokens=max_tokens,
                                            temperature=0)
        texts.append(r.choices[0].text)
    await client.close()
    return texts


async def _probe(server: Server, prompt: list) -> None:
    """Warm the server up; ask without ignore_eos if it refuses that field."""
    from openai import BadRequestError

    client = _client(server)
    try:
        await _stream(client, server, prompt, 4)
    except BadRequestError as exc:
        if "ignore_eos" not in str(exc):
            raise
        server.ignore_eos = False
        print(f"  {server.label} server refuses ignore_eos: its answers stop at the end of a "
              f"document (see tokens/request)", flush=True)
        await _stream(client, server, prompt, 4)
    await client.close()


_CANCELLED = re.compile(r"stream cancelled[^;]*; .*?completion_tokens=(\d+)")


async def _stats(http, server: Server):
    """The server's engine counters (GET /stats), or None where it has none."""
    r = await http.get(server.url + "/stats")
    return r.json() if r.status_code == 200 and "steps" in r.json() else None


async def _disconnect(server: Server, prompts: list, max_tokens: int, after: int) -> str:
    """A client that leaves after ``after`` token chunks, beside three busy rows. With the
    engine's counters (GET /stats): the engine steps from the last poll before the close to the
    first poll that shows its row gone (an upper bound: a poll takes time too). From the request
    log: the tokens its request still generated after the client left."""
    import httpx

    client = _client(server)
    logged = len(_CANCELLED.findall(server.log_text()))
    busy = [asyncio.create_task(_stream(client, server, p, max_tokens)) for p in prompts[1:4]]
    extra = {"ignore_eos": True} if server.ignore_eos else {}
    got, report = 0, []
    async with httpx.AsyncClient(timeout=60) as http:
        stream = await client.completions.create(
            model="bench", prompt=prompts[0], max_tokens=max_tokens, temperature=0, stream=True,
            extra_body=extra)
        async for chunk in stream:
            got += sum(1 for ch in chunk.choices if ch.text or ch.finish_reason is None)
            if got >= after:
                break
        before = await _stats(http, server)
        await stream.close()
        closed = time.perf_counter()
        if before is not None:
            while True:
                now = await _stats(http, server)
                if now["running"] < before["running"] or time.perf_counter() - closed > 30:
                    break
            if now["running"] < before["running"]:
                report.append(f"its row was gone {now['steps'] - before['steps']} engine steps "
                              f"after the last poll before the close "
                              f"({1e3 * (time.perf_counter() - closed):.0f} ms after the close)")
            else:
                report.append("its row was still running 30 s after the close")
    await asyncio.gather(*busy)
    await client.close()
    for _ in range(50):  # the log line is written when the server has finished the request
        found = _CANCELLED.findall(server.log_text())
        if len(found) > logged:
            generated = int(found[-1])
            report.append(f"the server generated {generated} tokens for it, {generated - got} "
                          f"after the client had read {got}")
            break
        await asyncio.sleep(0.2)
    else:
        report.append("no 'stream cancelled' line in the server's log")
    return f"closed after {got} token chunks; " + "; ".join(report)


# --- Hugging Face generate() ---------------------------------------------------------------------
def _export(load: str, out: str) -> None:
    cmd = [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "export-hf",
           "--load", load, "--out", out]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"export-hf failed ({done.returncode}): {done.stderr.strip()[-500:]}")


def _hf_model(folder: str):
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()


def hf_tokens_per_s(model, prompts: list, max_tokens: int) -> float:
    """Greedy generate() of exactly ``max_tokens`` new tokens per prompt, all in one batch (the
    prompts are of one length: no padding)."""
    import torch

    ids = torch.tensor(prompts)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_tokens, min_new_tokens=max_tokens)
    wall = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + max_tokens  # min_new_tokens held
    return len(prompts) * max_tokens / wall


def verdicts(tps: dict, hf: dict, rule: str, increase: float, disconnect,
             speculate: str = "", identical=None, acceptance=None) -> list:
    """The issue's goals, one line each, from per-repeat tokens/s: ``tps[(mode, concurrency)]``
    (mode None: full depth; the exit rule; "speculate d:k"), ``hf[batch]``; ``increase``: the
    exit rule's held-out loss increase; ``identical``: the speculating server's greedy answers
    that equal full depth's, (equal, asked); ``acceptance``: its accepted / drafted."""
    lines = []
    if (None, 1) in tps and (None, 16) in tps:
        r = ratio(tps[(None, 16)], tps[(None, 1)])
        lines.append(f"concurrency 16 vs 1 (full depth): {r.fmt(2)}x, goal >= "
                     f"{GOAL_BATCHING:g}x: {verdict(r, GOAL_BATCHING)}")
    if (rule, 16) in tps and (None, 16) in tps:
        r = ratio(tps[(rule, 16)], tps[(None, 16)])
        ok = verdict(r, GOAL_EXIT)
        if increase > GOAL_EXIT_LOSS:
            ok = f"not met (held-out loss {increase:+.2%} > {GOAL_EXIT_LOSS:+.0%})"
        lines.append(f"early exit ({rule}) vs full depth at concurrency 16: {r.fmt(2)}x at "
                     f"{increase:+.2%} held-out loss, goal >= {GOAL_EXIT:g}x at <= "
                     f"{GOAL_EXIT_LOSS:.0%}: {ok}")
    if (None, 16) in tps and 16 in hf:
        r = ratio(tps[(None, 16)], hf[16])
        lines.append(f"server at concurrency 16 (full depth) vs HF generate() at batch 16: "
                     f"{r.fmt(2)}x, goal >= {GOAL_HF:g}x: {verdict(r, GOAL_HF)}")
    if (None, 1) in tps and 1 in hf:
        r = ratio(tps[(None, 1)], hf[1])
        lines.append(f"server at concurrency 1 (full depth) vs HF generate() at batch 1: "
                     f"{r.fmt(2)}x, goal >= {GOAL_HF_ONE:g}x: {verdict(r, GOAL_HF_ONE)}")
    mode = f"speculate {speculate}"
    if speculate and (mode, 1) in tps and (None, 1) in tps:
        r = ratio(tps[(mode, 1)], tps[(None, 1)])
        ok = verdict(r, GOAL_SPECULATE)
        same = "" if identical is None else f", greedy text identical in {identical[0]} of " \
                                              f"{identical[1]} answers"
        if identical is not None and identical[0] != identical[1]:
            ok = "not met (the text differs from full depth's)"
        rate = "" if acceptance is None else f", acceptance {acceptance:.2f}"
        lines.append(f"self-speculation ({speculate}) vs full depth at concurrency 1: "
                     f"{r.fmt(2)}x{same}{rate}, goal >= {GOAL_SPECULATE:g}x with identical "
                     f"text: {ok}")
    if disconnect is not None:
        lines.append(f"disconnect (goal: freed within one decoding step): {disconnect}")
    return lines


# --- the run -------------------------------------------------------------------------------------
def exit_loss(a, windows):
    """(full-depth held-out loss, loss under --exit, mean depth) as benchmarks/decode.py
    measures them, in this process."""
    sys.path.insert(0, HERE)
    from decode import decode_loss

    from megaloop.inference.early_exit import parse_exit
    from megaloop.inference.loading import load_for_generation, setup_processes

    setup_processes()
    model, _, _ = load_for_generation(a.load)
    T = model.loop.num_loops
    base, _ = decode_loss(model, windows, T, "full", None)
    loss, depth = decode_loss(model, windows, T, "full", parse_exit(a.exit))
    return base, loss, depth, T


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    try:
        check_args(a)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from megaloop.runtime import quiet_megatron

    quiet_megatron()
    import torch

    from megaloop.data.heldout import validation_windows

    torch.set_num_threads(a.threads)
    n_prompts = max(max(a.concurrency), a.min_requests, max(a.hf_batch, default=1), 4,
                    a.agreement_prompts)
    length = max(a.window_length, a.prompt_length)
    data = torch.from_numpy(validation_windows(a.data_path, a.windows + n_prompts, length))
    windows = data[:a.windows, :a.window_length]
    prompts = data[a.windows:, :a.prompt_length].tolist()

    load = os.popen("cat /proc/loadavg").read().split()[:3]
    print(f"serving benchmark, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{os.cpu_count()} CPUs, load average {' '.join(load)} at the start; checkpoint "
          f"{a.load}; {a.prompt_length} prompt tokens, {a.max_tokens} output tokens, greedy; "
          f"{a.threads} thread(s) per server and for HF; {a.repeats} repeats", flush=True)
    base, loss, depth, T = exit_loss(a, windows)
    increase = loss / base - 1
    print(f"held-out loss ({a.windows} windows of {a.window_length}): full depth T={T} "
          f"{base:.4f}; --exit {a.exit} {loss:.4f} ({increase:+.2%}), mean depth {depth:.2f}",
          flush=True)

    logdir = tempfile.mkdtemp(prefix="bench_serve_")
    trees = [(a.label, os.path.abspath(a.tree))] + ([("before", os.path.abspath(a.before_tree))]
                                     if a.before_tree else [])
    # (the before-tree predates --speculate)
    servers = [Server(label, tree, a.load, mode, a.threads, logdir)
               for label, tree in trees
               for mode in (None, a.exit) + ((f"speculate {a.speculate}",)
                                             if a.speculate and label != "before" else ())]
    hf = None
    try:
        for s in servers:
            s.wait(a.startup_timeout)
        for s in servers:
            asyncio.run(_probe(s, prompts[0]))
        answers = {s: asyncio.run(_greedy(s, prompts[:a.agreement_prompts], a.max_tokens))
                   for s in servers}
        if a.hf_batch:
            folder = a.hf_folder
            if folder is None:
                folder = os.path.join(logdir, "hf")
                _export(a.load, folder)
            hf = _hf_model(folder)
            hf_tokens_per_s(hf, prompts[:1], 2)  # warm-up

        cells = {}  # (server index, concurrency) -> [Cell]
        hf_runs = {b: [] for b in a.hf_batch}
        for r in range(a.repeats):
            for c in a.concurrency:
                order = servers[r % len(servers):] + servers[:r % len(servers)]
                for s in order:
                    cell = asyncio.run(_cell(s, prompts[:max(c, a.min_requests)], c,
                                             a.max_tokens))
                    cells.setdefault((servers.index(s), c), []).append(cell)
            for b in a.hf_batch:
                hf_runs[b].append(hf_tokens_per_s(hf, prompts[:b], a.max_tokens))
            print(f"  repeat {r + 1}/{a.repeats} done", flush=True)

        disconnect = {s.label: asyncio.run(_disconnect(s, prompts, a.max_tokens,
                                                       a.disconnect_after))
                      for s in servers if s.mode is None}
        acceptance = {}
        for s in servers:
            if s.mode and s.mode.startswith("speculate "):
                import httpx

                stats = httpx.get(s.url + "/stats", timeout=30).json()
                acceptance[s.label] = stats["accepted"] / max(stats["drafted"], 1)
    finally:
        for s in servers:
            s.stop()

    rows = [(servers[i].label, servers[i].mode or "off", c, max(c, a.min_requests),
             summarize(cs)) for (i, c), cs in sorted(cells.items())]
    load = os.popen("cat /proc/loadavg").read().split()[:3]
    print(f"\nload average {' '.join(load)} at the end; figures: mean (range) over "
          f"{a.repeats} repeats\n")
    print(table(rows))
    for (i, c), cs in sorted(cells.items()):
        chunks, tokens = sum(x.chunks for x in cs), sum(sum(x.tokens) for x in cs)
        if chunks != tokens:  # several tokens' text in one chunk (or a token without text)
            print(f"note: {servers[i].label} {servers[i].mode or 'off'} c{c}: {chunks} "
                  f"token chunks for {tokens} tokens")
    if hf_runs:
        print("\n| Hugging Face generate() (export-hf folder, KV cache) | batch | output tok/s |"
              "\n|---|---|---|")
        for b, runs in hf_runs.items():
            print(f"| greedy, {a.max_tokens} new tokens | {b} | {Spread.of(runs).fmt()} |")
    print("\ngreedy answers equal to full depth's (same server tree, "
          f"{a.agreement_prompts} prompts):")
    for s in servers:
        if s.mode is not None:
            full = next(f for f in servers if f.label == s.label and f.mode is None)
            same = sum(x == y for x, y in zip(answers[s], answers[full]))
            print(f"  {s.label}, {s.mode}: {same} of {len(answers[s])}")
    for label, _ in trees:
        tps = {(srv.mode, c): [cell.tokens_per_s for cell in cells[(i, c)]]
               for i, srv in enumerate(servers) if srv.label == label for c in a.concurrency}
        spec = next((s for s in servers if s.label == label and s.mode
                     and s.mode.startswith("speculate ")), None)
        identical = None
        if spec is not None:
            full = next(f for f in servers if f.label == label and f.mode is None)
            identical = (sum(x == y for x, y in zip(answers[spec], answers[full])),
                         len(answers[spec]))
        print(f"\nverdicts ({label}; ratios within each repeat, mean (range)):")
        for line in verdicts(tps, hf_runs, a.exit, increase, disconnect.get(label),
                             a.speculate if spec else "", identical, acceptance.get(label)):
            print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
